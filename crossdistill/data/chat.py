"""Chat rendering that keeps message contents apart from template text.

Each tokenizer renders a conversation with its own chat template. To know which characters of
the rendering are message contents (aligned across tokenizers, eligible for KD) and which are
template (role headers, turn markers: CE only), the template is applied to the conversation with
every content replaced by a unique marker; the rendering then splits at the markers into
`M + 1` template pieces around the `M` contents. Contents are tokenized on their own and
template pieces on their own, so no token ever straddles the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from crossdistill.data.documents import Message
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.sources import Bad


def _marker(k: int) -> str:
    return f"@@crossdistill:message:{k}@@"


@dataclass(frozen=True)
class ChatLayout:
    """A rendered conversation: `templates[k]` comes before `contents[k]`, and
    `templates[-1]` after the last content. `assistant[k]` says who wrote `contents[k]`."""

    templates: list[str]
    contents: list[str]
    assistant: list[bool]


def render_layout(side: TokenizerSide, messages: list[Message]) -> ChatLayout | Bad:
    """Render `messages` with `side`'s chat template and split contents from template text.
    Messages with empty content render as template only."""
    with_content = [i for i, m in enumerate(messages) if m.content]
    marked = [
        {"role": m.role, "content": _marker(i) if m.content else ""} for i, m in enumerate(messages)
    ]
    try:
        rendered = side.render_chat(marked)
    except Exception as e:  # a template may raise anything (jinja errors, raise_exception)
        if type(e).__name__ == "UserError":
            raise
        return Bad(f"chat template of {side.name} failed: {type(e).__name__}: {e}")
    templates: list[str] = []
    pos = 0
    for i in with_content:
        marker = _marker(i)
        at = rendered.find(marker, pos)
        if at < 0 or rendered.count(marker) != 1:
            return Bad(
                f"chat template of {side.name} does not render message {i} "
                f"({messages[i].role}) exactly once, as it is"
            )
        templates.append(rendered[pos:at])
        pos = at + len(marker)
    templates.append(rendered[pos:])
    return ChatLayout(
        templates=templates,
        contents=[messages[i].content for i in with_content],
        assistant=[messages[i].role == "assistant" for i in with_content],
    )

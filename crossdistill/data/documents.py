"""From raw field values to documents, and the bad-input policy.

A document is plain text (`str`) or a conversation (`list[Message]`). Anything else is `Bad`
and goes through `BadInputPolicy`: `skip` logs a counted warning naming file and line and moves
on; `error` stops with a `UserError` naming file and line. A batch is never built from a row
that failed a check. Long texts are cut into pieces (`text_pieces`), and a share of a text is
taken as pieces spread through it (`spread_pieces`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from crossdistill.data.sources import Bad
from crossdistill.errors import UserError

log = logging.getLogger("crossdistill.data")

# Long texts are tokenized in pieces of about this many characters, cut after a newline where
# one is near, so no worker ever holds the token arrays of a whole huge document.
PIECE_CHARS = 1 << 18
_WARN_FIRST = 10  # per process: name every bad row up to here, then every power of ten


@dataclass(frozen=True)
class Message:
    role: str
    content: str


Document = str | list[Message]


def check_document(value: Any, kind: Literal["text", "chat"], field: str) -> Document | Bad:
    """Validate one field value: a non-empty UTF-8 string, or a list of OpenAI-style messages
    (`{"role": str, "content": str}`) with at least one non-empty content. Message contents are
    stripped of surrounding whitespace, because several chat templates trim them while others do
    not, and the contents must be the same text for every tokenizer."""
    if isinstance(value, Bad):
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            return Bad(f"non-UTF-8 bytes in field {field!r} at byte {e.start}")
    if kind == "text":
        if not isinstance(value, str):
            return Bad(f"field {field!r} is a {type(value).__name__}, not a string")
        if not value.strip():
            return Bad("empty document")
        return value
    return _check_messages(value, field)


def _check_messages(value: Any, field: str) -> Document | Bad:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return Bad(f"field {field!r} is a string, not a list of messages")
    if not isinstance(value, list):
        return Bad(f"field {field!r} is a {type(value).__name__}, not a list of messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return Bad(f"message {i} has no string 'role'")
        content = m.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):
            return Bad(f"message {i} content is a {type(content).__name__}, not a string")
        messages.append(Message(m["role"], content.strip()))
    if not any(m.content for m in messages):
        return Bad("empty document (no message has content)")
    return messages


def text_pieces(text: str, piece_chars: int = PIECE_CHARS) -> list[str]:
    """Cut a long text into consecutive pieces of about `piece_chars` characters, each cut right
    after a newline (else a space) in the quarter-piece that follows the nominal position."""
    if len(text) <= piece_chars:
        return [text]
    cuts = [0]
    for nominal in range(piece_chars, len(text), piece_chars):
        lo = max(nominal, cuts[-1] + 1)
        window_end = min(len(text), lo + piece_chars // 4)
        cut = text.find("\n", lo, window_end)
        if cut < 0:
            cut = text.find(" ", lo, window_end)
        cut = lo if cut < 0 else cut + 1
        if cut < len(text):
            cuts.append(cut)
    cuts.append(len(text))
    return [text[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def spread_pieces(pieces: list[str], num_bytes: int) -> list[str]:
    """Whole pieces, about `num_bytes` UTF-8 bytes in all, taken at an even stride through
    `pieces` in their order (all of them when they hold no more): a corpus ordered by source
    (files sorted by path, one dataset after another) gives the students a share of every part
    of it, where its first bytes would be one source only."""
    sizes = [len(p.encode()) for p in pieces]
    stride = sum(sizes) / num_bytes
    if stride <= 1:
        return list(pieces)
    picks = sorted({int(j * stride) for j in range(math.ceil(len(pieces) / stride))})
    return [pieces[i] for i in picks if i < len(pieces)]


class BadInputPolicy:
    """Counts bad rows; `skip` warns (file:line and the running count), `error` raises."""

    def __init__(self, mode: Literal["skip", "error"]):
        if mode not in ("skip", "error"):
            raise UserError(f"data.bad_input must be 'skip' or 'error', got {mode!r}")
        self.mode = mode
        self.num_skipped = 0

    def __call__(self, where: str, reason: str) -> None:
        if self.mode == "error":
            raise UserError(
                f"bad input at {where}: {reason}. Fix or remove that row, "
                "or set data.bad_input=skip to skip bad rows with a warning"
            )
        self.num_skipped += 1
        n = self.num_skipped
        if n <= _WARN_FIRST or str(n).rstrip("0") == "1":
            log.warning("skipped bad input at %s: %s (%d skipped so far)", where, reason, n)


class TextDocuments:
    """The text documents of corpus files, in order, for a command that reads the start of a
    corpus (`bench quality`, `audit`): any format `open_source` reads, `field` the JSONL field
    or table column; the files are read only as far as the consumer takes the documents, a few
    hundred rows at a time. Rows that are not a document are skipped and counted (`note`);
    iterating over a corpus with none is a `UserError` naming the first such row."""

    READ_ROWS = 256

    def __init__(self, paths: list[str], field: str = "text"):
        from crossdistill.data.sources import MissingField, open_source

        self.paths, self.field = paths, field
        self.rows = 0  # rows read, blank JSONL lines left out
        self.skipped: list[tuple[str, str]] = []  # (where, reason) of rows that are not text
        self.opened = 0  # files reached by the last read, in order
        self.sources = []
        for path in paths:
            try:
                self.sources.append(open_source(path, "auto", field))
            except MissingField as e:
                raise e.for_command_line() from None

    def __iter__(self) -> Iterator[str]:
        self.rows, self.skipped, self.opened = 0, [], 0
        found = False
        for i, source in enumerate(self.sources):
            self.opened = i + 1
            for start, stop in source.groups():
                for lo in range(start, stop, self.READ_ROWS):
                    hi = min(stop, lo + self.READ_ROWS)
                    for row, value in enumerate(source.read(lo, hi), lo):
                        if value is None:  # a blank JSONL line
                            continue
                        self.rows += 1
                        doc = check_document(value, "text", self.field)
                        if isinstance(doc, Bad):
                            self.skipped.append((source.where(row), doc.reason))
                            continue
                        found = True
                        yield doc
        if not found:
            first = f": {self.skipped[0][0]}: {self.skipped[0][1]}" if self.skipped else ""
            more = f" (and {len(self.skipped) - 1} more rows)" if len(self.skipped) > 1 else ""
            raise UserError(
                f"no text documents in {', '.join(self.paths)}{first}{more}; the corpus needs "
                f"text rows (a JSONL field or Parquet column named {self.field!r}: name yours "
                "with --text-field; or plain UTF-8 text files)"
            )

    def unread(self) -> list[str]:
        """The files the last read stopped before reaching (the consumer took enough from the
        ones before them)."""
        return self.paths[self.opened :]

    def note(self) -> str | None:
        """How many of the rows read were skipped, and why the first was; None when none."""
        if not self.skipped:
            return None
        where, reason = self.skipped[0]
        return (
            f"skipped {len(self.skipped)} of {self.rows} corpus rows read that are not text "
            f"documents (the first: {where}: {reason})"
        )

"""One tokenizer as the data pipeline uses it: content and template encoding, document
delimiters, byte table.

Document conventions (each tokenizer keeps its own):
- **Start**: plain-text documents start with the tokens the tokenizer itself puts in front of a
  text (Llama-3 `<|begin_of_text|>`, Llama-2 `<s>`), and where it puts none (Qwen, GPT-2, Phi-4)
  with its end-of-document token, as evaluation harnesses condition such models: so every
  tokenizer predicts the first text token too, and bits per byte score every byte on every
  side. A row that continues a document cut by packing starts the same way. A chat document
  starts with whatever its chat template renders (Llama-3's template writes the BOS).
- **End**: every document ends with the tokenizer's end-of-document token: `<|endoftext|>` or
  `<|end_of_text|>` when the vocabulary has it as a special token (the pretraining separator of
  Qwen, GPT-2, Phi and Llama-3, whose chat `eos_token` differs), else `eos_token`. A chat
  rendering that already ends with that token does not get a second one.
- **Content** (document text, message contents) is text, every character of it: a literal
  `<|im_end|>`, `<s>` or `<think>` in a web page is encoded as the characters it is made of,
  never as the control or added token of that name (special or not). Only the pipeline's
  BOS / document end and chat-template text produce added tokens (template text is encoded
  with them parsed).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from crossdistill.data.fast_tokenize import (
    added_pattern,
    as_int64,
    build_fast_encoder,
    content_backend,
)
from crossdistill.errors import UserError

_DOC_END_NAMES = ("<|endoftext|>", "<|end_of_text|>")
_FAST_CACHE: dict[str, Any] = {}
_CONTENT_CACHE: dict[str, Any] = {}


class TokenizerSide:
    """Everything the pipeline needs from one distinct tokenizer (keyed by fingerprint).

    lengths: [V] int32 bytes covered by each id (0 for specials), from the alignment byte table.
    bos_ids: the ids the tokenizer itself puts before a text; start_ids: what the pipeline puts
    before a plain-text document and a continued row (`bos_ids`, or the document end where there
    is no BOS); doc_end_id: id after every document.
    """

    def __init__(self, tok: Any, chat_template: str | None = None, fast: bool = True):
        from crossdistill.alignment import TokenBytes
        from crossdistill.models import tokenizer_fingerprint

        self.tok = tok
        self.name = str(getattr(tok, "name_or_path", "") or type(tok).__name__)
        self.fingerprint = tokenizer_fingerprint(tok)
        self.chat_template = chat_template or getattr(tok, "chat_template", None)
        self.token_bytes = TokenBytes.from_tokenizer(tok)
        self.lengths = self.token_bytes.lengths
        backend = tok.backend_tokenizer
        self._backend = backend
        self._fast = _fast_encoder(self.fingerprint, backend) if fast else None
        self._added = added_pattern(backend)
        self.bos_ids, suffix = _added_ids(backend)
        self.doc_end_id = suffix[-1] if suffix else _doc_end_id(tok, backend)
        # in front of every document and of every row that continues one: the BOS, or for a
        # tokenizer without one its end-of-document token (what evaluation harnesses condition
        # such a model's first token on), so that every tokenizer predicts every text token
        start = self.bos_ids or ([] if self.doc_end_id is None else [self.doc_end_id])
        self.start_ids = np.asarray(start, dtype=np.int64)
        pad = getattr(tok, "pad_token_id", None)
        self.pad_id = int(pad if pad is not None else (self.doc_end_id or 0))

    @property
    def is_fast(self) -> bool:
        return self._fast is not None

    def __getstate__(self) -> dict[str, Any]:
        # Loader workers start from a fresh interpreter and receive the sides pickled; the
        # tiktoken encoder is a closure, so it is rebuilt there (once per worker and tokenizer).
        state = dict(self.__dict__)
        state["_fast"] = state["_fast"] is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fast = _fast_encoder(self.fingerprint, self._backend) if state["_fast"] else None

    def encode_content(self, text: str) -> np.ndarray:
        """[n] int64 ids of document text or a message content: all of it text, no added token
        (see the module doc)."""
        if self._fast is not None:
            return as_int64(self._fast(text))
        if not self._has_added(text):  # no added token can match: the plain backend is exact
            return as_int64(self._backend.encode(text, add_special_tokens=False).ids)
        content = _content_backend(self.fingerprint, self._backend)
        return as_int64(content.encode(text, add_special_tokens=False).ids)

    def _has_added(self, text: str) -> bool:
        """Whether `text` (or its normalised form, which added tokens may match) holds an
        added token's string."""
        if self._added is None:
            return False
        normalizer = self._backend.normalizer
        return bool(
            self._added.search(text)
            or (normalizer is not None and self._added.search(normalizer.normalize_str(text)))
        )

    def encode_template(self, text: str) -> np.ndarray:
        """[n] int64 ids of chat-template text (special tokens parsed)."""
        return as_int64(self._backend.encode(text, add_special_tokens=False).ids)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to `messages` (no generation prompt), as text. A fixed
        date is passed because Llama-3's template prints today's date otherwise, and a batch
        must not depend on the day it is built."""
        if self.chat_template is None:
            raise UserError(
                f"tokenizer {self.name} has no chat template; chat data needs one "
                "(use a tokenizer that ships one, or pass the template explicitly)"
            )
        return self.tok.apply_chat_template(
            messages,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=False,
            date_string="26 Jul 2024",
        )


def _fast_encoder(fingerprint: str, backend: Any) -> Any:
    # Building the tiktoken table takes ~1-2 s for a 150k vocabulary: once per process.
    if fingerprint not in _FAST_CACHE:
        _FAST_CACHE[fingerprint] = build_fast_encoder(backend)
    return _FAST_CACHE[fingerprint]


def _content_backend(fingerprint: str, backend: Any) -> Any:
    if fingerprint not in _CONTENT_CACHE:
        _CONTENT_CACHE[fingerprint] = content_backend(backend)
    return _CONTENT_CACHE[fingerprint]


def _added_ids(backend: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer's post-processor puts before and after a text."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a").ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


def _doc_end_id(tok: Any, backend: Any) -> int | None:
    special = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    for name in _DOC_END_NAMES:
        if name in special:
            return special[name]
    eos = getattr(tok, "eos_token_id", None)
    return None if eos is None else int(eos)

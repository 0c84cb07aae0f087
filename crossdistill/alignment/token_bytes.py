"""The bytes each token id covers, precomputed once per vocabulary.

Alignment works on bytes, not on strings: a byte-level BPE token may hold half of a UTF-8
character, and only bytes make the two tokenizations of one text comparable. This module turns
a fast Hugging Face tokenizer into flat NumPy tables so that per-sequence work is a gather.

Supported vocabularies:
- byte-level BPE (GPT-2, Qwen, Llama-3, Phi-4 families): each character of a token string
  stands for one byte through the GPT-2 byte table;
- SentencePiece-style BPE/Unigram (Llama-2, Mistral): `▁` is a space, byte-fallback pieces
  `<0xNN>` are the byte 0xNN, and `prefix_space` records the dummy space the tokenizer puts in
  front of the text;
- added tokens: special ones (BOS, EOS, chat markers) cover no bytes; non-special added tokens
  (Qwen's `<think>`, `<tool_call>`, ...) cover their literal text.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field

import numpy as np

from crossdistill.errors import UserError

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SP_SPACE = "\u2581"  # SentencePiece's visible space


def byte_level_alphabet() -> dict[str, int]:
    """The GPT-2 byte table, inverted: printable stand-in character -> the byte it encodes.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are moved to code points
    256.. in byte order, so that every byte has a visible, non-whitespace character.
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in kept}
    moved = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + moved)] = b
            moved += 1
    return table


_BYTE_LEVEL_TRANSLATE = str.maketrans({c: chr(b) for c, b in byte_level_alphabet().items()})


@dataclass(frozen=True, eq=False)
class TokenBytes:
    """Per-vocabulary byte table of one tokenizer. Build with `TokenBytes.from_tokenizer(tok)`.

    lengths:  [V] int32, number of bytes token id covers (0 for special tokens and unused ids)
    offsets:  [V + 1] int64, token id's bytes are `flat[offsets[id] : offsets[id + 1]]`
    flat:     [sum(lengths)] uint8, all token bytes back to back
    special:  [V] bool, special tokens (they cover no text)
    byte_piece: [V] bool, SentencePiece byte-fallback pieces `<0xNN>`
    prefix_space: the tokenizer puts a space before the text (SentencePiece dummy prefix)
    special_text: id -> literal content of each special token (for projection and display)
    """

    lengths: np.ndarray
    offsets: np.ndarray
    flat: np.ndarray
    special: np.ndarray
    byte_piece: np.ndarray
    prefix_space: bool
    kind: str
    fingerprint: str
    special_text: dict[int, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"TokenBytes({self.kind}, {self.vocab_size} ids, {self.fingerprint[:12]})"

    @property
    def vocab_size(self) -> int:
        return int(self.lengths.shape[0])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id covers (b'' for special tokens)."""
        return self.flat[self.offsets[token_id] : self.offsets[token_id + 1]].tobytes()

    @property
    def meta(self) -> np.ndarray:
        """[V] int64: `offsets[id] << 16 | lengths[id]`, so that one gather per token fetches
        both (the tables are large; each random access is a likely cache miss)."""
        cached = self.__dict__.get("_meta")
        if cached is None:
            if self.lengths.shape[0] and int(self.lengths.max()) >= 1 << 16:
                raise UserError("a token longer than 65535 bytes is not supported")
            cached = (self.offsets[:-1] << 16) | self.lengths.astype(np.int64)
            object.__setattr__(self, "_meta", cached)
        return cached

    def pieces(self) -> list[bytes]:
        """[V] the bytes of every id, as a list (built on first use, then kept)."""
        cached = self.__dict__.get("_pieces")
        if cached is None:
            flat, offsets = self.flat.tobytes(), self.offsets.tolist()
            cached = [flat[offsets[i] : offsets[i + 1]] for i in range(self.vocab_size)]
            object.__setattr__(self, "_pieces", cached)
        return cached

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """[sum(lengths[ids])] uint8: the bytes of a token sequence, concatenated."""
        lens = self.lengths[ids]
        total = int(lens.sum())
        if total == 0:
            return np.zeros(0, dtype=np.uint8)
        starts = np.cumsum(lens, dtype=np.int64) - lens
        index = np.repeat(self.offsets[ids] - starts, lens) + np.arange(total, dtype=np.int64)
        return self.flat[index]

    def decode(self, ids) -> bytes:
        """The bytes of a token sequence, as `bytes`."""
        return self.gather(np.asarray(ids, dtype=np.int64)).tobytes()

    @classmethod
    def from_pieces(
        cls,
        pieces: list[bytes],
        special: dict[int, str] | None = None,
        prefix_space: bool = False,
        name: str = "pieces",
    ) -> TokenBytes:
        """A table straight from each id's bytes; `special` maps zero-byte ids to their names.
        For vocabularies that are not Hugging Face tokenizers, and for tests."""
        special = special or {}
        data = [b"" if i in special else bytes(p) for i, p in enumerate(pieces)]
        lengths = np.asarray([len(p) for p in data], dtype=np.int32)
        offsets = np.zeros(len(data) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        is_special = np.zeros(len(data), dtype=bool)
        is_special[list(special)] = True
        return cls(
            lengths=lengths,
            offsets=offsets,
            flat=np.frombuffer(b"".join(data), dtype=np.uint8).copy(),
            special=is_special,
            byte_piece=np.zeros(len(data), dtype=bool),
            prefix_space=prefix_space,
            kind="pieces",
            fingerprint=f"{name}:{hashlib.sha256(lengths.tobytes() + b''.join(data)).hexdigest()}",
            special_text=dict(special),
        )

    @classmethod
    def from_tokenizer(cls, tok) -> TokenBytes:
        """The byte table of a fast tokenizer: from this process's cache, else from the disk
        cache (`crossdistill.cache`, keyed by the tokenizer's fingerprint), else built (a
        second or so for a 150k vocabulary) and written there."""
        from crossdistill.models.tokenizers import tokenizer_fingerprint

        fingerprint = tokenizer_fingerprint(tok)
        with _CACHE_LOCK:
            cached = _CACHE.get(fingerprint)
        if cached is not None:
            return cached
        table = _load_cached(fingerprint)
        if table is None:
            table = _build(tok, fingerprint)
            _save_cached(table)
        with _CACHE_LOCK:
            _CACHE[fingerprint] = table
        return table


_CACHE: dict[str, TokenBytes] = {}
_CACHE_LOCK = threading.Lock()
_ARRAYS = ("lengths", "offsets", "flat", "special", "byte_piece")
_DISK_FORMAT = 1


def _disk_path(fingerprint: str):
    from crossdistill.cache import cache_path

    return cache_path("token-bytes", f"{fingerprint[:40]}.npz")


def _load_cached(fingerprint: str) -> TokenBytes | None:
    """The table saved for `fingerprint`, or None (absent, or unreadable: then it is rebuilt)."""
    path = _disk_path(fingerprint)
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            meta = json.loads(bytes(data["meta"]).decode())
            if meta["format"] != _DISK_FORMAT or meta["fingerprint"] != fingerprint:
                return None
            arrays = {name: data[name] for name in _ARRAYS}
        special_text = {int(k): v for k, v in meta["special_text"].items()}
        table = TokenBytes(
            **arrays,
            prefix_space=meta["prefix_space"],
            kind=meta["kind"],
            fingerprint=fingerprint,
            special_text=special_text,
        )
        n = table.lengths.shape[0]
        if table.offsets.shape[0] != n + 1 or int(table.offsets[-1]) != table.flat.shape[0]:
            return None
        return table
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save_cached(table: TokenBytes) -> None:
    from crossdistill.cache import write_atomic

    meta = {
        "format": _DISK_FORMAT,
        "fingerprint": table.fingerprint,
        "prefix_space": table.prefix_space,
        "kind": table.kind,
        "special_text": {str(k): v for k, v in table.special_text.items()},
    }
    arrays = {name: getattr(table, name) for name in _ARRAYS}

    def write(tmp) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)

    write_atomic(_disk_path(table.fingerprint), write)


def _component_types(state: dict | None) -> list[dict]:
    """Flatten a normalizer / pre-tokenizer / decoder JSON tree into its leaf components."""
    if not state:
        return []
    for key in ("decoders", "normalizers", "pretokenizers", "processors"):
        if key in state:
            return [leaf for child in state[key] for leaf in _component_types(child)]
    return [state]


def _state(component) -> dict | None:
    if component is None:
        return None
    return json.loads(component.__getstate__())


def _detect_kind(backend) -> tuple[str, bool]:
    """('byte_level' | 'sentencepiece', prefix_space) from the tokenizer's own pipeline."""
    decoders = _component_types(_state(backend.decoder))
    normalizers = _component_types(_state(backend.normalizer))
    pre_tokenizers = _component_types(_state(backend.pre_tokenizer))
    dec_types = {d["type"] for d in decoders}
    prefix_space = any(
        n["type"] == "Prepend" and n.get("prepend") == _SP_SPACE for n in normalizers
    )
    for p in pre_tokenizers:
        if p["type"] == "Metaspace":
            scheme = p.get("prepend_scheme", "always" if p.get("add_prefix_space") else "never")
            prefix_space = prefix_space or scheme in ("always", "first")
        if p["type"] == "ByteLevel" and p.get("add_prefix_space"):
            prefix_space = True
    if "ByteLevel" in dec_types:
        return "byte_level", prefix_space
    spaces_from_marker = "Metaspace" in dec_types or any(
        d["type"] == "Replace" and d.get("pattern", {}).get("String") == _SP_SPACE for d in decoders
    )
    if spaces_from_marker:
        return "sentencepiece", prefix_space
    raise UserError(
        f"cannot map this tokenizer's tokens to bytes (decoder types {sorted(dec_types) or 'none'}); "
        "crossdistill supports byte-level BPE and SentencePiece-style tokenizers"
    )


def _piece_bytes(piece: str, kind: str, byte_fallback: bool) -> tuple[bytes, bool]:
    """(bytes, is a byte-fallback piece) of one vocabulary entry."""
    if kind == "byte_level":
        mapped = piece.translate(_BYTE_LEVEL_TRANSLATE)
        try:
            return mapped.encode("latin-1"), False
        except UnicodeEncodeError:  # a piece outside the byte alphabet: take it as text
            return piece.encode("utf-8"), False
    if byte_fallback:
        m = _BYTE_PIECE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)]), True
    return piece.replace(_SP_SPACE, " ").encode("utf-8"), False


def _build(tok, fingerprint: str) -> TokenBytes:
    backend = tok.backend_tokenizer
    kind, prefix_space = _detect_kind(backend)
    model_state = _state(backend.model) if kind == "sentencepiece" else {}
    byte_fallback = bool((model_state or {}).get("byte_fallback", False))
    added = backend.get_added_tokens_decoder()
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    if added:
        vocab_size = max(vocab_size, max(added) + 1)
    pieces: list[bytes] = []
    special = np.zeros(vocab_size, dtype=bool)
    byte_piece = np.zeros(vocab_size, dtype=bool)
    special_text: dict[int, str] = {}
    for i in range(vocab_size):
        tok_added = added.get(i)
        if tok_added is not None:
            if tok_added.special:
                special[i] = True
                special_text[i] = tok_added.content
                pieces.append(b"")
            else:  # a non-special added token stands for its literal text
                pieces.append(tok_added.content.encode("utf-8"))
            continue
        piece = backend.id_to_token(i)
        if piece is None:  # an id the vocabulary skips
            pieces.append(b"")
            continue
        data, byte_piece[i] = _piece_bytes(piece, kind, byte_fallback)
        pieces.append(data)
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int32, count=vocab_size)
    offsets = np.zeros(vocab_size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.frombuffer(b"".join(pieces), dtype=np.uint8).copy()
    return TokenBytes(
        lengths=lengths,
        offsets=offsets,
        flat=flat,
        special=special,
        byte_piece=byte_piece,
        prefix_space=bool(prefix_space),
        kind=kind,
        fingerprint=fingerprint,
        special_text=special_text,
    )

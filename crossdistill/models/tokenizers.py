"""Tokenizer loading: a Hugging Face folder or hub id, or Meta's original tiktoken
`tokenizer.model` (Llama-3 family), always as a fast tokenizer.

Hub ids are resolved by `transformers` (which honours `HF_HUB_OFFLINE`); anything that cannot
be loaded raises one `UserError` saying what was tried.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossdistill.errors import UserError

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/=]+ \d+\r?$")

# Meta's Llama-3 pre-tokenisation pattern and the HF names of its 256 special tokens.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMED = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]


def llama3_special_tokens(num_reserved: int = 256) -> list[str]:
    extra = [
        f"<|reserved_special_token_{i}|>" for i in range(3, 3 + num_reserved - len(_LLAMA3_NAMED))
    ]
    return _LLAMA3_NAMED + extra


def is_tiktoken_file(path: Path) -> bool:
    """A tiktoken BPE file is text lines of `base64 rank`; SentencePiece models are protobuf."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096).split(b"\n")
    except OSError:
        return False
    lines = [ln for ln in head[:-1] if ln]
    return bool(lines) and all(_TIKTOKEN_LINE.match(ln) for ln in lines[:20])


@functools.lru_cache(maxsize=16)
def load_tokenizer(spec: str | Path):
    """A `PreTrainedTokenizerFast` from a folder, a tiktoken file, or a hub id. Cached per spec."""
    spec_str = str(spec)
    path = Path(spec_str).expanduser()
    if path.is_file():
        if is_tiktoken_file(path):
            return _load_tiktoken(path)
        if path.name == "tokenizer.json":
            return _load_folder(path.parent)
        raise UserError(
            f"tokenizer {spec_str!r} is a file but neither a tiktoken BPE file nor tokenizer.json; "
            "give the tokenizer's folder instead"
        )
    if path.is_dir():
        files = {p.name for p in path.iterdir()}
        if (
            "tokenizer.json" not in files
            and "tokenizer.model" in files
            and is_tiktoken_file(path / "tokenizer.model")
        ):
            return _load_tiktoken(path / "tokenizer.model")
        return _load_folder(path)
    if spec_str.startswith((".", "/", "~")) or spec_str.count("/") > 1:
        raise UserError(f"tokenizer path {spec_str!r} does not exist")
    return _load_folder(spec_str)


def _load_folder(where: Path | str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(where))
    except Exception as e:  # transformers raises many types for "cannot load"
        raise UserError(
            f"cannot load a tokenizer from {str(where)!r}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. "
            "Give a folder with tokenizer.json (or tokenizer_config.json + vocab files), a tiktoken "
            "tokenizer.model, or a Hugging Face id reachable from this machine"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise UserError(
            f"tokenizer {str(where)!r} loaded only as a slow tokenizer; a fast (Rust) tokenizer is required"
        )
    return tok


def _load_tiktoken(path: Path):
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    with open(path, "rb") as f:
        num_ranks = sum(1 for _ in f)
    specials = llama3_special_tokens() if num_ranks == 128000 else []
    try:
        converter = TikTokenConverter(
            str(path),
            pattern=LLAMA3_PATTERN,
            extra_special_tokens=specials,
            additional_special_tokens=specials,
        )
        backend = converter.converted()
    except Exception as e:
        raise UserError(f"cannot read tiktoken file {path}: {e}") from None
    kwargs = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"} if specials else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    if specials:
        from tokenizers import processors

        bos_id = tok.convert_tokens_to_ids("<|begin_of_text|>")
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A",
            pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos_id)],
        )
    return tok


def tokenizer_fingerprint(tok) -> str:
    """A sha256 of everything that decides how text becomes ids (vocab, merges, normaliser,
    pre-tokeniser, added tokens). Projections and caches carry it to refuse a mismatch."""
    cached = getattr(tok, "_crossdistill_fingerprint", None)
    if cached is not None:
        return cached
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str().encode()
    else:
        payload = repr(sorted(tok.get_vocab().items())).encode()
    digest = hashlib.sha256(payload).hexdigest()
    with contextlib.suppress(AttributeError):
        tok._crossdistill_fingerprint = digest
    return digest


@dataclass
class TextTokenizer:
    """What tokenizing plain text needs, without `transformers`: the Rust backend (the very one
    `load_tokenizer` builds) and a few ids. `crossdistill.data.TokenizerSide` takes it where it
    takes a Hugging Face tokenizer, for text (chat templates need the full tokenizer)."""

    backend_tokenizer: Any
    name_or_path: str
    pad_token_id: int | None
    eos_token_id: int | None
    _crossdistill_fingerprint: str
    chat_template: str | None = None


_TEXT_FORMAT = 1


def load_text_tokenizer(spec: str | Path) -> TextTokenizer:
    """The `TextTokenizer` of `spec` (as `load_tokenizer` takes it). A local tokenizer is read
    from the disk cache (`crossdistill.cache`), keyed by its files' names, sizes and
    modification times: one JSON read instead of `transformers`' loading and conversion; the
    first load writes that entry."""
    from tokenizers import Tokenizer

    from crossdistill.cache import cache_path, write_atomic

    key = _files_key(spec)
    meta = cache_path("tokenizers", f"{key}.meta.json") if key else None
    saved = cache_path("tokenizers", f"{key}.tokenizer.json") if key else None
    if meta is not None and meta.is_file():
        try:
            entry = json.loads(meta.read_text(encoding="utf-8"))
            if entry["format"] == _TEXT_FORMAT:
                backend = Tokenizer.from_file(str(saved))
                return TextTokenizer(
                    backend, entry["name"], entry["pad"], entry["eos"], entry["fingerprint"]
                )
        except Exception:  # unreadable or from another version: rebuilt below
            pass
    tok = load_tokenizer(spec)
    text = TextTokenizer(
        tok.backend_tokenizer,
        str(getattr(tok, "name_or_path", "") or spec),
        tok.pad_token_id,
        tok.eos_token_id,
        tokenizer_fingerprint(tok),
    )
    if meta is not None:
        entry = {
            "format": _TEXT_FORMAT,
            "name": text.name_or_path,
            "pad": text.pad_token_id,
            "eos": text.eos_token_id,
            "fingerprint": text._crossdistill_fingerprint,
        }
        # the tokenizer first, its meta last: an entry with meta has both
        if write_atomic(saved, lambda tmp: tok.backend_tokenizer.save(str(tmp))):
            write_atomic(meta, lambda tmp: tmp.write_text(json.dumps(entry), encoding="utf-8"))
    return text


def _files_key(spec: str | Path) -> str | None:
    """A key for a local tokenizer (file or folder) from its files' names, sizes and times;
    None for a hub id."""
    path = Path(str(spec)).expanduser()
    if not path.exists():
        return None
    files = sorted(p for p in ([path] if path.is_file() else path.iterdir()) if p.is_file())
    parts = [str(path.resolve())]
    for p in files:
        st = p.stat()
        parts.append(f"{p.name}|{st.st_size}|{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:40]

"""Seeded text samples for alignment benchmarks and tests, made from the Python standard
library found on this machine (real prose and code) plus generated scripts, emoji and
whitespace. Nothing is downloaded."""

from __future__ import annotations

import ast
import random
import sysconfig
import unicodedata
from pathlib import Path

CATEGORIES = ("prose", "code", "cjk", "emoji", "whitespace", "crlf", "combining")

_EMOJI = [
    "\U0001f600",
    "\U0001f44d\U0001f3fd",  # thumbs up, skin tone
    "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",  # family (ZWJ)
    "\U0001f1ef\U0001f1f5",  # flag
    "1\ufe0f\u20e3",  # keycap
    "\u2764\ufe0f",
    "\U0001f9d1\u200d\U0001f4bb",
    "\U0001f642",
]
_SPACES = [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "    ", " " * 17, "\n\n\n"]


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(limit_bytes: int = 4_000_000) -> list[str]:
    """Top-level standard-library modules' source, in name order, up to `limit_bytes`."""
    out, size = [], 0
    for path in sorted(stdlib_dir().glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(text)
        size += len(text)
        if size >= limit_bytes:
            break
    return out


def _docstrings(sources: list[str]) -> list[str]:
    docs = []
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80:
                    docs.append(doc)
    return docs


def _cjk(rng: random.Random) -> str:
    cjk_dir = stdlib_dir() / "test" / "cjkencodings"
    real = sorted(cjk_dir.glob("*-utf8.txt")) if cjk_dir.is_dir() else []
    if real and rng.random() < 0.5:
        text = rng.choice(real).read_text(encoding="utf-8", errors="replace")
        start = rng.randrange(max(1, len(text) - 400))
        return text[start : start + 400]
    ranges = [(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0xFF01, 0xFF5E)]
    parts = []
    for _ in range(rng.randint(20, 200)):
        lo, hi = rng.choice(ranges)
        parts.append(chr(rng.randint(lo, hi)))
        if rng.random() < 0.08:
            parts.append(rng.choice(["、", "。", " ", "\n", "abc", "123"]))
    return "".join(parts)


def _code_snippet(rng: random.Random, sources: list[str], lines: int = 60) -> str:
    source = rng.choice(sources).splitlines(keepends=True)
    start = rng.randrange(max(1, len(source) - lines))
    snippet = "".join(source[start : start + lines])
    if rng.random() < 0.3:
        snippet = snippet.replace("    ", "\t")
    return snippet


def mixed_corpus(num_texts: int = 400, seed: int = 0) -> list[tuple[str, str]]:
    """`num_texts` (category, text) pairs cycling through `CATEGORIES`."""
    rng = random.Random(seed)
    sources = stdlib_sources(limit_bytes=1_500_000)
    docs = _docstrings(sources)
    words = " ".join(docs).split()
    out = []
    for n in range(num_texts):
        category = CATEGORIES[n % len(CATEGORIES)]
        if category == "prose":
            text = rng.choice(docs)
        elif category == "code":
            text = _code_snippet(rng, sources)
        elif category == "cjk":
            text = _cjk(rng)
        elif category == "emoji":
            picks = [rng.choice(_EMOJI + words[:2000]) for _ in range(rng.randint(5, 40))]
            text = " ".join(picks)
        elif category == "whitespace":
            picks = [rng.choice(_SPACES + words[:500]) for _ in range(rng.randint(10, 80))]
            text = "".join(picks)
        elif category == "crlf":
            text = _code_snippet(rng, sources, lines=30).replace("\n", "\r\n")
        else:  # decomposed accents and stacked marks: what NFC-normalising tokenizers change
            base = rng.choice(docs)[:300]
            accented = "".join(
                c + rng.choice("\u0301\u0300\u0308\u0327")
                if c in "aeiou" and rng.random() < 0.3
                else c
                for c in base
            )
            text = unicodedata.normalize("NFD", accented)
        out.append((category, text))
    return out

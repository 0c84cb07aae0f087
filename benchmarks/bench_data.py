"""`python benchmarks/bench_data.py`: data-pipeline throughput (student tokens per second per worker
process) on real text from this machine, beside a plain baseline: the same text tokenized by
the same tokenizers with the `tokenizers` library alone (no alignment, packing or collation).

Corpus: the Python standard library's sources and, as separate documents, their docstrings,
plus the plain-text files of /usr/share/doc where present, written once to a JSONL file.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sysconfig
import tempfile
import time
from pathlib import Path

DEFAULT_STUDENT = "llama3"
DEFAULT_TEACHERS = ("qwen3", "phi-4-mini")

EXAMPLES = """examples:
  python benchmarks/bench_data.py                                   # Llama-3 student, Qwen3 + Phi-4-mini
  python benchmarks/bench_data.py --json --workers 2
  python benchmarks/bench_data.py --student-tokenizer /models/llama3 \\
      --teacher-tokenizer /models/qwen3 --teacher-tokenizer /models/phi-4-mini --seq-len 4096

Default tokenizers are read from <dir>/<name>/hf, <dir> being $CROSSDISTILL_TOKENIZERS or
../shared/tokenizers beside the repository. Timings on a shared machine are noisy: run twice.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "data",
        help="data pipeline throughput: tokenize + align + pack + collate, per worker",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seq-len", type=int, default=2048, help="student sequence length")
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per batch")
    p.add_argument("--student-tokenizer", help="student tokenizer (folder, HF id, tiktoken file)")
    p.add_argument(
        "--teacher-tokenizer", action="append", default=None, help="a teacher tokenizer (repeat)"
    )
    p.add_argument("--workers", type=int, default=1, help="DataLoader worker processes (0: main)")
    p.add_argument("--batches", type=int, default=40, help="timed batches (after one warm-up)")
    p.add_argument("--max-mb", type=float, default=24.0, help="corpus size cap in MB")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from crossdistill.errors import UserError

    if args.workers < 0 or args.batches < 1 or args.seq_len < 2:
        raise UserError("--workers must be >= 0, --batches >= 1 and --seq-len >= 2")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker, as measured
    names = [args.student_tokenizer or DEFAULT_STUDENT]
    names += args.teacher_tokenizer if args.teacher_tokenizer is not None else DEFAULT_TEACHERS
    toks = [_load(n) for n in names]
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["CROSSDISTILL_CACHE"] = tmp  # the JSONL index of a throwaway corpus
        path, texts = write_corpus(Path(tmp) / "corpus.jsonl", args.max_mb)
        report = measure(args, toks, str(path))
        report["baseline"] = baseline(toks, texts, report["student_tokens"] * 2)
    report["tokenizers"] = names
    report["corpus_documents"] = len(texts)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
    return 0


def _load(name: str):
    from crossdistill.models import load_tokenizer

    if Path(name).exists() or "/" in name:
        return load_tokenizer(name)
    root = Path(
        os.environ.get(
            "CROSSDISTILL_TOKENIZERS",
            Path(__file__).resolve().parents[2] / "shared" / "tokenizers",
        )
    )
    return load_tokenizer(str(root / name / "hf"))


def write_corpus(path: Path, max_mb: float) -> tuple[Path, list[str]]:
    """Standard-library sources, their docstrings, and /usr/share/doc text, as JSONL."""
    budget = int(max_mb * 1e6)
    texts: list[str] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(stdlib.rglob("*.py")):
        if budget <= 0:
            break
        try:
            source = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(source)
        texts.extend(_docstrings(source))
        budget -= len(source)
    doc_root = Path("/usr/share/doc")
    if doc_root.is_dir():
        for p in sorted(doc_root.rglob("*")):
            if budget <= 0:
                break
            if not p.is_file() or p.suffix in (".gz", ".xz", ".bz2", ".png", ".jpg", ".pdf"):
                continue
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            texts.append(text)
            budget -= len(text)
    texts = [t for t in texts if t.strip()]
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path, texts


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
    return [d for d in found if d and len(d) > 40]


def measure(args: argparse.Namespace, toks: list, path: str) -> dict:
    """Time `args.batches` batches of the real loader after one warm-up batch per worker."""
    from crossdistill.config import DataConfig
    from crossdistill.data import build_loader

    cfg = DataConfig(
        train=[path],
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch_size,
        num_workers=args.workers,
        val_fraction=0.0,
    )
    t0 = time.perf_counter()
    loader = build_loader(cfg, toks[0], toks[1:], pin_memory=False)
    build_s = time.perf_counter() - t0
    it = iter(loader)
    for _ in range(max(1, args.workers)):
        next(it)  # process start and each worker's first batch are not steady state
    real = positions = target = 0
    kd = [0] * (len(toks) - 1)
    widths = [0] * (len(toks) - 1)
    t0 = time.perf_counter()
    for _ in range(args.batches):
        batch = next(it)
        real += int((batch.student.doc_ids >= 0).sum())  # non-pad student tokens
        positions += batch.student.doc_ids.numel()
        target += batch.student.num_target_tokens
        for k, t in enumerate(batch.teachers):
            kd[k] += t.num_kd
            widths[k] += t.input_ids.shape[1]
    elapsed = time.perf_counter() - t0
    per_s = real / elapsed
    return {
        "student_tokens_per_s_per_worker": round(per_s / max(1, args.workers)),
        "student_tokens_per_s": round(per_s),
        "workers": args.workers,
        "seq_len": args.seq_len,
        "micro_batch_size": args.micro_batch_size,
        "batches": args.batches,
        "seconds": round(elapsed, 3),
        "student_tokens": real,
        "fill": round(real / positions, 4),
        "kd_positions_per_target": [round(k / max(1, target), 4) for k in kd],
        "teacher_len_over_student": [round(w / args.batches / args.seq_len, 3) for w in widths],
        "build_s": round(build_s, 2),
    }


def baseline(toks: list, texts: list[str], want_tokens: int) -> dict:
    """Tokenize documents with every tokenizer (`tokenizers` library, one thread, no specials
    parsed) until the student has `want_tokens` tokens: the floor any pipeline pays."""
    backends = [t.backend_tokenizer for t in toks]
    n = 0
    t0 = time.perf_counter()
    for text in texts:
        for k, b in enumerate(backends):
            ids = b.encode(text, add_special_tokens=False).ids
            if k == 0:
                n += len(ids)
        if n >= want_tokens:
            break
    elapsed = time.perf_counter() - t0
    return {"student_tokens_per_s": round(n / elapsed), "student_tokens": n}


def render(r: dict) -> str:
    teachers = ", ".join(r["tokenizers"][1:]) or "none"
    lines = [
        f"data pipeline: student {r['tokenizers'][0]}, teachers {teachers}; seq_len "
        f"{r['seq_len']} x {r['micro_batch_size']}, {r['workers']} worker(s), "
        f"{r['corpus_documents']} documents",
        "",
        "| measure | value |",
        "|---|---|",
        f"| student tokens/s per worker | {r['student_tokens_per_s_per_worker']:,} |",
        f"| student tokens/s (all workers) | {r['student_tokens_per_s']:,} |",
        f"| baseline: `tokenizers` encode by all tokenizers, 1 thread | "
        f"{r['baseline']['student_tokens_per_s']:,} |",
        f"| row fill (non-pad / positions) | {r['fill']:.3f} |",
        f"| KD positions per student target, per teacher | {r['kd_positions_per_target']} |",
        f"| teacher length / student length | {r['teacher_len_over_student']} |",
        f"| loader build (s) | {r['build_s']} |",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    from crossdistill.cli import run_reporting

    parser = argparse.ArgumentParser(prog="bench_data")
    add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["data", *sys.argv[1:]])
    sys.exit(run_reporting(args.func, args))

"""`crossdistill align` and `crossdistill projection build|inspect`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ALIGN_EXAMPLES = """examples:
  crossdistill align --student-tokenizer meta-llama/Llama-3.2-1B --teacher-tokenizer Qwen/Qwen3-4B \\
      --text "def f(x):\\n    return x**2  # 数学"
  crossdistill align --student-tokenizer ./tok/llama3 --teacher-tokenizer ./tok/qwen3 \\
      --input corpus.jsonl --output aligned.jsonl --workers 8

Each input line is {"text": ...}; each output line is
{"student_ids": [...], "teacher_ids": [...], "chunks": [[s0, s1, t0, t1], ...]}:
student tokens [s0, s1) and teacher tokens [t0, t1) cover the same bytes.
"""

PROJECTION_EXAMPLES = """examples:
  crossdistill projection build --student-tokenizer ./tok/llama3 --teacher-tokenizer ./tok/qwen3 \\
      --out qwen3_to_llama3.safetensors
  crossdistill projection build --student-tokenizer S --teacher-tokenizer T --mode multi_piece \\
      --out P.safetensors
  crossdistill projection inspect qwen3_to_llama3.safetensors --examples 20
"""


def _add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--student-tokenizer", required=True, metavar="S", help="local folder or Hugging Face id"
    )
    p.add_argument(
        "--teacher-tokenizer", required=True, metavar="T", help="local folder or Hugging Face id"
    )


def add_align_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "align",
        help="tokenize text with two tokenizers and print or write their chunk alignment",
        description="Align a student and a teacher tokenization of the same text into chunks "
        "that cover the same bytes.",
        epilog=ALIGN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_tokenizer_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="one text: print its chunks side by side")
    source.add_argument("--input", type=Path, metavar="F.jsonl", help='JSONL, {"text": ...}')
    p.add_argument("--output", type=Path, metavar="O.jsonl", help="output JSONL (with --input)")
    p.add_argument(
        "--workers", type=int, default=0, help="processes for --input (default: all cores)"
    )
    p.add_argument(
        "--no-special-tokens",
        action="store_true",
        help="do not let the tokenizers add BOS/EOS (default: add them, as tok(text) does)",
    )
    p.set_defaults(func=run_align)


def run_align(args: argparse.Namespace) -> int:
    from crossdistill.alignment.jsonl import Pipeline, process_file
    from crossdistill.errors import UserError

    if args.input is not None and args.output is None:
        raise UserError("--input needs --output (the JSONL file to write)")
    if args.text is not None and args.output is not None:
        raise UserError("--output goes with --input; --text prints to the terminal")
    if args.workers < 0:
        raise UserError("--workers must be 0 (all cores) or a positive number")
    pipeline = Pipeline.load(
        args.student_tokenizer, args.teacher_tokenizer, not args.no_special_tokens
    )
    if args.text is not None:
        _print_alignment(pipeline, args.text)
        return 0
    result = process_file(pipeline, args.input, args.output, workers=args.workers)
    print(
        f"aligned {result['lines']} texts in {result['seconds']:.2f} s "
        f"with {result['workers']} workers -> {args.output}",
        file=sys.stderr,
    )
    return 0


_VISIBLE = str.maketrans({"\n": "\\n", "\r": "\\r", "\t": "\\t"})


def _show(table, token_id: int) -> str:
    if table.special[token_id]:
        return table.special_text.get(token_id, f"<special {token_id}>")
    text = table.token_bytes(token_id).decode("utf-8", errors="backslashreplace")
    return text.translate(_VISIBLE)


def _print_alignment(pipeline, text: str) -> None:
    from crossdistill.alignment.chunks import align

    (ids_s,), (ids_t,) = pipeline.encode([text])
    result = align(ids_s, ids_t, pipeline.bytes_s, pipeline.bytes_t)
    rows = []
    for (s0, s1, t0, t1), exact in zip(result.chunks.tolist(), result.exact.tolist()):
        left = " ".join(f"[{_show(pipeline.bytes_s, i)}]" for i in ids_s[s0:s1])
        right = " ".join(f"[{_show(pipeline.bytes_t, i)}]" for i in ids_t[t0:t1])
        rows.append((f"{s0}:{s1}", f"{t0}:{t1}", left, right, "" if exact else "  ~"))
    width = max([len(r[2]) for r in rows] + [len("student")])
    print(f"{'student':>9} {'teacher':>9}  {'student tokens':<{width}}  teacher tokens")
    for s_span, t_span, left, right, mark in rows:
        print(f"{s_span:>9} {t_span:>9}  {left:<{width}}  {right}{mark}")
    one_to_one = sum(1 for s0, s1, t0, t1 in result.chunks.tolist() if s1 - s0 == t1 - t0 == 1)
    print(
        f"\n{len(ids_s)} student tokens, {len(ids_t)} teacher tokens, {result.num_chunks} chunks "
        f"({one_to_one} one-to-one), {result.num_fallback} positions by the DP fallback"
        + ("; ~ marks chunks equal only up to normalisation" if not result.exact.all() else "")
    )


def add_projection_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "projection",
        help="build or inspect a teacher-to-student vocabulary projection",
        description="Sparse [V_t, V_s] map of teacher next-token distributions onto the student "
        "vocabulary, stored as safetensors with both tokenizers' fingerprints.",
        epilog=PROJECTION_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="projection_command", metavar="ACTION")
    build = sub.add_parser(
        "build",
        help="build a projection and save it",
        epilog=PROJECTION_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_tokenizer_args(build)
    build.add_argument("--out", required=True, type=Path, metavar="P.safetensors")
    build.add_argument("--mode", choices=["first_piece", "multi_piece"], default="first_piece")
    build.set_defaults(func=run_projection_build)
    inspect = sub.add_parser(
        "inspect",
        help="coverage, exact-match share and examples of a saved projection",
        epilog=PROJECTION_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inspect.add_argument("path", type=Path, metavar="P.safetensors")
    inspect.add_argument("--student-tokenizer", metavar="S", help="check against it, show text")
    inspect.add_argument("--teacher-tokenizer", metavar="T", help="check against it, show text")
    inspect.add_argument("--examples", type=int, default=10, help="teacher tokens to show")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=run_projection_inspect)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_projection_build(args: argparse.Namespace) -> int:
    import time

    from crossdistill.alignment.projection import build_projection
    from crossdistill.models import load_tokenizer

    start = time.perf_counter()
    tok_s, tok_t = load_tokenizer(args.student_tokenizer), load_tokenizer(args.teacher_tokenizer)
    projection = build_projection(tok_t, tok_s, mode=args.mode)
    projection.save(args.out)
    stats = projection.stats()
    print(
        f"projection {stats['vocab_t']} x {stats['vocab_s']} ({args.mode}, {stats['nnz']} "
        f"non-zeros): coverage {stats['coverage']:.2%}, exact matches {stats['exact_share']:.2%}, "
        f"built in {time.perf_counter() - start:.1f} s -> {args.out}"
    )
    return 0


def run_projection_inspect(args: argparse.Namespace) -> int:
    from crossdistill.alignment.projection import Projection
    from crossdistill.models import load_tokenizer

    tok_s = load_tokenizer(args.student_tokenizer) if args.student_tokenizer else None
    tok_t = load_tokenizer(args.teacher_tokenizer) if args.teacher_tokenizer else None
    projection = Projection.load(args.path, tok_t=tok_t, tok_s=tok_s)
    stats = projection.stats()
    stats.update(fingerprint_t=projection.fingerprint_t, fingerprint_s=projection.fingerprint_s)
    stats["examples"] = _examples(projection, tok_t, tok_s, args.examples)
    if args.json:
        print(json.dumps(stats, indent=2))
        return 0
    print(
        f"{args.path}: {stats['vocab_t']} teacher x {stats['vocab_s']} student ids, {stats['mode']}"
    )
    print(f"  teacher fingerprint {projection.fingerprint_t}  ({projection.name_t})")
    print(f"  student fingerprint {projection.fingerprint_s}  ({projection.name_s})")
    print(f"  non-zeros {stats['nnz']}, coverage {stats['coverage']:.2%}")
    print(f"  exact matches {stats['exact_share']:.2%} of all teacher ids")
    for ex in stats["examples"]:
        pieces = ", ".join(f"{s} {w:.2f}" for s, w in ex["student"])
        print(f"  {'=' if ex['exact'] else '~'} {ex['teacher']}  ->  {pieces or '(empty row)'}")
    return 0


def _examples(projection, tok_t, tok_s, count: int) -> list[dict]:
    """A seeded sample of teacher ids: half exact matches, half not."""
    import numpy as np

    def name(tok, i: int) -> str:
        return repr(tok.convert_ids_to_tokens(int(i))) if tok is not None else str(int(i))

    rng = np.random.default_rng(0)
    exact = projection.exact.numpy()
    picks = []
    for want in (True, False):
        ids = np.flatnonzero(exact == want)
        take = min(len(ids), (count + 1) // 2 if want else count // 2)
        picks.extend(rng.choice(ids, size=take, replace=False).tolist() if take else [])
    crow, cols, weights = projection.csr()
    out = []
    for t in sorted(picks):
        lo, hi = int(crow[t]), int(crow[t + 1])
        student = [(name(tok_s, c), float(w)) for c, w in zip(cols[lo:hi], weights[lo:hi])]
        out.append({"teacher": name(tok_t, t), "student": student, "exact": bool(exact[t])})
    return out

"""`crossdistill projection build|inspect` (`crossdistill align` lives in `data/cli.py`: it
tokenizes as the data pipeline does)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROJECTION_EXAMPLES = """examples:
  crossdistill projection build --student-tokenizer ./tok/llama3 --teacher-tokenizer ./tok/qwen3 \\
      --out qwen3_to_llama3.safetensors
  crossdistill projection build --student-tokenizer S --teacher-tokenizer T --mode multi_piece \\
      --out P.safetensors
  crossdistill projection inspect qwen3_to_llama3.safetensors --examples 20
"""


def add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--student-tokenizer", required=True, metavar="S", help="local folder or Hugging Face id"
    )
    p.add_argument(
        "--teacher-tokenizer", required=True, metavar="T", help="local folder or Hugging Face id"
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
    add_tokenizer_args(build)
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

"""`crossdistill align`: two tokenizations of a text or a corpus, as training makes them, and
their chunk alignment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crossdistill.alignment.cli import add_tokenizer_args
from crossdistill.data.sources import FORMATS, MissingField
from crossdistill.errors import UserError

ALIGN_EXAMPLES = """examples:
  crossdistill align --student-tokenizer meta-llama/Llama-3.2-1B --teacher-tokenizer Qwen/Qwen3-4B \\
      --text "def f(x):\\n    return x**2  # 数学"
  crossdistill align --student-tokenizer ./tok/llama3 --teacher-tokenizer ./tok/qwen3 \\
      --input corpus.jsonl --output aligned.jsonl --workers 8
  crossdistill align --student-tokenizer S --teacher-tokenizer T --input docs/ --format text \\
      --output aligned.jsonl

Input: any corpus format training reads (JSONL, plain text files or a folder of them, Parquet,
Arrow, a `datasets` folder), one text per row. Each text is encoded as training encodes a
document: start tokens, the text (literal special-token strings stay text), the end token.
Each output line is
{"student_ids": [...], "teacher_ids": [...], "chunks": [[s0, s1, t0, t1], ...]}:
student tokens [s0, s1) and teacher tokens [t0, t1) cover the same bytes.
"""


def add_text_field_arg(p: argparse.ArgumentParser, dest: str) -> None:
    """`--text-field NAME` (or `--field`): the JSONL field or table column holding the text, one
    name on every command that reads a corpus."""
    p.add_argument(
        "--text-field",
        "--field",
        dest=dest,
        default="text",
        metavar="NAME",
        help="the JSONL field or Parquet/Arrow column holding the text (default: text)",
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
    add_tokenizer_args(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="one text: print its chunks side by side")
    source.add_argument("--input", type=Path, metavar="F", help="a corpus file or folder")
    p.add_argument("--output", type=Path, metavar="O.jsonl", help="output JSONL (with --input)")
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", *FORMATS],
        help="corpus format of --input (default: from the file name)",
    )
    add_text_field_arg(p, "field")
    p.add_argument(
        "--workers", type=int, default=0, help="processes for --input (default: all cores)"
    )
    p.add_argument(
        "--no-special-tokens",
        action="store_true",
        help="the text alone, without the start and end-of-document tokens training adds",
    )
    p.set_defaults(func=run_align)


def run_align(args: argparse.Namespace) -> int:
    from crossdistill.data.aligned import Pipeline, process_file, worth_fast_encoders

    if args.input is not None and args.output is None:
        raise UserError("--input needs --output (the JSONL file to write)")
    if args.text is not None and args.output is not None:
        raise UserError("--output goes with --input; --text prints to the terminal")
    if args.workers < 0:
        raise UserError("--workers must be 0 (all cores) or a positive number")
    pipeline = Pipeline.load(
        args.student_tokenizer,
        args.teacher_tokenizer,
        not args.no_special_tokens,
        fast=args.input is not None and worth_fast_encoders(args.input, args.workers),
    )
    if args.text is not None:
        _print_alignment(pipeline, args.text)
        return 0
    try:
        result = process_file(
            pipeline, args.input, args.output, workers=args.workers, fmt=args.format,
            field=args.field,
        )  # fmt: skip
    except MissingField as e:
        raise e.for_command_line() from None
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
    from crossdistill.alignment.align import align

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

"""The command line of `crossdistill bench quality`: its parser, the settings it builds
(`spec_from_args`: a `QualitySpec`, checked once by the experiment), and the run that prints the
table, or one JSON object last with `--json`. The experiment is `quality.Experiment`."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

from crossdistill.bench import quality
from crossdistill.bench.quality import Experiment
from crossdistill.bench.quality_corpus import MIN_PIECE_BYTES
from crossdistill.bench.quality_report import plot_report, print_table
from crossdistill.bench.quality_spec import SCALES, QualitySpec, parse_teacher_size
from crossdistill.config import (
    LOSSES,
    TARGETS,
    Boundary,
    CEWithoutKD,
    DeepAlternatives,
    KDChunks,
    ManyChunks,
    PastEnd,
    SplitContext,
    TeacherConfig,
    TrainConfig,
)
from crossdistill.data.cli import add_text_field_arg
from crossdistill.errors import UserError

# each scale's piece size, as the help and an error name them ("quick: 16384, cpu: 1024, ...")
PIECES = ", ".join(f"{name}: {scale.piece_bytes}" for name, scale in SCALES.items())

EXAMPLES = """examples:
  crossdistill bench quality --student-tokenizer $TOK/llama3/hf --teacher-tokenizer $TOK/qwen3/hf \\
      --teacher-tokenizer $TOK/llama2/hf --scale gpu --seeds 5 --out runs/quality
  crossdistill bench quality --corpus my.jsonl --student-tokenizer $TOK/llama3/hf \\
      --teacher-tokenizer $TOK/qwen3/hf --scale cpu --seeds 3 --loss forward_kl --loss gold --json
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "quality",
        help="how much cross-tokenizer KD teaches, against same-tokenizer KD and CE only",
        description=quality.__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="PATH",
        help="JSONL / text / Parquet / Arrow corpus, compressed or not (repeatable: the files are "
        "read in order, as far as the scale's bytes; default: the demo's corpus)",
    )
    add_text_field_arg(p, "text_field")
    p.add_argument("--student-tokenizer", required=True, metavar="DIR")
    p.add_argument(
        "--teacher-tokenizer",
        action="append",
        default=[],
        metavar="DIR",
        required=True,
        help="a cross teacher's tokenizer (repeatable)",
    )
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    p.add_argument("--seeds", type=int, default=5, help="seeds per student cell (at least 2)")
    p.add_argument(
        "--teacher-seeds",
        type=int,
        default=1,
        metavar="N",
        help="train each teacher N times, from seeds 0 to N-1, and every KD student under each: "
        "the spread and the interval of the gap closed then hold the teachers' run-to-run noise "
        "as well as the students' (default 1)",
    )
    p.add_argument(
        "--loss",
        action="append",
        choices=LOSSES,
        default=None,
        help=f"cross-tokenizer KD loss (repeatable; default {TeacherConfig.loss})",
    )
    p.add_argument(
        "--target",
        action="append",
        default=None,
        metavar="{" + ",".join(TARGETS) + "}",
        help=f"the projected losses' target (repeatable; default {TeacherConfig.target}): each "
        "projected loss runs under each target, the other losses once; A+B: the teacher in one "
        "KD term per target, each at half the KD weight",
    )
    for flag, choices, setting, default in (
        ("--kd-chunks", KDChunks, "teachers.N.kd_chunks", TeacherConfig.kd_chunks),
        ("--past-end", PastEnd, "teachers.N.past_end", TeacherConfig.past_end),
        ("--many-chunks", ManyChunks, "teachers.N.many_chunks", TeacherConfig.many_chunks),
        (
            "--deep-alternatives",
            DeepAlternatives,
            "teachers.N.deep_alternatives",
            TeacherConfig.deep_alternatives,
        ),
        ("--boundary", Boundary, "teachers.N.boundary", TeacherConfig.boundary),
        (
            "--split-context",
            SplitContext,
            "teachers.N.split_context",
            TeacherConfig.split_context,
        ),
        ("--ce-without-kd", CEWithoutKD, "train.ce_without_kd", TrainConfig.ce_without_kd),
    ):
        p.add_argument(
            flag,
            action="append",
            choices=get_args(choices),
            default=None,
            help=f"the cross cells' {setting} (repeatable; default {default}): each cross cell "
            "runs under each",
        )
    p.add_argument(
        "--kd-warmup-steps",
        action="append",
        type=int,
        default=None,
        metavar="N",
        help="the cross cells' train.kd_warmup_steps (repeatable; default "
        f"{TrainConfig.kd_warmup_steps}: none): the KD weight rises linearly to --kd-ratio over "
        "the students' first N steps; each cross cell runs under each",
    )
    p.add_argument(
        "--kd-ratio",
        action="append",
        type=float,
        default=None,
        metavar="W",
        help=f"the KD students' train.kd_ratio (repeatable; default {TrainConfig.kd_ratio}): the "
        "same-tokenizer and every cross cell run under each, beside the same teachers and CE-only "
        "students, and each cross cell's gap closed is against the same-tokenizer cell of its "
        "weight; the first is the reference",
    )
    p.add_argument("--top-k", type=int, default=TeacherConfig.top_k)
    p.add_argument("--temperature", type=float, default=TeacherConfig.temperature)
    p.add_argument("--teacher-steps", type=int, default=None, help="override the scale's")
    p.add_argument("--student-steps", type=int, default=None, help="override the scale's")
    p.add_argument(
        "--teacher-size",
        default=None,
        metavar="WIDTHxLAYERS",
        help="override the scale's teachers, e.g. 512x8 (64-wide heads; cpu: 256x4, gpu: 1024x12)",
    )
    p.add_argument("--teacher-lr", type=float, default=None, help="override the scale's")
    p.add_argument("--student-lr", type=float, default=None, help="override the scale's")
    p.add_argument(
        "--student-bytes",
        type=int,
        default=None,
        metavar="N",
        help="students train on N bytes of the teachers' training text (whole pieces spread evenly "
        "through it), in epochs; "
        "0: all of it (default: the scale's; gpu: 1,000,000)",
    )
    p.add_argument(
        "--piece-bytes",
        type=int,
        default=None,
        metavar="N",
        help="the corpus's documents (a --corpus's, or the default corpus's files) are cut into "
        "pieces of about N bytes at line ends, the rows shuffled for training and drawn for the "
        f"held-out text (default: the scale's; {PIECES}); a step reads as many places in the "
        "corpus as the pieces it spans; a size past the longest document keeps them whole",
    )
    p.add_argument("--device", default=None, help="override the scale's (cpu, cuda)")
    p.add_argument(
        "--teacher-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="KD students read each teacher's top-k from a cache built once (OUT/caches) over "
        "their text and the held-out text, instead of running the teacher at every step; a "
        "cached teacher sees each document whole, up to its own sequence length, where a live "
        "one sees the student row's part of it (default: the scale's; on at gpu, off at cpu)",
    )
    p.add_argument(
        "--max-teacher-spread",
        type=float,
        default=0.03,
        help="refuse when the teachers' bits per byte differ by more than this fraction",
    )
    p.add_argument(
        "--min-teacher-gain",
        type=float,
        default=0.10,
        help="refuse when a teacher is not this fraction better than the CE-only student",
    )
    p.add_argument(
        "--min-same-gain",
        type=float,
        default=0.05,
        help="warn when same-tokenizer KD is not this fraction better than CE only",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs trained at once, each in its own process (default: the scale's; gpu: 4); a"
        " run that fails or is killed stops them all, and the same command again goes on",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="train every student even when the comparison is refused (no gap closed is given)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/quality"))
    p.add_argument("--json", action="store_true", help="print one JSON object last on stdout")
    p.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> QualitySpec:
    scale = SCALES[args.scale]
    changes: dict[str, Any] = {}
    if args.teacher_steps is not None:
        changes["teacher_steps"] = args.teacher_steps
    if args.student_steps is not None:
        changes["student_steps"] = args.student_steps
    if args.device is not None:
        changes["device"] = args.device
    if args.teacher_size is not None:
        changes["teacher"] = parse_teacher_size(args.teacher_size)
    if args.teacher_cache is not None:
        changes["teacher_cache"] = args.teacher_cache
    for key in ("teacher_lr", "student_lr"):
        value = getattr(args, key)
        if value is not None:
            if not 0 < value < 1:
                raise UserError(
                    f"--{key.replace('_', '-')} {value} is not a learning rate: give a value "
                    "between 0 and 1 (the scales use 1e-3 to 3e-3)"
                )
            changes[key] = value
    if args.piece_bytes is not None:
        if args.piece_bytes < MIN_PIECE_BYTES:
            raise UserError(
                f"--piece-bytes {args.piece_bytes} is less than a few lines: give at least "
                f"{MIN_PIECE_BYTES} (the scales use {PIECES})"
            )
        changes["piece_bytes"] = args.piece_bytes
    piece = changes.get("piece_bytes", scale.piece_bytes)
    if args.student_bytes == 0:
        changes["student_train_bytes"] = None  # all of the teachers' text
    elif args.student_bytes is not None:
        if args.student_bytes < piece:
            raise UserError(
                f"--student-bytes {args.student_bytes} is less than one piece of the corpus "
                f"({piece} bytes); give at least {piece}, or 0 for all of the text"
            )
        changes["student_train_bytes"] = args.student_bytes
    for key, value in changes.items():
        if key.endswith("steps") and value < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    return QualitySpec(
        student_tokenizer=args.student_tokenizer,
        teacher_tokenizers=list(args.teacher_tokenizer),
        out=args.out,
        scale_name=args.scale,
        scale=replace(scale, **changes),
        corpora=list(args.corpus),
        text_field=args.text_field,
        seeds=args.seeds,
        teacher_seeds=args.teacher_seeds,
        losses=list(dict.fromkeys(args.loss or [TeacherConfig.loss])),
        targets=list(dict.fromkeys(args.target or [TeacherConfig.target])),
        kd_chunks=list(dict.fromkeys(args.kd_chunks or [TeacherConfig.kd_chunks])),
        past_end=list(dict.fromkeys(args.past_end or [TeacherConfig.past_end])),
        many_chunks=list(dict.fromkeys(args.many_chunks or [TeacherConfig.many_chunks])),
        deep_alternatives=list(
            dict.fromkeys(args.deep_alternatives or [TeacherConfig.deep_alternatives])
        ),
        boundary=list(dict.fromkeys(args.boundary or [TeacherConfig.boundary])),
        split_context=list(dict.fromkeys(args.split_context or [TeacherConfig.split_context])),
        ce_without_kd=list(dict.fromkeys(args.ce_without_kd or [TrainConfig.ce_without_kd])),
        kd_warmup_steps=list(dict.fromkeys(args.kd_warmup_steps or [TrainConfig.kd_warmup_steps])),
        kd_ratios=list(dict.fromkeys(args.kd_ratio or [TrainConfig.kd_ratio])),
        top_k=args.top_k,
        temperature=args.temperature,
        max_teacher_spread=args.max_teacher_spread,
        min_teacher_gain=args.min_teacher_gain,
        min_same_gain=args.min_same_gain,
        keep_going=args.keep_going,
        jobs=args.jobs if args.jobs is not None else scale.jobs,
    )


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    experiment = Experiment(spec, log=log)
    report = experiment.run()
    print_table(report, file=sys.stderr if args.json else sys.stdout)
    try:
        png = plot_report(spec.out, report, experiment.cells)
    except UserError as e:  # no matplotlib: the numbers are still there
        png = None
        log(f"[quality] no plot: {e}")
    if png is not None:
        log(f"[quality] curves: {png}")
    log(f"[quality] summary: {spec.out / 'summary.json'}")
    if args.json:
        print(json.dumps(report))
    return 1 if report["refused"] else 0

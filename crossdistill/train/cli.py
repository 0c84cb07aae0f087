"""`crossdistill train`, `crossdistill demo` and `crossdistill plot`."""

from __future__ import annotations

import argparse

from crossdistill.train.plot import add_plot_parser as _add_plot_parser

TRAIN_EXAMPLES = """examples:
  crossdistill train configs/qwen3-4b_to_llama-3.2-1b.yaml \\
      student.path=/ckpt/Llama-3.2-1B teachers.0.path=/ckpt/Qwen3-4B data.train=[corpus.jsonl]
  crossdistill train cfg.yaml train.steps=200 teachers.0.loss=jsd teachers.0.beta=0.3
  crossdistill train cfg.yaml --resume          # continue a killed run from its last checkpoint
"""

DEMO_EXAMPLES = """examples:
  crossdistill demo                      # writes runs/demo (about 3 minutes on 2 CPU cores)
  crossdistill demo --out /tmp/demo --seed 1
"""


def add_train_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="distil one or several teachers into a student",
        description="Run an off-policy distillation described by a YAML config plus overrides.",
        epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    p.set_defaults(func=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from crossdistill.config import load_config
    from crossdistill.train.loop import train

    cfg = load_config(args.config, args.overrides)
    final = train(cfg, resume=args.resume)
    for key, value in sorted(final.items()):
        print(f"{key:32s} {value:.4f}")
    return 0


def add_demo_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="the built-in cross-tokenizer distillation on this machine's Python sources",
        description=(
            "Train two tokenizers and a small teacher on the Python standard library, then two\n"
            "students with equal compute (CE only, and CE + cross-tokenizer KD); print held-out\n"
            "bits per byte of all three. CPU, no network, a few minutes."
        ),
        epilog=DEMO_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a much shorter run, for smoke tests")
    p.set_defaults(func=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    from crossdistill.train.demo import run_demo

    run_demo(args.out, seed=args.seed, quick=args.quick)
    return 0


def add_plot_parser(subparsers) -> None:
    _add_plot_parser(subparsers)

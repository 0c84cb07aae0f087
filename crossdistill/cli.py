"""The `crossdistill` command line.

Each subcommand lives beside the code it drives and contributes one `add_parser(subparsers)`
function; this module only lists them. Handlers import torch and friends lazily so that
`crossdistill --help` is instant. A `UserError` anywhere becomes one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from crossdistill import __version__
from crossdistill.errors import UserError

# (module, function) pairs, in the order `--help` lists them.
SUBCOMMANDS = [
    ("crossdistill.train.cli", "add_train_parser"),
    ("crossdistill.train.cli", "add_demo_parser"),
    ("crossdistill.train.cli", "add_plot_parser"),
    ("crossdistill.alignment.cli", "add_align_parser"),
    ("crossdistill.alignment.cli", "add_projection_parser"),
    ("crossdistill.bench", "add_bench_parser"),
    ("crossdistill.config_cli", "add_config_parser"),
]


class _Formatter(argparse.RawDescriptionHelpFormatter):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="crossdistill",
        description="Off-policy knowledge distillation of language models across tokenizers.",
        formatter_class=_Formatter,
    )
    parser.add_argument("--version", action="version", version=f"crossdistill {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name, func_name in SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:  # that capability is not part of this build
                continue
            raise
        getattr(module, func_name)(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except UserError as e:
        print(f"crossdistill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("crossdistill: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())

"""The `crossdistill` command line.

Each subcommand lives beside the code it drives and contributes one `add_parser(subparsers)`
function; this module only lists them. Handlers import torch and friends lazily so that
`crossdistill --help` is instant. A `UserError` anywhere becomes one line on stderr and exit 2
(`run_reporting`).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any

from crossdistill import __version__
from crossdistill.errors import RunFailed, UserError

# (module, function) pairs, in the order `--help` lists them.
SUBCOMMANDS = [
    ("crossdistill.train.cli", "add_train_parser"),
    ("crossdistill.train.cli", "add_demo_parser"),
    ("crossdistill.train.cli", "add_plot_parser"),
    ("crossdistill.train.teacher_cache", "add_cache_parser"),
    ("crossdistill.train.audit", "add_audit_parser"),
    ("crossdistill.eval.cli", "add_eval_parser"),
    ("crossdistill.data.cli", "add_align_parser"),
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
    return run_reporting(args.func, args)


# gloo's words when the process at the other end has gone (NCCL raises a DistBackendError)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer")


def run_reporting(fn: Any, args: Any) -> int:
    """`fn(args)` as an exit status: a `UserError` becomes one line on stderr and 2, a
    `RunFailed` its message (the failed process's own traceback) and 1. Under
    `torchrun`, each line names its rank, and a rank that only lost contact with another rank
    (which failed first, with its own message) says so in one line instead of a traceback."""
    rank = f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    try:
        return int(fn(args) or 0)
    except UserError as e:
        print(f"crossdistill: error: {rank}{e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"crossdistill: error: {rank}{e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"crossdistill: {rank}interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _out_of_memory(e):
            print(f"crossdistill: error: {rank}{_OOM_HINT.format(_first_line(e))}", file=sys.stderr)
            return 1
        if not (rank and _peer_gone(e)):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(
            f"crossdistill: error: {rank}stopped because another rank of the job stopped first "
            f"(its own message names the cause; torchrun lists that rank as the root cause). "
            f"Here: {type(e).__name__}: {first[:200]}",
            file=sys.stderr,
        )
        return 1


_OOM_HINT = (
    "out of GPU memory ({}); lower data.micro_batch_size (raise train.grad_accum to keep the "
    "batch) or data.seq_len, recompute blocks (student.activation_checkpointing=true), shard "
    "the models wider (student.parallel, teachers.N.parallel), split long sequences "
    "(parallel.cp), or keep a teacher on the CPU between steps (teachers.N.offload=true)"
)


def _out_of_memory(e: BaseException) -> bool:
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None)
    return oom is not None and isinstance(e, oom)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _peer_gone(e: BaseException) -> bool:
    dist = sys.modules.get("torch.distributed")
    backend_error = getattr(dist, "DistBackendError", None)
    if backend_error is not None and isinstance(e, backend_error):
        return True
    return any(words in str(e) for words in _PEER_GONE)


if __name__ == "__main__":
    raise SystemExit(main())

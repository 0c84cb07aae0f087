"""`crossdistill bench ...`: benchmarks that anyone can rerun; each prints a table, or one JSON
object with `--json`. Each benchmark module contributes `add_parser(subparsers)`. Code only a
benchmark needs (baselines of other pieces, profiles, ablation runs) lives in `benchmarks/`;
it imports from here, never the other way. `library_versions` names what a measured number
depends on besides the code, for results files.

`bench quality` is five modules: `quality_spec` (what it is asked: scales, settings and their
check), `quality_corpus` (the text), `quality_report` (the table and its refusals), `quality`
(the experiment and its runs; its docstring is the command's help) and `quality_cli` (the
command line), each importing only those before it.

Imports anything below it (`train` and down); only `cli` imports it."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import platform

BENCHMARKS = [
    "crossdistill.bench.align",
    "crossdistill.bench.loss",
    "crossdistill.bench.quality_cli",
    "crossdistill.bench.step",
]


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="run a benchmark (alignment, loss, training step, distillation quality)",
        description="Benchmarks measured side by side with a plain baseline in the same run.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name in BENCHMARKS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        module.add_parser(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def library_versions() -> dict[str, str]:
    """Python's and the numeric libraries' versions: a deterministic CPU number moves with them
    (benchmarks/README.md, "The demo again, and at top-128")."""
    versions = {"python": platform.python_version()}
    for name in ("torch", "numpy", "tokenizers", "transformers", "triton"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions

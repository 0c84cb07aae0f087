"""Data-pipeline throughput: `python benchmarks/bench_data.py [--workers N] [--json] ...`, the
same as `crossdistill bench data`."""

from __future__ import annotations

import argparse
import sys

from crossdistill.bench.data import add_parser

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench_data")
    add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["data", *sys.argv[1:]])
    sys.exit(args.func(args))

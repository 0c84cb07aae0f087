"""Alignment, JSONL pipeline, projection build and tokenizer-pair table:
`python benchmarks/bench_alignment.py [--sections speed,jsonl,projection,pairs] [--json]`, the
same as `crossdistill bench align`."""

from __future__ import annotations

import argparse
import sys

from crossdistill.bench.align import add_parser

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench_alignment")
    add_parser(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["align", *sys.argv[1:]])
    sys.exit(args.func(args))

"""`crossdistill config`: validate a config and print the resolved tree."""

from __future__ import annotations

import argparse
import json

EXAMPLES = """examples:
  crossdistill config configs/qwen3-4b_to_llama-3.2-1b.yaml
  crossdistill config configs/demo.yaml train.steps=50 teachers.0.loss=jsd
"""


def add_config_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "config",
        help="validate a training config and print it resolved, as JSON",
        description="Load a YAML config, apply a.b=v overrides, check every key and type, print JSON.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", nargs="?", help="YAML file (omit to see all defaults)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.set_defaults(func=run_config)


def run_config(args: argparse.Namespace) -> int:
    from crossdistill.config import load_config, to_dict

    cfg = load_config(args.config, args.overrides)
    print(json.dumps(to_dict(cfg), indent=2))
    return 0

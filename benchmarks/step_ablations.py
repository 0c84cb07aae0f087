"""Each optimisation of the step undone, one run at a time: `crossdistill bench step` once as
given and once per ablation (each a setting of the trainer's config, each in its own process,
so no run inherits another's compiled graphs, allocator state or kernels), then one table of
tokens/s and peak memory relative to the first run.

    python benchmarks/step_ablations.py --out results/ablations.jsonl -- \\
        --teacher qwen3-4b --teacher-tokenizer $TOK/qwen3/hf --student llama-3.2-1b \\
        --student-tokenizer $TOK/llama3/hf --compile --steps 10

Everything after `--` goes to every run; each ablation appends its own options (a later option
wins over an earlier one of the same name; `eager` drops `--compile`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ABLATIONS: dict[str, list[str]] = {
    "sdpa": ["--attention", "sdpa"],  # transformers' SDPA, the block mask from positions
    "eager": [],  # without --compile
    "padded-teachers": ["--teacher-padding", "keep"],  # cross teachers over padded rows
    "pytorch-loss": ["--loss-kernels", "pytorch"],  # the loss and targets without Triton
}


def run_one(common: list[str], name: str | None) -> dict:
    args = list(common)
    if name == "eager":
        args = [a for a in args if a != "--compile"]
    elif name is not None:
        args += ABLATIONS[name]
    cmd = [sys.executable, "-m", "crossdistill", "bench", "step", *args, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return {"ablation": name or "as given", "error": out.stderr.strip().splitlines()[-1:]}
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["ablation"] = name or "as given"
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ablate", action="append", choices=sorted(ABLATIONS), default=[])
    ap.add_argument("--out", type=Path, help="append each run's JSON here as it finishes")
    args = ap.parse_args(argv[:split])
    common = argv[split + 1 :]
    rows = []
    for name in [None, *(args.ablate or sorted(ABLATIONS))]:
        result = run_one(common, name)
        rows.append(result)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(result) + "\n")
    base = rows[0].get("tokens_per_s")
    print(f"{'run':18s} {'tokens/s':>10s} {'vs given':>9s} {'MFU':>6s} {'peak GiB':>9s}")
    for r in rows:
        if "error" in r:
            print(f"{r['ablation']:18s} error: {r['error']}")
            continue
        rel = r["tokens_per_s"] / base if base else float("nan")
        mfu = r.get("mfu")
        print(
            f"{r['ablation']:18s} {r['tokens_per_s']:10.0f} {rel:9.3f} "
            f"{'' if mfu is None else f'{mfu:6.1%}':>6s} {r.get('peak_gib', 0.0):9.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where one training step's peak GPU memory goes: the allocations live at the peak of a step
(after warm-up steps), replayed from a CUDA memory snapshot and summed by the package lines that
made them. Takes `crossdistill bench step`'s arguments; needs a CUDA device.

    python benchmarks/step_memory.py --student llama-3.2-1b --student-tokenizer $TOK/llama3/hf \\
        --teacher llama-3.2-3b --teacher-tokenizer $TOK/llama2/hf --seq-len 2048 \\
        --micro-batch 4 --target lookahead_prefix [--top 15]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossdistill.bench.step import add_parser  # noqa: E402
from crossdistill.bench.step_setup import build_bench, next_window, one_step  # noqa: E402

WARMUP = 3


def live_at_peak(trace: list[dict], base: int) -> tuple[int, list[dict]]:
    """Replay a snapshot's allocation trace from `base` bytes: the peak and what was live then."""
    live: dict[int, dict] = {}
    now = best = base
    best_live: list[dict] = []
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
            if now > best:
                best, best_live = now, list(live.values())
        elif event["action"] == "free_completed":
            freed = live.pop(event["addr"], None)
            now -= freed["size"] if freed else 0
    return best, best_live


def where(event: dict, depth: int = 3) -> str:
    """The first `depth` package frames of an allocation's stack."""
    frames = [f for f in event.get("frames", []) if "crossdistill/" in f["filename"]]
    names = [
        f"{f['filename'].split('crossdistill/')[-1]}:{f['line']}:{f['name']}"
        for f in frames[:depth]
    ]
    return " <- ".join(names) or "(outside the package)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--top", type=int, default=15, help="how many allocation sites to print")
    own, rest = p.parse_known_args(argv)
    step = argparse.ArgumentParser()
    add_parser(step.add_subparsers())
    args = step.parse_args(["step", *rest])
    if not torch.cuda.is_available():
        raise SystemExit("step_memory.py needs a CUDA device")
    with build_bench(args) as bench:
        for _ in range(WARMUP):
            one_step(bench, next_window(bench, args))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        one_step(bench, next_window(bench, args))
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, live = live_at_peak(snapshot["device_traces"][0], base)
    gib = 2**30
    print(
        f"peak {torch.cuda.max_memory_allocated() / gib:.3f} GiB, before the step "
        f"{base / gib:.3f} GiB, replayed peak {peak / gib:.3f} GiB"
    )
    sites: collections.Counter[str] = collections.Counter()
    for event in live:
        sites[where(event)] += event["size"]
    for site, size in sites.most_common(own.top):
        print(f"{size / gib:7.3f} GiB  {site}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

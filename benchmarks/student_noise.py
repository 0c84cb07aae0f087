"""Run-to-run noise of the quality benchmark's CE-only student: the same config (same seed, same
data order) trained several times, at several learning rates, side by side on one device.

The differences between repeats are what the device's non-deterministic kernels and the
training's sensitivity to them make of one seed; a KD effect smaller than this spread cannot be
seen in `bench quality`, whatever the number of seeds.

    python benchmarks/student_noise.py --tokenizer $TOK/llama3/hf --scale gpu \\
        --lrs 2e-3 1e-3 5e-4 --repeats 2 --jobs 6 --out /tmp/noise

Each finished run is appended to OUT/noise.jsonl; the last line on stdout is the JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossdistill.bench.quality import model_entry, run_config, train_many  # noqa: E402
from crossdistill.bench.quality_corpus import write_corpus  # noqa: E402
from crossdistill.bench.quality_spec import SCALES, QualitySpec  # noqa: E402
from crossdistill.models import load_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="the student's tokenizer folder")
    p.add_argument("--corpus", action="append", default=[])
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    p.add_argument("--lrs", type=float, nargs="+", default=[2e-3, 1e-3])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("noise-out"))
    args = p.parse_args(argv)

    scale = SCALES[args.scale]
    spec = QualitySpec(args.tokenizer, ["unused"], args.out, args.scale, scale, args.corpus)
    args.out.mkdir(parents=True, exist_ok=True)
    data, _ = write_corpus(
        args.out,
        args.corpus,
        train_bytes=scale.train_bytes,
        val_bytes=scale.val_bytes,
        piece_bytes=scale.piece_bytes,
    )
    student = model_entry(scale.student, args.tokenizer, len(load_tokenizer(args.tokenizer)))
    runs = {}
    for seed in args.seeds:
        for lr in args.lrs:
            for r in range(args.repeats):
                cfg = run_config(
                    spec, data, args.out / f"seed{seed}-lr{lr:g}-r{r}", student, lr=lr,
                    steps=scale.student_steps, seq_len=scale.seq_len, batch=scale.student_batch,
                    seed=seed, progress=False,
                )  # fmt: skip
                runs[(seed, lr, r)] = cfg
    results: dict[tuple[int, float], list[float]] = {}
    start = time.perf_counter()
    for (seed, lr, r), bpb in train_many(runs, args.jobs):
        results.setdefault((seed, lr), []).append(bpb)
        row = {"seed": seed, "lr": lr, "repeat": r, "bpb": bpb}
        row["seconds"] = time.perf_counter() - start
        print(json.dumps(row), file=sys.stderr, flush=True)
        with open(args.out / "noise.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    summary = {
        "scale": args.scale,
        "runs": {
            f"seed {seed} lr {lr:g}": {
                "runs": xs,
                "mean": statistics.fmean(xs),
                "range": max(xs) - min(xs),
            }
            for (seed, lr), xs in sorted(results.items())
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much a same-tokenizer teacher can teach at one `bench quality` scale: one teacher on the
student's tokenizer, then CE-only and KD students over a grid of student sizes, KD weights and
seeds (and, with several `--student-steps`, schedule lengths; with several `--teacher-steps`,
teachers trained for that many steps, so of several qualities), side by side on one device.

`bench quality` asks the same-tokenizer KD student to beat the CE-only one by 5% at the GPU
scale, or the scale says nothing about cross-tokenizer losses. This finds the student size, KD
weight and amount of student text (`--student-bytes`: N bytes of the teacher's text in whole
pieces spread through it, repeated in epochs; 0 is all of it) where it does, before the whole experiment is spent on them.

    python benchmarks/kd_headroom.py --tokenizer $TOK/llama3/hf --scale gpu \\
        --sizes small medium --kd-ratios 0 0.5 1 --seeds 0 1 2 --jobs 6 --out /tmp/headroom

Each finished run is appended to OUT/headroom.jsonl; the last line on stdout is the JSON
summary (each teacher's held-out bits per byte by its steps, mean bits per byte per size and KD
weight, and each KD weight's change against CE only per seed).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossdistill.bench.quality import (  # noqa: E402
    SAME_LOSS,
    model_entry,
    run_config,
    train_many,
)
from crossdistill.bench.quality_corpus import write_corpus, write_student_share  # noqa: E402
from crossdistill.bench.quality_spec import SCALES, QualitySpec  # noqa: E402
from crossdistill.models import load_tokenizer  # noqa: E402

# student shapes to try beside the scale's own ("small")
SIZES = {
    "medium": dict(
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
    ),
    "large": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", required=True, help="the student's (and teacher's) tokenizer")
    p.add_argument("--corpus", action="append", default=[])
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    p.add_argument("--sizes", nargs="+", default=["small"], choices=["small", *SIZES])
    p.add_argument("--kd-ratios", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--student-bytes", type=int, nargs="+", default=[0])
    p.add_argument(
        "--teacher-steps",
        type=int,
        nargs="+",
        default=[0],
        help="0: the scale's; several: one teacher each, and every KD cell under each of them",
    )
    p.add_argument(
        "--student-steps", type=int, nargs="+", default=[0], help="0: the scale's own schedule"
    )
    p.add_argument("--top-k", type=int, nargs="+", default=[64])
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("headroom-out"))
    args = p.parse_args(argv)

    scale = SCALES[args.scale]
    teacher_steps = list(dict.fromkeys(n or scale.teacher_steps for n in args.teacher_steps))
    if min(teacher_steps) < 1:
        p.error("--teacher-steps must be at least 1 (0: the scale's)")
    spec = QualitySpec(args.tokenizer, ["unused"], args.out, args.scale, scale, args.corpus)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "headroom.jsonl"
    data, train_texts = write_corpus(
        args.out,
        args.corpus,
        train_bytes=scale.train_bytes,
        val_bytes=scale.val_bytes,
        piece_bytes=scale.piece_bytes,
    )
    train_files = {
        n: write_student_share(data, train_texts, n) if n else data / "train.jsonl"
        for n in args.student_bytes
    }
    vocab = len(load_tokenizer(args.tokenizer))
    start = time.perf_counter()

    def record(row: dict) -> None:
        row["seconds"] = time.perf_counter() - start
        print(json.dumps(row), file=sys.stderr, flush=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    # one teacher per step count, in a folder of its own ("teacher" when there is one)
    teacher_dirs = {
        n: args.out / ("teacher" if len(teacher_steps) == 1 else f"teacher-steps{n}")
        for n in teacher_steps
    }
    teacher_cfgs = {
        n: run_config(
            spec,
            data,
            teacher_dirs[n],
            model_entry(scale.teacher, args.tokenizer, vocab),
            steps=n,
            lr=scale.teacher_lr,
            seq_len=scale.seq_len,
            batch=scale.teacher_batch,
            seed=0,
            progress=False,
            accum=scale.teacher_accum,
        )
        for n in teacher_steps
    }
    teacher_bpb = {}
    for n, bpb in train_many(teacher_cfgs, args.jobs):
        teacher_bpb[n] = bpb
        record({"run": "teacher", "steps": n, "bpb": bpb})

    device_dtype = "bfloat16" if scale.device.startswith("cuda") else "float32"

    def teacher(steps: int, top_k: int, temperature: float) -> dict:
        return {
            "name": "teacher",
            "path": str(teacher_dirs[steps] / "final"),
            "dtype": device_dtype,
            "loss": SAME_LOSS,
            "top_k": top_k,
            "temperature": temperature,
        }

    # the KD cells: a KD weight, a top-k and a temperature; "kd 0" is the CE-only student
    kinds = [(0.0, "kd 0", None)]
    for n, kd, k, t in itertools.product(
        teacher_steps, args.kd_ratios, args.top_k, args.temperature
    ):
        if kd:
            under = f" teacher {n}" if len(teacher_steps) > 1 else ""
            kinds.append((kd, f"kd {kd:g} k {k} T {t:g}{under}", teacher(n, k, t)))
    runs = {}
    # seed-major: an early stop still has every cell at its first seeds
    for seed, size, n, steps, (kd, kind, entry) in itertools.product(
        args.seeds, args.sizes, args.student_bytes, args.student_steps, kinds
    ):
        shape = scale.student if size == "small" else SIZES[size]
        steps = steps or scale.student_steps
        if len(args.student_steps) > 1 and steps != scale.student_steps:
            size = f"{size} steps {steps}"
        cfg = run_config(
            spec, data,
            args.out / f"{size.replace(' ', '')}-bytes{n}-{kind.replace(' ', '')}-seed{seed}",
            model_entry(shape, args.tokenizer, vocab),
            steps=steps, lr=scale.student_lr, seq_len=scale.seq_len,
            batch=scale.student_batch, seed=seed, teachers=[entry] if entry else None,
            progress=False, train_file=train_files[n], kd_ratio=kd,
        )  # fmt: skip
        runs[(size, n, kind, seed)] = cfg
    results: dict[tuple[str, int, str], dict[int, float]] = {}
    for (size, n, kind, seed), bpb in train_many(runs, args.jobs):
        results.setdefault((size, n, kind), {})[seed] = bpb
        record({"size": size, "student_bytes": n, "cell": kind, "seed": seed, "bpb": bpb})

    cells = {}
    for (size, n, kind), by_seed in sorted(results.items()):
        by_seed = dict(sorted(by_seed.items()))
        cell = {"runs": by_seed, "mean": statistics.fmean(by_seed.values())}
        ce = results.get((size, n, "kd 0"), {})
        change = {s: by_seed[s] / ce[s] - 1 for s in by_seed if s in ce}
        if kind != "kd 0" and change:
            cell["change_vs_ce"] = change
            cell["mean_change_vs_ce"] = statistics.fmean(change.values())
        cells[f"{size} bytes {n} {kind}"] = cell
    teachers = {str(n): teacher_bpb[n] for n in teacher_steps}
    print(json.dumps({"scale": args.scale, "teachers": teachers, "cells": cells}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How far apart `bench quality`'s teachers end, by teacher size: the teachers of one scale
(one per tokenizer, the same architecture, steps and bytes of text per step, as the bench trains
them) at several widths and depths, side by side on one device.

The bench compares tokenizers only when their teachers end within 3% of each other. At a small
size the teacher's tied embedding is most of its parameters, so a tokenizer with a bigger
vocabulary has the bigger model; this finds the size at which the tokenizer stops deciding how
good the teacher is.

    python benchmarks/teacher_size.py --student-tokenizer $TOK/llama3/hf \\
        --teacher-tokenizer $TOK/qwen3/hf --teacher-tokenizer $TOK/llama2/hf --scale cpu \\
        --sizes scale 384x6 512x8 --teacher-steps 800 --teacher-lr 1e-3 --jobs 8 --out /tmp/ts

Each finished teacher is appended to OUT/teachers.jsonl; the last line on stdout is the JSON
summary: per size, the parameters (body and embedding per tokenizer), each teacher's held-out
bits per byte and its distance from the teacher on the student's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossdistill.bench.quality import Experiment, model_entry, train_many  # noqa: E402
from crossdistill.bench.quality_spec import SCALES, QualitySpec, parse_teacher_size  # noqa: E402
from crossdistill.models.loading import resolve_hf_config, weight_bytes  # noqa: E402


def parameters(shape: dict[str, int], tokenizer: str, vocab: int) -> tuple[int, int]:
    """(body, tied embedding) parameters of the teacher the bench builds of `shape` over
    `vocab` ids, counted on the meta device."""
    entry = model_entry(shape, tokenizer, vocab)
    hf_config = resolve_hf_config(arch=entry["arch"], overrides=entry["overrides"])
    total = weight_bytes(hf_config, "float32") // 4
    embedding = hf_config.vocab_size * hf_config.hidden_size
    return total - embedding, embedding


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--student-tokenizer", required=True)
    p.add_argument("--teacher-tokenizer", action="append", required=True)
    p.add_argument("--corpus", action="append", default=[])
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    p.add_argument(
        "--sizes", nargs="+", default=["scale"], help="scale (its own teacher) or WIDTHxLAYERS"
    )
    p.add_argument("--teacher-steps", type=int, nargs="+", default=[0], help="0: the scale's")
    p.add_argument("--teacher-lr", type=float, default=None)
    p.add_argument(
        "--teacher-seeds", type=int, default=1, help="teachers per tokenizer, from seeds 0, 1, ..."
    )
    p.add_argument("--device", default=None)
    p.add_argument(
        "--student-tokenizer-only",
        action="store_true",
        help="train only the teachers on the student's tokenizer (with --teacher-seeds: how far "
        "one tokenizer's teachers end apart); --teacher-tokenizer is still needed for the spec",
    )
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("teacher-size-out"))
    args = p.parse_args(argv)

    base = SCALES[args.scale]
    changes = {"teacher_lr": args.teacher_lr, "device": args.device}
    base = replace(base, **{k: v for k, v in changes.items() if v is not None})
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "teachers.jsonl"
    start = time.perf_counter()

    experiments: dict[tuple[str, int], Experiment] = {}
    for size in args.sizes:
        for steps in args.teacher_steps:
            scale = replace(
                base,
                teacher=base.teacher if size == "scale" else parse_teacher_size(size),
                teacher_steps=steps or base.teacher_steps,
            )
            spec = QualitySpec(
                args.student_tokenizer, args.teacher_tokenizer, args.out, args.scale, scale,
                args.corpus, teacher_seeds=args.teacher_seeds, jobs=args.jobs,
            )  # fmt: skip
            experiments[(size, scale.teacher_steps)] = Experiment(spec, log=lambda line: None)
    jobs = {
        (key, job.cell, job.teacher_seed): job
        for key, e in experiments.items()
        for job in e.teacher_jobs()
        if not args.student_tokenizer_only or job.cell == f"teacher-{e.same_label}"
    }
    for (key, cell, seed), bpb in train_many({k: j.cfg for k, j in jobs.items()}, args.jobs):
        jobs[(key, cell, seed)].done(bpb)
        row = {"size": key[0], "steps": key[1], "teacher": cell, "seed": seed or 0, "bpb": bpb}
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), file=sys.stderr, flush=True)
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    summary = []
    for (size, steps), e in experiments.items():
        shape = e.spec.scale.teacher
        same = e.teachers[e.same_label]
        entry = {"size": size, "shape": shape, "steps": steps, "teachers": {}}
        for path, label in [(e.spec.student_tokenizer, e.same_label), *e.labels.items()]:
            if label not in e.teachers:
                continue  # not trained (--student-tokenizer-only)
            body, embedding = parameters(shape, path, e.vocab[path])
            entry["teachers"][label] = {
                "bpb": e.teachers[label],
                "bpb_by_seed": e.teacher_seed_bpb[label],
                "vs_same": e.teachers[label] / same - 1,
                "body_parameters": body,
                "embedding_parameters": embedding,
            }
        entry["spread"] = max(abs(t["vs_same"]) for t in entry["teachers"].values())
        summary.append(entry)
    print(json.dumps({"scale": args.scale, "lr": base.teacher_lr, "sizes": summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

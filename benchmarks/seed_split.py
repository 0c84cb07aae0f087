"""Which half of a `bench quality` seed makes a bad seed: the students' data order or their
initial weights. The bench draws both from one seed; here each KD cell's student and the CE-only
student are trained at every (data order, init) pair of `--orders` × `--inits`, so a seed whose
cross student gains little can be traced to one of the two.

    python benchmarks/seed_split.py --scale gpu --student-tokenizer $TOK/llama3/hf \\
        --teacher-tokenizer $TOK/llama2/hf --target lookahead_prefix_end \\
        --orders 4 3 --inits 4 3 --jobs 8 --out /tmp/split

The teachers, caches and corpus are the bench's own (its `Experiment`, in OUT: a rerun reuses
them), but only the teacher the cell learns from is trained: `--cell cross` (the first teacher
tokenizer's cell) or `--cell same`. Each finished run is appended to OUT/split.jsonl; the last
line on stdout is the JSON summary: each pair's bits per byte and the KD student's change
against the CE-only student of the same pair.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossdistill.bench.quality import Experiment, build_one, model_entry, train_many  # noqa: E402
from crossdistill.bench.quality_cli import spec_from_args  # noqa: E402
from crossdistill.cli import build_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    p.add_argument("--orders", type=int, nargs="+", default=[0], help="data orders (seeds)")
    p.add_argument("--inits", type=int, nargs="+", default=[0], help="initial weights (seeds)")
    p.add_argument("--cell", choices=["cross", "same"], default="cross")
    own, rest = p.parse_known_args(argv)  # the rest: `bench quality`'s own arguments
    spec = spec_from_args(build_parser().parse_args(["bench", "quality", *rest]))
    exp = Experiment(spec, log=lambda line: print(line, file=sys.stderr, flush=True))
    cell = next(c for c in exp.cells if (c.name == "same") == (own.cell == "same") and c.teacher)
    teachers = [job for job in exp.teacher_jobs() if job.cell == f"teacher-{cell.teacher}"]
    exp.run_jobs(teachers)
    if spec.scale.teacher_cache:
        exp.run_jobs([exp.cache_job(cell.teacher, 0)], run=build_one)
    s = spec.scale
    student = model_entry(s.student, spec.student_tokenizer, exp.vocab[spec.student_tokenizer])
    runs = {}
    for order, init in itertools.product(own.orders, own.inits):
        for kind in (exp.cells[0], cell):  # CE only, then the KD cell
            cfg = exp.student_job(kind, student, init).cfg
            folder = spec.out / "split" / kind.name / f"order{order}-init{init}"
            runs[(kind.name, order, init)] = replace(
                cfg,
                data=replace(cfg.data, seed=order),
                run=replace(cfg.run, out_dir=str(folder)),
            )
    bpb: dict[tuple[str, int, int], float] = {}
    start = time.perf_counter()
    for (name, order, init), value in train_many(runs, spec.jobs):
        bpb[(name, order, init)] = value
        row = {"cell": name, "order": order, "init": init, "bpb": value}
        row["seconds"] = round(time.perf_counter() - start, 1)
        print(json.dumps(row), file=sys.stderr, flush=True)
        with open(spec.out / "split.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    pairs = []
    for order, init in itertools.product(own.orders, own.inits):
        ce, kd = bpb[("ce", order, init)], bpb[(cell.name, order, init)]
        pairs.append(
            {"order": order, "init": init, "ce": ce, "kd": kd, "change_vs_ce": kd / ce - 1}
        )
    teacher = exp.teacher_info[cell.teacher]
    summary = {"cell": cell.name, "teacher": teacher, "pairs": pairs}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A separate teacher against the colocated one and the student alone: `crossdistill train` runs
of the same config, side by side in one session.

Three runs of `--steps` optimizer steps on random-init models of the presets' shapes (this
machine's Python sources as text, the trainer's own code):

- `student_alone`: no teacher (kd_ratio 0), one process: the student's time;
- `colocated`: the teacher in the student's process, between its steps (one process);
- `separate`: `teachers.0.placement=separate` under torchrun with 2 processes, the student on
  the first and the teacher on the second (on one GPU both share it and the targets travel as
  CUDA IPC handles; on two GPUs each has its own and the link is NCCL);
- `separate_host` (asked for with `--runs`): `separate` with `train.teacher_link=host`, the
  targets staged through host memory (on one GPU: what CUDA IPC saves).

Reported per run: median student tokens/s over the steps after `--warmup`, peak memory of the
student's process, and for `separate` the share of time the student waited for targets
(`target_wait`, from the run's metrics), and each run's first losses (a separate teacher
trains the student as the colocated one does: same batches, same targets). With the teacher on a GPU of its own the step should
cost max(teacher, student), not their sum.

    python benchmarks/separate_teacher.py --student-tokenizer $TOK/llama3 \\
        --teacher-tokenizer $TOK/qwen3 --out benchmarks/results/separate-teacher-DATE-GPU.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def corpus(folder: Path, needed_bytes: int) -> Path:
    from crossdistill.train.demo_assets import stdlib_corpus

    train, val = stdlib_corpus(max_files=4000, train_bytes=needed_bytes, val_bytes=200_000)
    path = folder / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in train:
            f.write(json.dumps({"text": text}) + "\n")
    (folder / "val.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in val))
    return path


def config(args, data: Path, out: Path, placement: str | None, link: str = "auto") -> dict:
    cuda = args.device == "cuda"
    from crossdistill.bench.step_setup import TINY

    model = {
        "attn_implementation": "auto",
        "compile": args.compile,
        "overrides": dict(TINY) if args.tiny else {},
    }
    cfg = {
        "student": {
            "arch": args.student,
            "tokenizer": args.student_tokenizer,
            "dtype": "float32",
            **model,
        },
        "teachers": [],
        "data": {
            "train": [str(data)],
            "validation": [str(data.parent / "val.jsonl")],
            "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch,
            "num_workers": 4 if cuda else 0,
        },
        "train": {
            "steps": args.steps,
            "kd_ratio": 0.0 if placement is None else 0.5,
            "eval_every": args.steps,
            "eval_batches": 1,
            "checkpoint_every": args.steps,
            "log_every": 1,
            "device": args.device,
            "loss_chunk_size": 4096,
            "teacher_link": link,
        },
        "optim": {"warmup_steps": 2},
        "run": {"out_dir": str(out), "tensorboard": False, "progress": False},
    }
    if placement is not None:
        cfg["teachers"] = [
            {
                "name": "teacher",
                "arch": args.teacher,
                "tokenizer": args.teacher_tokenizer,
                "dtype": "bfloat16" if cuda else "float32",
                "top_k": 64,
                "placement": placement,
                **model,
            }
        ]
    return cfg


def run(args, name: str, cfg: dict, workdir: Path, processes: int) -> dict:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if processes == 1:
        command = [sys.executable, "-m", "crossdistill", "train", str(path)]
    else:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "--master_port", str(29500 + processes), "-m", "crossdistill", "train", str(path),
        ]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    lines = Path(cfg["run"]["out_dir"], "metrics.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    steps = [r for r in records if "tokens_per_s" in r and r["step"] > args.warmup]
    out = {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "steps_timed": len(steps),
        "wall_s": wall,
    }
    # the first steps' losses: a separate teacher must train the student as a colocated one
    out["first_losses"] = [r["loss"] for r in records if "loss" in r][:5]
    waits = [r["target_wait"] for r in steps if "target_wait" in r]
    if waits:
        out["target_wait"] = statistics.mean(waits)
    print(name, json.dumps(out), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--student", default="llama-3.2-1b")
    p.add_argument("--student-tokenizer", required=True)
    p.add_argument("--teacher", default="qwen3-4b")
    p.add_argument("--teacher-tokenizer", required=True)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a few narrow layers (a CPU smoke run)")
    p.add_argument("--runs", nargs="+", default=["student_alone", "colocated", "separate"])
    p.add_argument("--out", help="JSON record to write")
    args = p.parse_args()
    import torch

    with tempfile.TemporaryDirectory(prefix="separate-teacher-") as tmp:
        workdir = Path(tmp)
        data = corpus(workdir, args.steps * args.micro_batch * args.seq_len * 5)
        placements = {"student_alone": (None, 1), "colocated": ("colocated", 1)}
        placements["separate"] = placements["separate_host"] = ("separate", 2)
        results = {}
        for name in args.runs:
            placement, processes = placements[name]
            link = "host" if name == "separate_host" else "auto"
            cfg = config(args, data, workdir / name, placement, link)
            results[name] = run(args, name, cfg, workdir, processes)
    record = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "gpus": torch.cuda.device_count() if args.device == "cuda" else 0,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/separate_teacher.py " + " ".join(sys.argv[1:]),
        "torch": torch.__version__,
        "student": args.student,
        "teacher": args.teacher,
        "seq_len": args.seq_len,
        "micro_batch": args.micro_batch,
        "runs": results,
    }
    if {"separate", "colocated"} <= results.keys():
        record["separate_vs_colocated"] = (
            results["separate"]["tokens_per_s"] / results["colocated"]["tokens_per_s"]
        )
    if {"separate", "separate_host"} <= results.keys():
        record["ipc_vs_host"] = (
            results["separate"]["tokens_per_s"] / results["separate_host"]["tokens_per_s"]
        )
    if {"separate", "student_alone"} <= results.keys():
        record["separate_vs_student_alone"] = (
            results["separate"]["tokens_per_s"] / results["student_alone"]["tokens_per_s"]
        )
    print(json.dumps(record, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()

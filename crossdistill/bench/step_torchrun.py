"""`crossdistill bench step` under torchrun: the job's numbers from every process's, the same
command timed in one process first (`--one-gpu-reference`), and `--teacher-placement separate`.

Separate: each teacher on processes of its own (`teachers.N.placement: separate`), one process
for the student and `--teacher-ranks` per teacher (laid out by `--set teachers.N.parallel...`).
The student's process times its steps as `bench step` does and adds the share of that time it
waited for targets; each teacher's processes serve exactly the batches those steps read, and
report nothing."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from crossdistill.errors import UserError


def measure_separate(args: Any, measure: Any) -> dict | None:
    """`measure(args, env=...)` in the student's process; None in a teacher's."""
    import torch

    from crossdistill.distributed.layout import job_size
    from crossdistill.distributed.streams import init_roles

    needed = 1 + args.teacher_ranks * len(args.teacher)
    world = job_size()
    if world != needed:
        raise UserError(
            f"--teacher-placement separate runs the student in a process and each of the "
            f"{len(args.teacher)} teacher(s) in {args.teacher_ranks} of its own: start it with "
            f"torchrun --nproc_per_node {needed} -m crossdistill bench step ... (this job has "
            f"{world})"
        )
    env = init_roles(args.device, (args.teacher_ranks,) * len(args.teacher))
    try:
        if env.role > 0:
            _serve(args, env)
            return None
        return measure(args, env=env)
    except BaseException:
        env.link.abort()
        raise
    finally:
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group()


def _serve(args: Any, env: Any) -> None:
    from crossdistill.bench.step_setup import bench_config, write_corpus
    from crossdistill.train.serve import serve_teacher

    with tempfile.TemporaryDirectory(prefix="crossdistill-bench-") as tmp:
        cfg = bench_config(args, write_corpus(Path(tmp), args))  # the student's corpus, again
        serve_teacher(cfg, env, resume=False, stop_after=None, validate=False)


def job_rates(bench, result: dict) -> dict:
    """The job's numbers from every process's: student tokens/s of the whole job (data ranks
    summed; tensor- and context-parallel ranks share theirs), per GPU, and each rank's peak
    memory. MFU is then per GPU."""
    import torch
    import torch.distributed as dist

    c = bench.c
    rate = torch.tensor([result["tokens_per_s"]], dtype=torch.float64, device=c.device)
    total = float(c.placement.reduce_counts(rate)[0])
    peaks: list[Any] = [None] * c.env.world_size
    dist.all_gather_object(peaks, result.get("peak_gib"))
    layouts = [c.placement.student.layout.describe()]
    layouts += [p.layout.describe() for p in c.placement.teachers if p is not None]
    return {
        "tokens_per_s": total,
        "per_gpu_tokens_per_s": total / c.env.world_size,
        "processes": c.env.job_size,
        "gpus": gpus_of(c.env),
        "peak_gib_per_rank": peaks,
        "layout": "; ".join(layouts),
    }


def one_gpu_reference(args) -> dict | None:
    """Under torchrun, the first process times the same command alone on its GPU first (the
    other processes wait for it where the job's processes meet); None elsewhere."""
    import subprocess

    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or int(os.environ.get("RANK", "0")) != 0:
        return None
    argv = [a for a in sys.argv[1:] if a != "--one-gpu-reference"]
    argv = _without_layouts(argv) + ([] if "--json" in argv else ["--json"])
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
    if args.device.startswith("cuda"):  # this process's GPU, among those the job sees
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[local] if visible else str(local)
    # the command as it was started: `-m crossdistill bench step`, or a script that adds its
    # extras to the bench (`benchmarks/bench_step.py`)
    program = ["-m", "crossdistill"] if sys.argv[0].endswith("__main__.py") else [sys.argv[0]]
    done = subprocess.run(
        [sys.executable, *program, *argv], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        from crossdistill.errors import UserError

        raise UserError(f"the one-GPU reference run failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


_JOB_VARIABLES = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
}  # fmt: skip


def _without_layouts(argv: list[str]) -> list[str]:
    """`argv` without `--set ...parallel...` items (one process has the one-rank layouts)."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--set" and i + 1 < len(argv) and ".parallel." in argv[i + 1]:
            skip = True
            continue
        if a.startswith("--set=") and ".parallel." in a:
            continue
        out.append(a)
    return out


def gpus_of(env) -> int:
    """The GPUs a job uses (its processes share them where there are fewer)."""
    import torch

    if env.device.type != "cuda":
        return 0
    return min(env.job_size, torch.cuda.device_count())

"""`crossdistill bench step --teacher-placement separate`: the step with each teacher on a
process of its own (`teachers.N.placement: separate`), under torchrun with one process for the
student and one per teacher. The student's process times its steps as `bench step` does and
adds the share of that time it waited for targets; each teacher's process serves exactly the
batches those steps read, and reports nothing."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from crossdistill.errors import UserError


def measure_separate(args: Any, measure: Any) -> dict | None:
    """`measure(args, env=...)` in the student's process; None in a teacher's."""
    import torch

    from crossdistill.distributed.streams import init_roles

    needed = 1 + len(args.teacher)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != needed:
        raise UserError(
            f"--teacher-placement separate runs the student and each of the {len(args.teacher)} "
            f"teacher(s) in a process of its own: start it with torchrun --nproc_per_node "
            f"{needed} -m crossdistill bench step ... (this job has {world})"
        )
    env = init_roles(args.device, (1,) * len(args.teacher))
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

"""A separate teacher's processes: the student's schedule, with targets instead of updates.

Each process of a separate teacher (`teachers.N.placement: separate`, see
`crossdistill.distributed.streams`) builds the same plan as the student's (config checks,
layouts, tokenizers, caches), its teacher in `teachers.N.parallel` over the teacher's ranks,
and one pair of loaders per student data rank its data-parallel group serves. It then walks
the loop the student walks, step for step: every micro-batch of a step's window, then at every
validation the held-out batches, each turned into targets and sent. The student tells it the
step it starts at (0, or the checkpoint it resumed), and the loaders resume from that
checkpoint's saved states, so both sides read the same batches in the same order. A teacher
laid out as a pipeline (`teachers.N.parallel.pp`, `distributed/teacher_pipeline.py`) walks it
on every stage; its last stage's processes send the targets.
"""

from __future__ import annotations

from pathlib import Path

import torch

from crossdistill.config import Config
from crossdistill.distributed.layout import DistEnv
from crossdistill.distributed.runtime import TeacherSlot, cached_of
from crossdistill.distributed.setup import teacher_model
from crossdistill.distributed.streams import TargetSender, await_start, student_ranks_of
from crossdistill.models import Teacher
from crossdistill.train.build import plan_run
from crossdistill.train.checkpoint import found_at
from crossdistill.train.step import StepSettings


def serve_teacher(
    cfg: Config, env: DistEnv, resume: bool, stop_after: int | None, validate: bool = True
) -> None:
    """Compute and send separate teacher `env.role`'s targets for the whole run (or until the
    student stops after `stop_after` steps); returns once the student has received them all.
    `validate=False`: the student runs no validation (a benchmark's timed steps)."""
    torch.manual_seed(cfg.train.seed)
    run = plan_run(cfg, env)
    k = run.layouts.teacher_of(env.role)
    tcfg, place = run.teachers[k], run.placement
    placed = place.teachers[k]
    student = run.layouts.student
    # this group's share of the student's data ranks
    served = [d for d in range(student.dp) if d % placed.layout.dp == place.data_rank]
    loaders = {d: run.loaders(cfg, d, student.dp) for d in served}
    slot = TeacherSlot(Teacher(teacher_model(cfg, k, placed, env.device), tcfg.name), tcfg, None)
    # one process of the group sends: in the last stage of a teacher's pipeline
    leader = placed.rank("cp_tp") == 0 and placed.rank("pp") == placed.layout.pp - 1
    sender = TargetSender(
        env.link,
        tcfg.name,
        {d: student_ranks_of(d, student) for d in served} if leader else {},
        tcfg.payload,
        cfg.train.teacher_prefetch,
        cfg.train.teacher_timeout_s,
    )
    start = await_start(env, cfg.train.teacher_timeout_s)
    if start > 0:
        found = found_at(Path(cfg.run.out_dir), start)
        for d in served:
            state = found.data_state(d, student.dp)
            if state is not None:
                loaders[d][0].load_state_dict(state)
    fused = StepSettings.of(cfg.train, env.device).fused
    chunk = cfg.train.loss_chunk_size

    def serve(d: int, batch) -> None:
        tb = batch.teachers[k]
        targets = place.teacher_targets(slot, k, tb, chunk, fused, cached_of(batch, k))
        if leader:  # the stages before the last have none: they sent their hidden states
            sender.send(d, tb, targets)

    batches = {d: iter(loaders[d][0]) for d in served}
    end = cfg.train.steps if stop_after is None else min(cfg.train.steps, start + stop_after)
    for step in range(start, end):
        for d in served:
            for _ in range(cfg.train.grad_accum):
                serve(d, next(batches[d]))
        sender.step_done()
        done = step + 1
        if validate and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
            for d in served:
                for batch in loaders[d][1].take(cfg.train.eval_batches):
                    serve(d, batch)
            sender.step_done()
    stages = getattr(slot.teacher.model, "teacher_stages", None)
    if stages is not None:
        stages.flush()
    sender.flush()

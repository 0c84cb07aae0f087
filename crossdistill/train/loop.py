"""`crossdistill train`: the explicit training loop, top to bottom.

fetch a window of micro-batches -> teachers' top-k targets -> student forward + chunked loss ->
backward -> (skip if non-finite) clip -> step -> log -> every N steps validate / checkpoint.

The same loop runs in one process or in every process of a `torchrun` job: the layouts decide
what each rank holds (`crossdistill.distributed`), rank 0 alone logs and exports.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path

import torch

from crossdistill.config import Config, save_config
from crossdistill.distributed.layout import DistEnv, job_size
from crossdistill.distributed.streams import announce_start, init_roles, separate_ranks
from crossdistill.errors import UserError
from crossdistill.train.build import Components, build_components
from crossdistill.train.checkpoint import (
    CHECKPOINTS_DIR,
    Checkpointer,
    Found,
    capture_rng_state,
    check_same_student,
    check_writable,
    export_hf,
    load_latest,
    restore_rng_state,
    student_shape,
)
from crossdistill.train.evaluate import evaluate
from crossdistill.train.metrics import MetricsLogger
from crossdistill.train.step import StepSettings, train_step

MIN_FREE_BYTES = 256 * 1024**2


def train(cfg: Config, resume: bool = False, stop_after: int | None = None) -> dict[str, float]:
    """Run (or resume) a distillation; returns the final validation metrics.

    `stop_after`: leave after this many steps of this invocation, right after a checkpoint
    would be due or not, exactly as a killed job would (for time-sliced schedulers: resume
    with `resume=True`). Under `torchrun`, every process calls this; rank 0 returns the
    metrics, the other ranks an empty dict (so that the job reports them once)."""
    env = init_roles(
        cfg.train.device,
        separate_ranks(cfg, job_size()),
        ipc=cfg.train.teacher_link == "auto",
    )
    try:
        if env.role > 0:  # a separate teacher's process: it serves the student its targets
            from crossdistill.train.serve import serve_teacher

            serve_teacher(cfg, env, resume, stop_after)
            return {}
        final = _train(cfg, env, resume, stop_after)
        return final if env.is_main else {}
    except BaseException:
        if env.link is not None:
            env.link.abort()  # transfers in flight must not keep the process from ending
        raise
    finally:
        if env.owns_group:
            torch.distributed.destroy_process_group()


def _train(cfg: Config, env: DistEnv, resume: bool, stop_after: int | None) -> dict[str, float]:
    run_dir = Path(cfg.run.out_dir)
    check_writable(run_dir, MIN_FREE_BYTES)
    if not resume and any(run_dir.glob(f"{CHECKPOINTS_DIR}/step_*")):
        raise UserError(
            f"{run_dir} already holds checkpoints; pass --resume to continue that run, or choose "
            "another run.out_dir"
        )
    torch.manual_seed(cfg.train.seed)
    c = build_components(cfg, env)
    if env.is_main:
        save_config(cfg, run_dir / "config.json")
    start_step = _restore(c, run_dir) if resume else None
    announce_start(env, start_step or 0, cfg.train.teacher_timeout_s)
    settings = StepSettings.of(cfg.train, c.device)
    logger = _logger(cfg, env, run_dir, start_step)
    saver = Checkpointer(run_dir, cfg.train.keep_last, cfg.train.checkpoint_in_background)
    try:
        final = _loop(c, cfg, run_dir, start_step or 0, stop_after, settings, logger, saver)
    except BaseException:
        with contextlib.suppress(Exception):  # the save in flight completes; the first error
            saver.wait()  # is the one raised
        raise
    saver.wait()  # the last checkpoint is on disk when `train` returns
    return final


def _loop(c, cfg, run_dir, start_step, stop_after, settings, logger, saver):
    """The steps from `start_step` on: train, log, validate, checkpoint; then the HF export.
    Returns the last validation metrics."""
    final: dict[str, float] = {}
    skipped = 0
    with logger:
        if cfg.train.kd_ratio > 0 and not c.slots:
            logger.write(
                f"warning: train.kd_ratio = {cfg.train.kd_ratio} but no teacher is configured: "
                "training on cross-entropy alone (add teachers, or set train.kd_ratio=0)"
            )
        for note in c.notes:
            logger.write(note)
        for slot in c.slots:
            if slot.stream is not None:
                source = slot.stream.source
                logger.write(
                    f"teacher {slot.stream.name!r}: separate, targets from rank {source} of the "
                    f"job over {slot.stream.link.transport(source)}"
                )
        batches = iter(c.train_loader)
        t_last, tokens = time.perf_counter(), 0
        waited_last = c.placement.target_wait(c.slots) or 0.0
        for step in range(start_step, cfg.train.steps):
            window = [next(batches) for _ in range(cfg.train.grad_accum)]
            tokens += sum(mb.student.num_target_tokens for mb in window)
            step_settings = settings.at(step)
            metrics = train_step(c.student, c.slots, window, step_settings, c.placement)
            grad_norm = c.placement.clip_grads(c.student, cfg.optim.grad_clip)
            # one host sync per step, outside the loss: a non-finite step is skipped
            finite = bool(torch.isfinite(metrics["loss"]) & torch.isfinite(grad_norm))
            done = step + 1
            if finite:
                skipped = 0
                c.optimizer.step()
                c.scheduler.step()
                c.optimizer.zero_grad(set_to_none=True)
            else:  # a non-finite step is skipped: no update, no log line, no checkpoint
                c.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                logger.write(
                    f"step {done}: non-finite loss or gradient, step skipped ({skipped} in a row)"
                )
                if skipped >= cfg.train.max_consecutive_skips:
                    raise UserError(
                        f"{skipped} consecutive steps had a non-finite loss or gradient; stopping. "
                        "Lower optim.lr, raise train.grad_accum, or check the data; the last "
                        "checkpoint is intact"
                    )
            if finite and (done % cfg.train.log_every == 0 or done == cfg.train.steps):
                now = time.perf_counter()
                waited = c.placement.target_wait(c.slots)
                metrics.update(
                    grad_norm=grad_norm,
                    lr=c.scheduler.get_last_lr()[0],
                    **({"kd_ratio": step_settings.kd_ratio} if settings.kd_warmup_steps else {}),
                    tokens_per_s=_all_tokens(c, tokens) / max(now - t_last, 1e-9),
                )
                if waited is not None:  # share of the time spent waiting for streamed targets
                    metrics["target_wait"] = (waited - waited_last) / max(now - t_last, 1e-9)
                    waited_last = waited
                logger.log(done, metrics)
                t_last, tokens = now, 0
            if done % cfg.train.eval_every == 0 or done == cfg.train.steps:
                final = evaluate(c, cfg)
                final.update(eval_tasks(c, cfg))
                logger.log(done, final)
            if finite and (done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps):
                _save(c, done, saver)
            if stop_after is not None and done - start_step >= stop_after:
                return final
    saver.wait()  # the checkpoint group's collectives: the background save's first, then ours
    stages = c.placement.pipeline
    export_hf(
        c.student, c.tok_s, run_dir / "final", c.fused, None if stages is None else stages.group
    )
    return final


def eval_tasks(c, cfg: Config) -> dict[str, float]:
    """`train.eval_tasks` on the student as it is now (one process: checked at load)."""
    if not cfg.train.eval_tasks:
        return {}
    from crossdistill.eval.model import EvalModel
    from crossdistill.eval.tasks import parse_task, run_tasks

    tasks = [parse_task(spec) for spec in cfg.train.eval_tasks]
    options = {"seq_len": cfg.data.seq_len, "batch_size": cfg.data.micro_batch_size}
    was_training = c.student.training
    c.student.eval()
    try:
        with torch.autocast(c.device.type, dtype=torch.bfloat16, enabled=c.device.type == "cuda"):
            return run_tasks(EvalModel("student", c.student, c.tok_s, c.device), tasks, options)
    finally:
        c.student.train(was_training)


class _Silent:
    """The logger of ranks other than 0: a job logs once."""

    def log(self, step: int, scalars) -> None:
        return None

    def write(self, message: str) -> None:
        return None

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _logger(cfg: Config, env: DistEnv, run_dir: Path, resume_step: int | None):
    if not env.is_main:
        return _Silent()
    return MetricsLogger(
        run_dir,
        cfg.train.steps,
        tensorboard=cfg.run.tensorboard,
        progress=cfg.run.progress,
        resume_step=resume_step,
    )


def _all_tokens(c: Components, tokens: int) -> float:
    """Target tokens of the whole job since the last log (each data-parallel rank read its own)."""
    count = torch.tensor([float(tokens)], dtype=torch.float64, device=c.device)
    return float(c.placement.reduce_counts(count)[0])


def _save(c: Components, step: int, saver: Checkpointer) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = get_state_dict(c.student, c.optimizer)
    p = c.placement
    if p.pipeline is not None:
        optimizer = p.pipeline.whole_param_groups(optimizer)
    meta = {
        "scheduler": c.scheduler.state_dict(),
        "world_size": c.env.world_size,
        "data_size": p.data_size,
        "student_tp": p.student.layout.tp,
        "student_pp": p.student.layout.pp,
        "student_config": student_shape(c.student),
    }
    # tensor/context ranks and pipeline stages share the data
    first_of_data_rank = p.student.rank("cp_tp") == 0 and p.student.rank("pp") == 0
    data = (p.data_rank, c.train_loader.state_dict()) if first_of_data_rank else None
    saver.save(step, {"model": model, "optimizer": optimizer}, meta, data, capture_rng_state())


def _restore(c: Components, run_dir: Path) -> int | None:
    """The state of the newest checkpoint in `c` (any layout it was saved under); its step,
    or None when the run has none yet."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    tp = c.placement.student.layout.tp

    def check(found: Found) -> None:
        saved = found.state.get("student_config")
        check_same_student(saved, c.student, found.folder, found.model_shapes())
        saved_tp = found.state.get("student_tp", 1)
        if c.fused and saved_tp != tp:
            raise UserError(
                f"{found.folder} holds fused projections laid out for student tp={saved_tp}; "
                f"resume with student.parallel.tp={saved_tp}"
            )

    model, optimizer = get_state_dict(c.student, c.optimizer)
    sharded = {"model": model, "optimizer": optimizer}
    found = load_latest(run_dir, sharded, check)
    if found is None:
        return None
    set_state_dict(
        c.student,
        c.optimizer,
        model_state_dict=sharded["model"],
        optim_state_dict=sharded["optimizer"],
    )
    c.scheduler.load_state_dict(found.state["scheduler"])
    loader = found.data_state(c.placement.data_rank, c.placement.data_size)
    if loader is not None:
        c.train_loader.load_state_dict(loader)
    rng = found.rng_state()
    if rng is not None:
        restore_rng_state(rng)
    return found.step


def bits(nats: float) -> float:
    return nats / math.log(2.0)

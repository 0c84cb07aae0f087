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
from crossdistill.distributed.grads import clip_grad_norm_
from crossdistill.distributed.layout import DistEnv, init_distributed
from crossdistill.errors import UserError
from crossdistill.train.build import Components, build_components
from crossdistill.train.checkpoint import (
    BackgroundSaver,
    capture_rng_state,
    check_same_student,
    check_writable,
    load_latest,
    restore_rng_state,
    save_checkpoint,
    student_shape,
    write_folder,
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
    env = init_distributed(cfg.train.device)
    try:
        final = _train(cfg, env, resume, stop_after)
        return final if env.is_main else {}
    finally:
        if env.owns_group:
            torch.distributed.destroy_process_group()


def _train(cfg: Config, env: DistEnv, resume: bool, stop_after: int | None) -> dict[str, float]:
    run_dir = Path(cfg.run.out_dir)
    check_writable(run_dir, MIN_FREE_BYTES)
    latest = _find_latest(run_dir, env) if resume else None
    if (
        not resume
        and (run_dir / "checkpoints").is_dir()
        and any((run_dir / "checkpoints").iterdir())
    ):
        raise UserError(
            f"{run_dir} already holds checkpoints; pass --resume to continue that run, or choose "
            "another run.out_dir"
        )
    torch.manual_seed(cfg.train.seed)
    c = build_components(cfg, env)
    if env.is_main:
        save_config(cfg, run_dir / "config.json")
    start_step = 0
    if latest is not None:
        start_step = _restore(c, latest)
    settings = StepSettings(
        kd_ratio=cfg.train.kd_ratio,
        teacher_mode=cfg.train.teacher_mode,
        loss_chunk_size=cfg.train.loss_chunk_size,
        autocast=c.device.type == "cuda",
        device=c.device,
    )
    logger = _logger(cfg, env, run_dir, start_step if latest is not None else None)
    saver = None
    if cfg.train.checkpoint_in_background and not env.distributed:
        saver = BackgroundSaver(run_dir, keep_last=cfg.train.keep_last)
    try:
        final = _loop(c, cfg, env, run_dir, start_step, stop_after, settings, logger, saver)
    except BaseException:
        if saver is not None:  # the save in flight completes; the first error is the one raised
            with contextlib.suppress(Exception):
                saver.wait()
        raise
    if saver is not None:  # the last checkpoint is on disk when `train` returns
        saver.wait()
    return final


def _loop(c, cfg, env, run_dir, start_step, stop_after, settings, logger, saver):
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
        batches = iter(c.train_loader)
        t_last, tokens = time.perf_counter(), 0
        for step in range(start_step, cfg.train.steps):
            window = [next(batches) for _ in range(cfg.train.grad_accum)]
            tokens += sum(mb.student.num_target_tokens for mb in window)
            metrics = train_step(c.student, c.slots, window, settings, placement=c.placement)
            grad_norm = clip_grad_norm_(c.student.parameters(), cfg.optim.grad_clip)
            if not bool(torch.isfinite(metrics["loss"]) & torch.isfinite(grad_norm)):
                # one host sync per step, outside the loss: a non-finite step is skipped
                c.optimizer.zero_grad(set_to_none=True)
                skipped += 1
                logger.write(
                    f"step {step + 1}: non-finite loss or gradient, step skipped ({skipped} in a row)"
                )
                if skipped >= cfg.train.max_consecutive_skips:
                    raise UserError(
                        f"{skipped} consecutive steps had a non-finite loss or gradient; stopping. "
                        "Lower optim.lr, raise train.grad_accum, or check the data; the last "
                        "checkpoint is intact"
                    )
                continue
            skipped = 0
            c.optimizer.step()
            c.scheduler.step()
            c.optimizer.zero_grad(set_to_none=True)
            done = step + 1
            if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                now = time.perf_counter()
                metrics.update(
                    grad_norm=grad_norm,
                    lr=c.scheduler.get_last_lr()[0],
                    tokens_per_s=_all_tokens(c, tokens) / max(now - t_last, 1e-9),
                )
                logger.log(done, metrics)
                t_last, tokens = now, 0
            if done % cfg.train.eval_every == 0 or done == cfg.train.steps:
                final = evaluate(c, cfg)
                logger.log(done, final)
            if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
                _save(c, cfg, run_dir, done, saver)
            if stop_after is not None and done - start_step >= stop_after:
                return final
    export_hf(c, run_dir / "final")
    return final


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
    if not c.env.distributed:
        return tokens
    count = torch.tensor([float(tokens)], dtype=torch.float64, device=c.device)
    return float(c.placement.reduce_counts(count)[0])


def _find_latest(run_dir: Path, env: DistEnv):
    """("single", (step, state)) or ("dcp", (step, folder)) for the newest checkpoint, or None."""
    from crossdistill.distributed import checkpoint as sharded

    found = sharded.newest(run_dir)
    if found is not None and found[2] == sharded.DCP_FORMAT:
        return "dcp", (found[0], found[1])
    if env.distributed:
        if found is not None:
            raise UserError(
                f"{found[1]} was saved by a single process; resume it with one process, or "
                "start a new run in another run.out_dir"
            )
        return None
    latest = load_latest(run_dir)
    return None if latest is None else ("single", latest)


def _state(c: Components, cfg: Config, step: int) -> dict:
    return {
        "model": c.student.state_dict(),
        "optimizer": c.optimizer.state_dict(),
        "scheduler": c.scheduler.state_dict(),
        "loader": c.train_loader.state_dict(),
        "rng": capture_rng_state(),
        "step": step,
        "student_config": student_shape(c.student),
    }


def _save(
    c: Components, cfg: Config, run_dir: Path, step: int, saver: BackgroundSaver | None
) -> None:
    if saver is not None:
        saver.save(step, _state(c, cfg, step))
        return
    if not c.env.distributed:
        save_checkpoint(run_dir, step, _state(c, cfg, step), keep_last=cfg.train.keep_last)
        return
    from crossdistill.distributed import checkpoint as sharded

    p = c.placement
    first_of_data_rank = p.student.rank("cp_tp") == 0
    meta = {
        "scheduler": c.scheduler.state_dict(),
        "world_size": c.env.world_size,
        "data_size": p.data_size,
        "student_tp": p.student.layout.tp,
        "student_config": student_shape(c.student),
    }
    sharded.save_sharded(
        run_dir,
        step,
        c.student,
        c.optimizer,
        meta,
        (p.data_rank, c.train_loader.state_dict()) if first_of_data_rank else None,
        capture_rng_state(),
        cfg.train.keep_last,
    )


def _restore(c: Components, latest) -> int:
    kind, found = latest
    if kind == "single":
        step, state = found
        check_same_student(state.get("student_config"), c.student, f"step {step}", state["model"])
        c.student.load_state_dict(state["model"])
        c.optimizer.load_state_dict(state["optimizer"])
        c.scheduler.load_state_dict(state["scheduler"])
        c.train_loader.load_state_dict(state["loader"])
        restore_rng_state(state["rng"])
        return int(step)
    from crossdistill.distributed import checkpoint as sharded

    step, folder = found
    meta = sharded.load_sharded(folder, c.student, c.optimizer)
    tp = c.placement.student.layout.tp if c.env.distributed else 1
    if c.fused and meta.get("student_tp", 1) != tp:
        raise UserError(
            f"{folder} holds fused projections laid out for student tp={meta.get('student_tp')}; "
            f"resume with student.parallel.tp={meta.get('student_tp')}"
        )
    c.scheduler.load_state_dict(meta["scheduler"])
    data_rank = c.placement.data_rank if c.env.distributed else 0
    data_size = c.placement.data_size if c.env.distributed else 1
    loader, rng = sharded.load_rank_files(folder, data_rank, data_size, meta["data_size"])
    if loader is not None:
        c.train_loader.load_state_dict(loader)
    if rng is not None:
        restore_rng_state(rng)
    return int(meta["step"])


def export_hf(c: Components, out: Path) -> None:
    """The student as a Hugging Face folder (`save_pretrained` + its tokenizer); under
    `torchrun` gathered once and written by rank 0."""
    if c.env.distributed:
        from crossdistill.distributed.checkpoint import export_hf_gathered

        export_hf_gathered(c.student, c.tok_s, out, c.fused)
        return

    def write(folder: Path) -> None:
        c.student.save_pretrained(folder, safe_serialization=True)
        c.tok_s.save_pretrained(folder)

    write_folder(out, write, "the final Hugging Face folder")


def bits(nats: float) -> float:
    return nats / math.log(2.0)

"""`crossdistill train`: the explicit training loop, top to bottom.

fetch a window of micro-batches -> teachers' top-k targets -> student forward + chunked loss ->
backward -> (skip if non-finite) clip -> step -> log -> every N steps validate / checkpoint.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from crossdistill.config import Config, save_config
from crossdistill.errors import UserError
from crossdistill.train.build import Components, build_components
from crossdistill.train.checkpoint import (
    capture_rng_state,
    check_writable,
    load_latest,
    restore_rng_state,
    save_checkpoint,
)
from crossdistill.train.evaluate import evaluate
from crossdistill.train.metrics import MetricsLogger
from crossdistill.train.step import StepSettings, train_step

MIN_FREE_BYTES = 256 * 1024**2


def train(cfg: Config, resume: bool = False, stop_after: int | None = None) -> dict[str, float]:
    """Run (or resume) a distillation; returns the final validation metrics.

    `stop_after`: leave after this many steps of this invocation, right after a checkpoint
    would be due or not, exactly as a killed job would (for time-sliced schedulers: resume
    with `resume=True`)."""
    run_dir = Path(cfg.run.out_dir)
    check_writable(run_dir, MIN_FREE_BYTES)
    latest = load_latest(run_dir) if resume else None
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
    c = build_components(cfg)
    save_config(cfg, run_dir / "config.json")
    start_step = 0
    if latest is not None:
        start_step = _restore(c, *latest)
    settings = StepSettings(
        kd_ratio=cfg.train.kd_ratio,
        teacher_mode=cfg.train.teacher_mode,
        loss_chunk_size=cfg.train.loss_chunk_size,
        autocast=c.device.type == "cuda",
        device=c.device,
    )
    logger = MetricsLogger(
        run_dir,
        cfg.train.steps,
        tensorboard=cfg.run.tensorboard,
        progress=cfg.run.progress,
        resume_step=start_step if latest is not None else None,
    )
    final: dict[str, float] = {}
    skipped = 0
    with logger:
        batches = iter(c.train_loader)
        t_last, tokens = time.perf_counter(), 0
        for step in range(start_step, cfg.train.steps):
            window = [next(batches) for _ in range(cfg.train.grad_accum)]
            tokens += sum(mb.student.num_target_tokens for mb in window)
            metrics = train_step(c.student, c.slots, window, settings)
            grad_norm = torch.nn.utils.clip_grad_norm_(c.student.parameters(), cfg.optim.grad_clip)
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
                    tokens_per_s=tokens / max(now - t_last, 1e-9),
                )
                logger.log(done, metrics)
                t_last, tokens = now, 0
            if done % cfg.train.eval_every == 0 or done == cfg.train.steps:
                final = evaluate(c, cfg)
                logger.log(done, final)
            if done % cfg.train.checkpoint_every == 0 or done == cfg.train.steps:
                _save(c, cfg, run_dir, done)
            if stop_after is not None and done - start_step >= stop_after:
                return final
    export_hf(c, run_dir / "final")
    return final


def _state(c: Components, cfg: Config, step: int) -> dict:
    return {
        "model": c.student.state_dict(),
        "optimizer": c.optimizer.state_dict(),
        "scheduler": c.scheduler.state_dict(),
        "loader": c.train_loader.state_dict(),
        "rng": capture_rng_state(),
        "step": step,
    }


def _save(c: Components, cfg: Config, run_dir: Path, step: int) -> None:
    save_checkpoint(run_dir, step, _state(c, cfg, step), keep_last=cfg.train.keep_last)


def _restore(c: Components, step: int, state: dict) -> int:
    c.student.load_state_dict(state["model"])
    c.optimizer.load_state_dict(state["optimizer"])
    c.scheduler.load_state_dict(state["scheduler"])
    c.train_loader.load_state_dict(state["loader"])
    restore_rng_state(state["rng"])
    return int(state["step"])


def export_hf(c: Components, out: Path) -> None:
    """The student as a Hugging Face folder (`save_pretrained` + its tokenizer)."""
    out.mkdir(parents=True, exist_ok=True)
    c.student.save_pretrained(out, safe_serialization=True)
    c.tok_s.save_pretrained(out)


def bits(nats: float) -> float:
    return nats / math.log(2.0)

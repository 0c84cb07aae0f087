"""The one place where the pieces meet: one optimizer step over a window of micro-batches.

Order of work, and why:
1. every teacher runs on every micro-batch of the window first (under `no_grad`), producing
   small top-k targets; the window's teacher quality (bits per byte) is known before the
   student sees anything, so multi-teacher weights are decided per global batch, never per
   micro-batch;
2. the valid-position counts of the whole window are summed (and all-reduced across data-parallel
   ranks by the placement) so each term is `sum / global count`: gradient accumulation
   and data parallelism do not change the loss or its gradient;
3. the student runs micro-batch by micro-batch: forward to hidden states, the chunked lm_head +
   loss pass, backward (pipeline stages: the schedule's order, the loss and its counts on the
   last stage, the teachers' targets computed by all stages and gathered there, or received
   there from a separate teacher).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.profiler import record_function

from crossdistill.config import CEWithoutKD, TrainConfig
from crossdistill.distributed.runtime import (
    Placement,
    TeacherSlot,
    cached_of,
    make_term,
    shard_kwargs,
    target_bytes,
)
from crossdistill.losses import (
    TeacherTargets,
    ce_count,
    kd_count,
    next_token_nll,
    student_loss,
)

LN2 = math.log(2.0)
# the step's phases as `torch.profiler` ranges (a profile of a step reads its time per phase)
PHASE_TEACHERS = "crossdistill/teachers"
PHASE_COUNTS = "crossdistill/counts"
PHASE_FORWARD = "crossdistill/student_forward"
PHASE_LOSS = "crossdistill/student_loss"
PHASE_BACKWARD = "crossdistill/student_backward"
PHASE_PIPELINE = "crossdistill/pipeline"
PHASE_OPTIMIZER = "crossdistill/optimizer"  # clipping and the update (the caller's)


@dataclass
class StepSettings:
    kd_ratio: float
    teacher_mode: str  # weighted | dynamic | best
    loss_chunk_size: int
    autocast: bool
    device: torch.device
    fused: bool | None = None  # the loss kernels: None = where they apply, False = PyTorch
    ce_without_kd: CEWithoutKD = "ratio"  # TrainConfig.ce_without_kd
    kd_warmup_steps: int = 0  # TrainConfig.kd_warmup_steps

    @classmethod
    def of(cls, train: TrainConfig, device: torch.device) -> StepSettings:
        """The step's settings for `train` (bf16 autocast on CUDA)."""
        return cls(
            kd_ratio=train.kd_ratio,
            teacher_mode=train.teacher_mode,
            loss_chunk_size=train.loss_chunk_size,
            autocast=device.type == "cuda",
            device=device,
            fused=None if train.loss_kernels == "auto" else False,
            ce_without_kd=train.ce_without_kd,
            kd_warmup_steps=train.kd_warmup_steps,
        )

    def at(self, step: int) -> StepSettings:
        """The settings of step `step` (0-based): the KD weight of the warm-up, a function of
        the step alone, so a resumed run weighs its steps as the run it continues did."""
        if step >= self.kd_warmup_steps:
            return self
        return replace(self, kd_ratio=self.kd_ratio * (step + 1) / self.kd_warmup_steps)


def teacher_weights(
    slots: list[TeacherSlot], nats_per_byte: list[Tensor], mode: str
) -> list[Tensor | float]:
    """Per-teacher weights for this global batch.

    weighted: the configured static weights. dynamic: static weights times softmax(−nats per
    byte) over teachers (a teacher that predicts this batch's text better counts more; bytes,
    not tokens, so teachers with different tokenizers compare fairly). best: all weight on the
    teacher with the lowest bits per byte."""
    static = [s.cfg.weight for s in slots]
    if mode == "weighted" or len(slots) == 1:
        return static
    npb = torch.stack(nats_per_byte)
    if mode == "dynamic":
        w = torch.softmax(-npb, 0) * torch.tensor(static, device=npb.device)
        w = w / w.sum().clamp(min=1e-12) * sum(static)
    else:  # best
        w = torch.nn.functional.one_hot(torch.argmin(npb), len(slots)).to(npb.dtype) * sum(static)
    return list(w.unbind(0))


def train_step(
    student: nn.Module,
    slots: list[TeacherSlot],
    micro_batches: list,
    settings: StepSettings,
    place: Placement,
) -> dict[str, Tensor]:
    """Forward and backward over one window; returns detached metrics (no host sync here).
    Gradients are accumulated in `student`; the caller clips and steps. `place`: how the pieces
    are laid out over the job's ranks (one process: the one-rank layout)."""
    dev = settings.device
    move_offloaded(slots, dev)

    def targets_of(i: int, k: int) -> TeacherTargets:
        mb, s = micro_batches[i], slots[k]
        return place.teacher_targets(
            s, k, mb.teachers[k], settings.loss_chunk_size, settings.fused, cached_of(mb, k)
        )

    pipe = place.pipeline
    with record_function(PHASE_TEACHERS):
        targets = place.window_targets(slots, [mb.teachers for mb in micro_batches], targets_of)
    if targets is None:  # a pipeline stage before the last: the loss and its counts are not here
        move_offloaded(slots, "cpu")
        with (
            torch.autocast(dev.type, dtype=torch.bfloat16, enabled=settings.autocast),
            record_function(PHASE_PIPELINE),
        ):
            pipe.train([mb.student for mb in micro_batches], None)
        return pipe.share({})
    terms = [
        [
            make_term(s, mb.teachers[k], targets[i][k], dev, mb.student.input_ids)
            for k, s in enumerate(slots)
        ]
        for i, mb in enumerate(micro_batches)
    ]

    labels = [mb.student.labels.to(dev, non_blocking=True).flatten() for mb in micro_batches]
    counts = torch.stack(
        [sum(ce_count(lb) for lb in labels)]
        + [
            sum(kd_count(terms[i][k], labels[i]) for i in range(len(micro_batches)))
            for k in range(len(slots))
        ]
    ).to(torch.float64)
    teacher_nll = [
        sum(next_token_nll(targets[i][k])[0] for i in range(len(micro_batches)))
        for k in range(len(slots))
    ]
    teacher_bytes = [
        sum(target_bytes(mb.teachers[k], dev) for mb in micro_batches) for k in range(len(slots))
    ]
    with record_function(PHASE_COUNTS):
        stats = place.reduce_counts(
            torch.cat([counts, torch.stack(teacher_nll + teacher_bytes).to(torch.float64)])
            if slots
            else counts
        )
    ce_den, kd_dens = stats[0], stats[1 : 1 + len(slots)]
    npb = [
        stats[1 + len(slots) + k] / stats[1 + 2 * len(slots) + k].clamp(min=1)
        for k in range(len(slots))
    ]
    weights = teacher_weights(slots, npb, settings.teacher_mode)
    move_offloaded(slots, "cpu")

    total: dict[str, Tensor] = {}

    def loss_of(i: int, hidden: Tensor, rows: Any = None) -> Tensor:
        """Micro-batch i's loss from its final hidden states `[N, H]` (metrics added to total)."""
        for k, term in enumerate(terms[i]):
            term.denominator = kd_dens[k]
            term.weight = weights[k]
        lm_head, vocab = place.lm_head(student)  # after the forward: FSDP has gathered it
        # under autocast too: the lm_head matmuls run in bf16 (fp32 master weight cast once
        # per chunk pass), with fp32 softmax and accumulation inside the loss
        with (
            torch.autocast(dev.type, dtype=torch.bfloat16, enabled=settings.autocast),
            record_function(PHASE_LOSS),
        ):
            loss, metrics = student_loss(
                hidden,
                lm_head,
                labels[i],
                terms[i],
                kd_ratio=settings.kd_ratio if slots else 0.0,
                ce_denominator=ce_den,
                chunk_size=settings.loss_chunk_size,
                **shard_kwargs(rows, vocab),
                unit_upstream=True,  # backpropagated as is
                fused=settings.fused,
                ce_without_kd=settings.ce_without_kd,
            )
        for name, value in metrics.items():
            total[name] = total.get(name, 0) + value.detach()
        return loss

    if pipe is not None:  # the stages run the micro-batches in the schedule's order
        with (
            torch.autocast(dev.type, dtype=torch.bfloat16, enabled=settings.autocast),
            record_function(PHASE_PIPELINE),
        ):
            pipe.train([mb.student for mb in micro_batches], loss_of)
    else:
        for i, mb in enumerate(micro_batches):
            with (
                torch.autocast(dev.type, dtype=torch.bfloat16, enabled=settings.autocast),
                record_function(PHASE_FORWARD),
            ):
                hidden, rows = place.student_hidden(student, mb.student)
            loss = loss_of(i, hidden, rows)
            with record_function(PHASE_BACKWARD):
                loss.backward()
    total = place.reduce_metrics(total)
    for k, s in enumerate(slots):
        total[f"teacher_bpb/{s.cfg.name}"] = npb[k] / LN2
        w = weights[k]  # a float (static weights) is filled in place: a copy would synchronize
        total[f"weight/{s.cfg.name}"] = (
            w if isinstance(w, Tensor) else torch.full((), w, device=dev)
        )
    total["num_ce_tokens"] = ce_den
    if pipe is not None:  # the last stage's numbers on every stage
        total = pipe.share(total)
    return total


def move_offloaded(slots: list[TeacherSlot], device: Any) -> None:
    """Teachers that live on the CPU between steps (`teachers.N.offload`) to `device`: the
    step's device for their forwards, "cpu" after them."""
    for s in slots:
        if s.teacher is not None and s.teacher.offload:
            s.teacher.to(device)

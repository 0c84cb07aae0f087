"""The one place where the pieces meet: one optimizer step over a window of micro-batches.

Order of work, and why:
1. every teacher runs on every micro-batch of the window first (under `no_grad`), producing
   small top-k targets; the window's teacher quality (bits per byte) is known before the
   student sees anything, so multi-teacher weights are decided per global batch, never per
   micro-batch;
2. the valid-position counts of the whole window are summed (and all-reduced across data-parallel
   ranks by the caller's `reduce`) so each term is `sum / global count`: gradient accumulation
   and data parallelism do not change the loss or its gradient;
3. the student runs micro-batch by micro-batch: forward to hidden states, the chunked lm_head +
   loss pass, backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from crossdistill.config import TeacherConfig
from crossdistill.losses import (
    KDTerm,
    TeacherTargets,
    VocabProjection,
    ce_count,
    kd_count,
    kd_positions,
    next_token_nll,
    student_loss,
    teacher_targets,
)
from crossdistill.models.attention import flash_covers, segments_of
from crossdistill.models.forward import final_hidden
from crossdistill.models.teacher import Teacher

LN2 = math.log(2.0)


@dataclass
class TeacherSlot:
    """A teacher with everything the step needs about it."""

    teacher: Teacher
    cfg: TeacherConfig
    projection: VocabProjection


@dataclass
class StepSettings:
    kd_ratio: float
    teacher_mode: str  # weighted | dynamic | best
    loss_chunk_size: int
    autocast: bool
    device: torch.device


def _to(x: Tensor, device: torch.device) -> Tensor:
    return x.to(device, non_blocking=True)


# Whether a cross teacher's body runs on its non-pad tokens only (`[1, N]` instead of the
# padded `[B, T_t]`): "auto" where flash varlen attention covers every layer (there the rows
# need no shape of their own; the masked fallback would cost `N²` instead of `B·T_t²`), "on",
# "off" (`bench step --teacher-padding keep`).
DROP_TEACHER_PADDING = {"mode": "auto"}


def _real_rows(slot: TeacherSlot, tb, device: torch.device) -> Tensor | None:
    """The flat positions of `tb`'s non-pad tokens on `device` where the teacher's body runs on
    them alone, else None."""
    mode = DROP_TEACHER_PADDING["mode"]
    index = getattr(tb, "real_index", None)
    if mode == "off" or index is None or tb.real_max_seqlen == 0:
        return None
    if mode == "auto" and not flash_covers(slot.teacher.model, device, tb.real_max_seqlen):
        return None
    return _to(index, device)


@torch.no_grad()
def teacher_hidden(slot: TeacherSlot, tb, device: torch.device) -> tuple[Tensor, Tensor | None]:
    """(final hidden states, the flat positions they are at or None): `[B·T_t, H_t]` over the
    padded rows, or `[N, H_t]` over the non-pad tokens only, which skips the padding's share of
    the teacher's FLOPs (cross teachers pad every row to the longest, rounded up)."""
    ids, pos = _to(tb.input_ids, device), _to(tb.position_ids, device)
    rows = _real_rows(slot, tb, device)
    if rows is None:
        hidden = slot.teacher.hidden_states(ids, pos, segments_of(tb, device))  # [B, T_t, H_t]
        return hidden.flatten(0, 1), None
    segments = (_to(tb.real_cu_seqlens, device), tb.real_max_seqlen)
    flat = [x.view(1, -1).index_select(1, rows) for x in (ids, pos)]  # [1, N]
    return slot.teacher.hidden_states(*flat, segments)[0], rows


@torch.no_grad()
def targets_from_hidden(
    slot: TeacherSlot, tb, hidden: Tensor, rows: Tensor | None, chunk_size: int, device
) -> TeacherTargets:
    """`teacher_hidden`'s output -> the teacher's sparse targets (top-k at the KD positions),
    in the padded rows' coordinates either way."""
    _, kd_rows_t = kd_positions(_to(tb.chunks, device))
    labels = _to(tb.labels, device).flatten()
    if rows is not None:  # to the positions among the non-pad tokens
        where = torch.full_like(labels, -1).index_copy_(
            0, rows, torch.arange(rows.numel(), device=device)
        )
        kd_rows_t = torch.where(kd_rows_t >= 0, where[kd_rows_t.clamp(min=0)], -1)
    targets = teacher_targets(
        hidden,
        slot.teacher.lm_head_weight,
        kd_rows_t,
        labels if rows is None else labels.index_select(0, rows),
        top_k=min(slot.cfg.top_k, slot.teacher.lm_head_weight.shape[0]),
        temperature=slot.cfg.temperature,
        chunk_size=chunk_size,
    )
    if rows is not None:  # next-token results back over the padded rows
        n = labels.numel()
        targets.next_logprobs = targets.next_logprobs.new_zeros(n).index_copy_(
            0, rows, targets.next_logprobs
        )
        targets.next_valid = labels >= 0
    return targets


def run_teacher(slot: TeacherSlot, tb, chunk_size: int, device: torch.device) -> TeacherTargets:
    """Teacher forward on one micro-batch -> its sparse targets (top-k at KD positions)."""
    hidden, rows = teacher_hidden(slot, tb, device)
    return targets_from_hidden(slot, tb, hidden, rows, chunk_size, device)


def target_bytes(tb, device: torch.device) -> Tensor:
    """Σ bytes of the text the teacher's valid next tokens cover: the denominator of its bits
    per byte, the same text bytes as the student's over the same text (see `TeacherBatch`)."""
    return _to(tb.target_bytes, device).sum()


def make_term(slot: TeacherSlot, tb, targets: TeacherTargets, device) -> KDTerm:
    params = {"beta": slot.cfg.beta, "alpha": slot.cfg.alpha}
    return KDTerm(
        targets=targets,
        projection=slot.projection,
        chunks=_to(tb.chunks, device),
        denominator=torch.zeros((), device=device),
        loss=slot.cfg.loss,
        weight=slot.cfg.weight,
        params=params,
        chunk_mask=_to(tb.kd_valid, device),
        name=slot.cfg.name,
    )


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


class Placement(Protocol):
    """Where the step's pieces run and what is summed across ranks. `SingleProcess` is the plain
    one; `crossdistill.distributed.runtime.Parallel` lays them out over a `torchrun` job."""

    def teacher_targets(
        self, slot: TeacherSlot, k: int, tb: Any, chunk_size: int
    ) -> TeacherTargets:
        """Teacher `k`'s targets for this rank's micro-batch `tb`."""
        ...

    def student_hidden(self, student: nn.Module, sb: Any) -> tuple[Tensor, Any]:
        """`[N, H]` final hidden states of the rows this rank holds, and the row sharding to pass
        to `student_loss` (None: all rows)."""
        ...

    def lm_head(self, student: nn.Module) -> tuple[Tensor, Any]:
        """The lm_head weight this rank holds (`[V_s, H]` or a vocabulary shard) and the vocab
        sharding to pass to `student_loss` (None: the whole vocabulary)."""
        ...

    def reduce_counts(self, x: Tensor) -> Tensor:
        """Sum per-micro-batch counts over the data-parallel ranks."""
        ...

    def reduce_metrics(self, metrics: dict[str, Tensor]) -> dict[str, Tensor]:
        """Sum the student's partial loss sums over every rank that holds a part of the loss."""
        ...

    def reduce_sums(self, x: Tensor) -> Tensor:
        """The same for a stacked vector of such sums."""
        ...


class SingleProcess:
    """Everything on one device; `reduce` sums counts over data-parallel ranks if any."""

    def __init__(self, device: torch.device, reduce: Callable[[Tensor], Tensor] = lambda t: t):
        self.device = device
        self.reduce = reduce

    def teacher_targets(
        self, slot: TeacherSlot, k: int, tb: Any, chunk_size: int
    ) -> TeacherTargets:
        return run_teacher(slot, tb, chunk_size, self.device)

    def student_hidden(self, student: nn.Module, sb: Any) -> tuple[Tensor, None]:
        hidden = final_hidden(
            student,
            _to(sb.input_ids, self.device),
            _to(sb.position_ids, self.device),
            segments_of(sb, self.device),
        )
        return hidden.flatten(0, 1), None

    def lm_head(self, student: nn.Module) -> tuple[Tensor, None]:
        return student.get_output_embeddings().weight, None

    def reduce_counts(self, x: Tensor) -> Tensor:
        return self.reduce(x)

    def reduce_metrics(self, metrics: dict[str, Tensor]) -> dict[str, Tensor]:
        return metrics

    def reduce_sums(self, x: Tensor) -> Tensor:
        return x


def shard_kwargs(rows: Any, vocab: Any) -> dict[str, Any]:
    """`student_loss` keyword arguments for a sharded student (none for a single process)."""
    out = {}
    if rows is not None:
        out["rows"] = rows
    if vocab is not None:
        out["vocab"] = vocab
    return out


def train_step(
    student: nn.Module,
    slots: list[TeacherSlot],
    micro_batches: list,
    settings: StepSettings,
    reduce: Callable[[Tensor], Tensor] = lambda t: t,
    placement: Placement | None = None,
) -> dict[str, Tensor]:
    """Forward and backward over one window; returns detached metrics (no host sync here).
    Gradients are accumulated in `student`; the caller clips and steps. `placement`: how the
    pieces are laid out over ranks (default: one process, counts summed by `reduce`)."""
    dev = settings.device
    place = placement if placement is not None else SingleProcess(dev, reduce)
    for s in slots:
        if s.teacher.offload:
            s.teacher.to(dev)
    targets = [
        [
            place.teacher_targets(s, k, mb.teachers[k], settings.loss_chunk_size)
            for k, s in enumerate(slots)
        ]
        for mb in micro_batches
    ]
    terms = [
        [make_term(s, mb.teachers[k], targets[i][k], dev) for k, s in enumerate(slots)]
        for i, mb in enumerate(micro_batches)
    ]

    labels = [_to(mb.student.labels, dev).flatten() for mb in micro_batches]
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
    for s in slots:
        if s.teacher.offload:
            s.teacher.to("cpu")

    total: dict[str, Tensor] = {}
    for i, mb in enumerate(micro_batches):
        for k, term in enumerate(terms[i]):
            term.denominator = kd_dens[k]
            term.weight = weights[k]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=settings.autocast):
            hidden, rows = place.student_hidden(student, mb.student)
        lm_head, vocab = place.lm_head(student)  # after the forward: FSDP has gathered it
        # under autocast too: the lm_head matmuls run in bf16 (fp32 master weight cast once
        # per chunk pass), with fp32 softmax and accumulation inside the loss
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=settings.autocast):
            loss, metrics = student_loss(
                hidden,
                lm_head,
                labels[i],
                terms[i],
                kd_ratio=settings.kd_ratio if slots else 0.0,
                ce_denominator=ce_den,
                chunk_size=settings.loss_chunk_size,
                **shard_kwargs(rows, vocab),
                unit_upstream=True,  # backpropagated as is, right below
            )
        loss.backward()
        for name, value in metrics.items():
            total[name] = total.get(name, 0) + value.detach()
    total = place.reduce_metrics(total)
    for k, s in enumerate(slots):
        total[f"teacher_bpb/{s.cfg.name}"] = npb[k] / LN2
        w = weights[k]  # a float (static weights) is filled in place: a copy would synchronize
        total[f"weight/{s.cfg.name}"] = (
            w if isinstance(w, Tensor) else torch.full((), w, device=dev)
        )
    total["num_ce_tokens"] = ce_den
    return total

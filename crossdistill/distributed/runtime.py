"""Where the training step's pieces run and what is summed across ranks: one `Placement` for
every layout. A single process is its one-rank case: every mesh is None, every reduction the
identity, and the same code runs (as torchtitan runs world size 1 through its parallel path).

Each model has its own layout (`Placed`). The data a rank reads is decided by the student's
data-parallel coordinate. A teacher whose tensor/context-parallel group spans ranks that read
different data first gathers those ranks' teacher inputs (a few int64 tensors), runs once on all
of them together, and each rank keeps the targets of its own micro-batch: top-k targets, never
logits, are what crosses layouts, and only inputs travel.

The teacher forward (`Placement.teacher_targets`) is the one place a teacher runs, for training,
validation and whatever else needs its targets. A cross teacher's body runs on its non-pad
tokens only (`[1, N]` instead of the padded `[B, T_t]`) wherever flash varlen attention covers
every layer and the rows are this rank's own (no context-parallel split, no rows gathered from
other ranks): there the rows need no shape of their own, and the padding's share of the
teacher's FLOPs is saved (cross teachers pad every row to the longest, rounded up).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.profiler import record_function

from crossdistill.config import TeacherConfig
from crossdistill.distributed import cp as cpmod
from crossdistill.distributed.grads import clip_grad_norm_
from crossdistill.distributed.layout import DistEnv, ParallelLayout
from crossdistill.distributed.parallelize import model_hidden
from crossdistill.distributed.share import share_window_targets
from crossdistill.distributed.streams import TargetStream
from crossdistill.distributed.vocab import local_vocab
from crossdistill.losses import (
    KDTerm,
    TeacherTargets,
    VocabProjection,
    chunk_tokens,
    reads_past_end,
    target_depth,
    target_kind,
    target_rows,
    teacher_targets,
)
from crossdistill.losses.boundaries import tokens_before
from crossdistill.losses.sharding import RowShard
from crossdistill.models.attention import flash_covers, segments_of
from crossdistill.models.teacher import Teacher

LN2 = math.log(2.0)
# Whether a cross teacher's body runs on its non-pad tokens: "auto" where flash varlen attention
# covers every layer (the masked fallback would cost N² instead of B·T_t²), "drop" always,
# "keep" never (the padded rows, as a comparison).
TeacherPadding = Literal["auto", "drop", "keep"]

_MESHES: dict[tuple[int, ...], Any] = {}

# `torch.profiler` ranges of a teacher laid out over several data ranks: its inputs gathered
# from them, and this rank's part taken from the targets of all
EXCHANGE_INPUTS = "crossdistill/teacher_inputs_exchange"
EXCHANGE_TARGETS = "crossdistill/teacher_targets_exchange"


@dataclass
class TeacherSlot:
    """A teacher with everything the step needs about it; `teacher` is None for one whose
    targets the loader reads from a cache (`Batch.cached`) or that runs on ranks of its own
    (`stream`: its targets arrive from there)."""

    teacher: Teacher | None
    cfg: TeacherConfig
    projection: VocabProjection | None
    stream: TargetStream | None = None


def mesh_for(layout: ParallelLayout, device_type: str) -> Any:
    """One mesh per distinct layout shape (models with equal layouts share process groups);
    None for one rank."""
    if layout.world_size == 1:
        return None
    key = layout.shape
    if key not in _MESHES:
        _MESHES[key] = layout.build_mesh(device_type)
    return _MESHES[key]


@dataclass
class Placed:
    """One model's layout, its mesh, and the coordinates of this rank in it."""

    layout: ParallelLayout
    mesh: Any

    def rank(self, axis: str) -> int:
        return 0 if self.mesh is None else self.mesh[axis].get_local_rank()

    def group(self, axis: str) -> Any:
        return None if self.mesh is None else self.mesh[axis].get_group()


def _to(x: Tensor, device: torch.device) -> Tensor:
    return x.to(device, non_blocking=True)


class Placement:
    """The step laid out over the job's ranks (see module doc). `teachers[k]` is None for a
    teacher that does not run in this process (a cached one, or a separate teacher on the
    student's ranks); a separate teacher's own processes have no student (`student` None) and
    read the data of their data-parallel coordinate in the teacher's layout."""

    def __init__(
        self,
        env: DistEnv,
        student: Placed | None,
        teachers: list[Placed | None],
        teacher_padding: TeacherPadding = "auto",
    ):
        self.env = env
        self.student = student
        self.teachers = teachers
        self.device = env.device
        self.teacher_padding = teacher_padding
        self.pipeline: Any = None  # the student's `StudentPipeline` where it has stages
        reader = student or next(t for t in teachers if t is not None)
        self.data_rank = reader.rank("dp")
        self.data_size = reader.layout.dp
        # which micro-batches this rank's teachers run: a data rank's pipeline stages run
        # different ones (`StudentPipeline.spread_targets`)
        pp = student.layout.pp if student is not None else 1
        self.teacher_reads = self.data_rank * pp + (student.rank("pp") if pp > 1 else 0)
        self.sources = [None if t is None else self._sources(t) for t in teachers]
        # the student's ranks that read the same batch (its tensor- and context-parallel
        # ranks): a teacher that runs whole on each of them shares its work among them
        self.batch_group: tuple[Any, int, int] | None = None
        if student is not None and student.mesh is not None:
            size = student.layout.cp * student.layout.tp
            if size > 1:
                self.batch_group = (student.group("cp_tp"), student.rank("cp_tp"), size)

    # ------------------------------------------------------------------ teachers

    def _sources(self, placed: Placed) -> tuple[Any, list[int]]:
        """The teacher's input group (ranks that run one forward together) and, per rank of it,
        the first group rank that reads the same data as that rank."""
        if placed.mesh is None or placed.layout.cp * placed.layout.tp == 1:
            return None, [0]
        group = placed.mesh["cp_tp"].get_group()
        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, self.teacher_reads, group=group)
        first = {r: ranks.index(r) for r in ranks}
        return group, [first[r] for r in ranks]

    def window_targets(
        self,
        slots: list[TeacherSlot],
        batches: list[list[Any]],
        compute: Callable[[int, int], TeacherTargets],
    ) -> list[list[TeacherTargets]] | None:
        """Every teacher's targets of every micro-batch, `[micro-batch][teacher]`, where the loss
        runs. `batches[i]`: micro-batch i's teacher batches; `compute(i, k)`: teacher k's targets
        of micro-batch i (`teacher_targets`). The tensor- and context-parallel ranks of a data
        rank share the work of the teachers that run whole on each of them (`share.py`).
        Pipeline stages share the work of the teachers that run on them, and only the last stage
        reads the targets of those that do not (cached, or streamed from a separate teacher's
        ranks): None on the stages before it."""
        whole = [  # runs whole on this rank, on the batch the group's other ranks read too
            s.teacher is not None and s.stream is None and self.sources[k][0] is None
            for k, s in enumerate(slots)
        ]
        if self.pipeline is None:
            if self.batch_group is None:
                return [[compute(i, k) for k in range(len(slots))] for i in range(len(batches))]
            return share_window_targets(batches, whole, compute, *self.batch_group)
        live = [s.teacher is not None for s in slots]
        return self.pipeline.spread_targets(batches, live, compute, self.batch_group, whole)

    @torch.no_grad()
    def teacher_targets(
        self,
        slot: TeacherSlot,
        k: int,
        tb: Any,
        chunk_size: int,
        fused: bool | None = None,
        cached: Any = None,
    ) -> TeacherTargets | None:
        """Teacher `k`'s targets (top-k at the KD positions, next-token log-probs everywhere)
        for this rank's micro-batch `tb`, in `tb`'s padded coordinates. `fused`: as for
        `losses.teacher_targets`; `cached`: the targets the loader read from the teacher's
        cache (`data.batch.CachedTargets`), used as they are. None on a teacher pipeline's
        stages before the last (a separate teacher's, which its last stage sends)."""
        if slot.stream is not None:
            return slot.stream.receive(tb)
        if slot.teacher is None:
            if cached is None:
                raise ValueError(f"teacher {slot.cfg.name} reads a cache but the batch has none")
            return TeacherTargets(
                **{f: getattr(cached, f).to(self.device, non_blocking=True) for f in _FIELDS},
                temperature=cached.temperature,
                depth=target_depth(slot.cfg.target, tb.same_as_student),
            )
        group, owners = self.sources[k]
        ids, pos = _to(tb.input_ids, self.device), _to(tb.position_ids, self.device)
        labels = _to(tb.labels, self.device).flatten()
        depth = target_depth(slot.cfg.target, tb.same_as_student)
        past_end = reads_past_end(slot.cfg.target, tb.same_as_student)
        kd_rows = target_rows(_to(tb.chunks, self.device), depth, past_end)
        if len(set(owners)) > 1:  # the teacher's group reads several ranks' data: run them all
            with record_function(EXCHANGE_INPUTS):
                joint = _gather_inputs(ids, pos, labels.view(ids.shape), kd_rows, group, owners)
            hidden = self._hidden(slot, joint.ids, joint.pos, None)
            targets = self._targets(
                slot, k, hidden, joint.kd_rows, joint.labels.flatten(), chunk_size, fused, depth
            )
            with record_function(EXCHANGE_TARGETS):
                return joint.mine(targets, ids.shape)
        rows = self._real_rows(slot, tb)
        if rows is None:
            hidden = self._hidden(slot, ids, pos, segments_of(tb, self.device))
            if hidden is None:
                return None  # a teacher pipeline's earlier stage: the last computes them
            return self._targets(slot, k, hidden, kd_rows, labels, chunk_size, fused, depth)
        # the non-pad tokens only: `[1, N]`, their segments from the collator
        segments = (_to(tb.real_cu_seqlens, self.device), tb.real_max_seqlen)
        flat = [x.view(1, -1).index_select(1, rows) for x in (ids, pos)]
        hidden = self._hidden(slot, *flat, segments)
        if hidden is None:
            return None
        where = torch.full_like(labels, -1).index_copy_(
            0, rows, torch.arange(rows.numel(), device=self.device)
        )  # padded position -> position among the non-pad tokens
        kd_real = torch.where(kd_rows >= 0, where[kd_rows.clamp(min=0)], -1)
        targets = self._targets(
            slot, k, hidden, kd_real, labels.index_select(0, rows), chunk_size, fused, depth
        )
        # next-token results back over the padded rows
        targets.next_logprobs = targets.next_logprobs.new_zeros(labels.numel()).index_copy_(
            0, rows, targets.next_logprobs
        )
        targets.next_valid = labels >= 0
        return targets

    def _real_rows(self, slot: TeacherSlot, tb: Any) -> Tensor | None:
        """The flat positions of `tb`'s non-pad tokens on the device where the teacher's body
        runs on them alone (see module doc), else None."""
        index = getattr(tb, "real_index", None)
        if self.teacher_padding == "keep" or index is None or tb.real_max_seqlen == 0:
            return None
        if getattr(slot.teacher.model, "cp_state", None) is not None:
            return None  # context parallelism splits the padded rows
        if self.teacher_padding == "auto" and not flash_covers(
            slot.teacher.model, self.device, tb.real_max_seqlen
        ):
            return None
        return _to(index, self.device)

    def _hidden(self, slot: TeacherSlot, ids: Tensor, pos: Tensor, segments) -> Tensor | None:
        """`[rows, H_t]` final hidden states of a teacher (rows of the given `[B, T]` inputs,
        flattened); under context parallelism the sequence is split over the group and the
        hidden states gathered back. A teacher in pipeline stages (`teacher_pipeline.py`) runs
        this rank's stage: None before the last."""
        model = slot.teacher.model
        stages = getattr(model, "teacher_stages", None)
        if stages is not None:
            return stages.hidden(ids, pos, segments)
        state = getattr(model, "cp_state", None)
        if state is not None:
            local_pos = state.begin(pos)
            hidden = model_hidden(model, cpmod.shard_rows(ids, state.size, state.rank), local_pos)
            return cpmod.gather_hidden(hidden, state).flatten(0, 1)
        return model_hidden(model, ids, pos, segments).flatten(0, 1)

    def _targets(
        self,
        slot: TeacherSlot,
        k: int,
        hidden: Tensor,
        kd_rows: Tensor,
        labels: Tensor,
        chunk_size: int,
        fused: bool | None,
        depth: int,
    ) -> TeacherTargets:
        weight, vocab = local_vocab(slot.teacher.lm_head_weight, self.teachers[k].group("tp"))
        out = teacher_targets(
            hidden,
            weight,
            kd_rows,
            labels,
            top_k=min(slot.cfg.top_k, weight.shape[0] if vocab is None else vocab.total),
            temperature=slot.cfg.temperature,
            chunk_size=chunk_size,
            fused=fused,
            **({} if vocab is None else {"vocab": vocab}),
        )
        out.depth = depth
        model = slot.teacher.model
        if hasattr(model, "reshard"):
            model.reshard()  # a frozen model keeps nothing gathered between steps
        return out

    # ------------------------------------------------------------------ student

    def student_hidden(self, student: nn.Module, sb: Any) -> tuple[Tensor, RowShard | None]:
        """`[N, H]` final hidden states of the rows this rank holds, and the row sharding to pass
        to `student_loss` (None: all rows)."""
        ids, pos = _to(sb.input_ids, self.device), _to(sb.position_ids, self.device)
        state = getattr(student, "cp_state", None)
        if state is None:
            segments = segments_of(sb, self.device)
            return model_hidden(student, ids, pos, segments).flatten(0, 1), None
        batch, length = ids.shape
        local_pos = state.begin(pos)
        hidden = model_hidden(student, cpmod.shard_rows(ids, state.size, state.rank), local_pos)
        rows = cpmod.global_rows(batch, length, state.size, state.rank, ids.device)
        return hidden.flatten(0, 1), RowShard(rows, batch * length, _summer(state.group))

    def lm_head(self, student: nn.Module) -> tuple[Tensor, Any]:
        """The lm_head weight this rank holds (`[V_s, H]` or a vocabulary shard) and the vocab
        sharding to pass to `student_loss` (None: the whole vocabulary)."""
        return local_vocab(student.get_output_embeddings().weight, self.student.group("tp"))

    def clip_grads(self, student: nn.Module, max_norm: float) -> Tensor:
        """Clip the student's gradients to a global 2-norm of `max_norm` (every rank the same
        norm, whatever the layout); returns the norm before clipping. Pipeline stages first add
        the gradients of a tied embedding, and sum their squares over the stages."""
        pipe = self.pipeline
        if pipe is None:
            return clip_grad_norm_(student.parameters(), max_norm)
        pipe.sync_tied_grads()
        return clip_grad_norm_(
            student.parameters(), max_norm, counted=pipe.norm_parameters(), across=pipe.group
        )

    def target_wait(self, slots: list[TeacherSlot]) -> float | None:
        """Seconds this data rank has waited for separate teachers' targets (None without
        any): a pipeline's last stage waits for them, the stages before it add zeros."""
        waited = target_wait(slots)
        if waited is None or self.pipeline is None:
            return waited
        total = torch.tensor([waited], dtype=torch.float64, device=self.device)
        return float(self.pipeline.sum_over_stages(total)[0])

    # ------------------------------------------------------------------ reductions

    def reduce_counts(self, x: Tensor) -> Tensor:
        """Counts of whole micro-batches: summed over data-parallel ranks only (tensor- and
        context-parallel ranks of one data rank hold the same micro-batch)."""
        group = self.student.group("dp")
        if group is not None and self.data_size > 1:
            dist.all_reduce(x, group=group)
        return x

    def reduce_metrics(self, metrics: dict[str, Tensor]) -> dict[str, Tensor]:
        """Partial loss sums (`student_loss` metrics) summed over data- and context-parallel
        ranks, in one collective."""
        layout = self.student.layout
        if layout.dp * layout.cp == 1 or not metrics:
            return metrics
        keys = sorted(metrics)
        flat = torch.stack([torch.as_tensor(metrics[k], device=self.device).double() for k in keys])
        dist.all_reduce(flat, group=self.student.group("loss"))
        return {k: flat[i] for i, k in enumerate(keys)}

    def reduce_sums(self, x: Tensor) -> Tensor:
        """Validation sums: over data- and context-parallel ranks."""
        if self.student.layout.dp * self.student.layout.cp > 1:
            dist.all_reduce(x, group=self.student.group("loss"))
        return x


_FIELDS = ("topk_ids", "topk_logprobs", "tail_logprob", "next_logprobs", "next_valid")


def target_wait(slots: list[TeacherSlot]) -> float | None:
    """Seconds this process has waited for separate teachers' targets (None without any)."""
    waits = [s.stream.wait_s for s in slots if s.stream is not None]
    return sum(waits) if waits else None


def cached_of(batch: Any, k: int) -> Any:
    """Teacher `k`'s cached targets in `batch` (None when it runs live)."""
    cached = getattr(batch, "cached", None)
    return cached[k] if cached else None


def shard_kwargs(rows: Any, vocab: Any) -> dict[str, Any]:
    """`student_loss` keyword arguments for a sharded student (none for a whole one)."""
    out = {}
    if rows is not None:
        out["rows"] = rows
    if vocab is not None:
        out["vocab"] = vocab
    return out


def make_term(slot: TeacherSlot, tb: Any, targets: TeacherTargets, device, ids_s: Tensor) -> KDTerm:
    """Teacher `slot`'s KD term on micro-batch `tb`, whose student inputs are `ids_s` (its
    denominator and weight are set by the caller, from the whole global batch)."""
    params = {"beta": slot.cfg.beta, "alpha": slot.cfg.alpha}
    first_t = ahead = before = None
    kind = target_kind(slot.cfg.target)
    chunks = _to(tb.chunks, device)
    flat_t = _to(tb.input_ids, device).view(-1)
    if kind.context and not tb.same_as_student:
        first_t = flat_t[chunks[:, 2]]
    depth = target_depth(slot.cfg.target, tb.same_as_student)
    if depth > 1:
        ahead = chunk_tokens(flat_t, chunks, depth)
    groups = slot.projection.groups
    pairs = groups is not None and groups.pair_keys is not None
    if (slot.projection.boundaries is not None or pairs) and not tb.same_as_student:
        before = tokens_before(chunks, _to(ids_s, device).view(-1), flat_t)
    return KDTerm(
        targets=targets,
        projection=slot.projection,
        chunks=chunks,
        denominator=torch.zeros((), device=device),
        loss=slot.cfg.loss,
        weight=slot.cfg.weight,
        params=params,
        chunk_mask=kd_chunk_mask(slot.cfg.kd_chunks, _to(tb.kd_valid, device), chunks),
        name=slot.cfg.name,
        first_t=first_t,
        lookahead=ahead,
        past_end=reads_past_end(slot.cfg.target, tb.same_as_student),
        longer_only=kind.longer_only,
        mix=kind.mix,
        before=before,
    )


def kd_chunk_mask(kd_chunks: str, kd_valid: Tensor, chunks: Tensor) -> Tensor:
    """`[C]` the chunks that get a KD term (`TeacherConfig.kd_chunks`): the batch's KD
    positions, less the chunks of several tokens on both sides under "single_side"."""
    if kd_chunks == "all":
        return kd_valid
    s0, s1, t0, t1 = chunks.unbind(-1)
    return kd_valid & ((s1 - s0 == 1) | (t1 - t0 == 1))


def target_bytes(tb: Any, device: torch.device) -> Tensor:
    """Σ bytes of the text the teacher's valid next tokens cover: the denominator of its bits
    per byte, the same text bytes as the student's over the same text (see `TeacherBatch`)."""
    return _to(tb.target_bytes, device).sum()


def _summer(group: Any):
    def all_reduce_sum(x: Tensor) -> Tensor:
        dist.all_reduce(x, group=group)
        return x

    return all_reduce_sum


@dataclass
class _Joint:
    """Teacher inputs of several data ranks stacked along the batch (padded to one length)."""

    ids: Tensor
    pos: Tensor
    labels: Tensor
    kd_rows: Tensor
    batch_start: int  # this rank's first row in the stacked batch
    kd_start: int  # this rank's first KD position in the stacked list
    num_kd: int

    def mine(self, t: TeacherTargets, shape: torch.Size) -> TeacherTargets:
        """This rank's part of targets computed on the stacked batch."""
        batch, length = shape
        kd = slice(self.kd_start, self.kd_start + self.num_kd)
        width = self.ids.shape[1]

        def rows(x: Tensor) -> Tensor:
            return x.view(-1, width)[self.batch_start : self.batch_start + batch, :length].flatten()

        return TeacherTargets(
            topk_ids=t.topk_ids[kd],
            topk_logprobs=t.topk_logprobs[kd],
            tail_logprob=t.tail_logprob[kd],
            next_logprobs=rows(t.next_logprobs),
            next_valid=rows(t.next_valid),
            temperature=t.temperature,
            depth=t.depth,
        )


def _gather_inputs(ids, pos, labels, kd_rows, group, owners: list[int]) -> _Joint:
    """Stack the teacher inputs of the distinct data ranks of `group` (`owners[i]`: the first
    group rank reading rank i's data). KD rows are re-based to the stacked layout."""
    me = dist.get_rank(group)
    size = torch.tensor([ids.shape[0], ids.shape[1], kd_rows.shape[0]], device=ids.device)
    sizes = _all_gather(size, group).tolist()  # the host needs them to pad: one sync
    width, most_kd = max(s[1] for s in sizes), max(s[2] for s in sizes)
    pad = width - ids.shape[1]
    padded = torch.stack(
        [
            torch.nn.functional.pad(ids, (0, pad)),
            torch.nn.functional.pad(pos, (0, pad)),
            torch.nn.functional.pad(labels, (0, pad), value=-100),
        ]
    )
    all_in = _all_gather(padded, group)  # [R, 3, B, W]
    all_kd = _all_gather(
        torch.nn.functional.pad(kd_rows, (0, most_kd - kd_rows.shape[0]), value=-1), group
    )
    keep = sorted(set(owners))
    parts, kds, b0, m0 = [], [], 0, 0
    start_b = start_m = 0
    for r in keep:
        b, length, m = sizes[r]
        rows = all_kd[r, :m]
        rebased = torch.where(rows >= 0, (rows // length + b0) * width + rows % length, -1)
        if r == owners[me]:
            start_b, start_m = b0, m0
        parts.append(all_in[r, :, :b])
        kds.append(rebased)
        b0, m0 = b0 + b, m0 + m
    joint = torch.cat(parts, dim=1)
    return _Joint(joint[0], joint[1], joint[2], torch.cat(kds), start_b, start_m, kd_rows.shape[0])


def _all_gather(x: Tensor, group: Any) -> Tensor:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return torch.stack(out)

"""The training step laid out over a `torchrun` job (the `Placement` of `train/step.py`).

Each model has its own layout (`Placed`). The data a rank reads is decided by the student's
data-parallel coordinate. A teacher whose tensor/context-parallel group spans ranks that read
different data first gathers those ranks' teacher inputs (a few int64 tensors), runs once on all
of them together, and each rank keeps the targets of its own micro-batch: top-k targets, never
logits, are what crosses layouts, and only inputs travel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from crossdistill.distributed import cp as cpmod
from crossdistill.distributed.layout import DistEnv, ParallelLayout
from crossdistill.distributed.parallelize import model_hidden
from crossdistill.distributed.vocab import local_vocab
from crossdistill.losses import TeacherTargets, kd_positions, teacher_targets
from crossdistill.losses.sharding import RowShard
from crossdistill.models.attention import segments_of

_MESHES: dict[tuple[int, ...], Any] = {}


def mesh_for(layout: ParallelLayout, device_type: str) -> Any:
    """One mesh per distinct layout shape (models with equal layouts share process groups)."""
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


class Parallel:
    """`Placement` for a job of several processes (see module doc)."""

    def __init__(self, env: DistEnv, student: Placed, teachers: list[Placed]):
        self.env = env
        self.student = student
        self.teachers = teachers
        self.device = env.device
        self.data_rank = student.rank("dp")
        self.data_size = student.layout.dp
        self.sources = [self._sources(t) for t in teachers]

    # ------------------------------------------------------------------ teachers

    def _sources(self, placed: Placed) -> tuple[Any, list[int]]:
        """The teacher's input group (ranks that run one forward together) and, per rank of it,
        the first group rank that reads the same data as that rank."""
        if placed.mesh is None or placed.layout.cp * placed.layout.tp == 1:
            return None, [0]
        group = placed.mesh["cp_tp"].get_group()
        ranks = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, self.data_rank, group=group)
        first = {r: ranks.index(r) for r in ranks}
        return group, [first[r] for r in ranks]

    def teacher_targets(self, slot: Any, k: int, tb: Any, chunk_size: int) -> TeacherTargets:
        group, owners = self.sources[k]
        ids, pos = tb.input_ids.to(self.device), tb.position_ids.to(self.device)
        labels = tb.labels.to(self.device)
        _, kd_rows = kd_positions(tb.chunks.to(self.device))
        if len(set(owners)) == 1:
            segments = segments_of(tb, self.device)
            return self._run_teacher(
                slot, k, ids, pos, labels.flatten(), kd_rows, chunk_size, segments
            )
        joint = _gather_inputs(ids, pos, labels, kd_rows, group, owners)
        targets = self._run_teacher(
            slot, k, joint.ids, joint.pos, joint.labels.flatten(), joint.kd_rows, chunk_size
        )
        return joint.mine(targets, ids.shape)

    @torch.no_grad()
    def _run_teacher(
        self, slot, k, ids, pos, labels, kd_rows, chunk_size, segments=None
    ) -> TeacherTargets:
        """`segments`: the rows' attention segments when they are this rank's own batch (rows
        gathered from several ranks derive theirs from the positions)."""
        placed = self.teachers[k]
        model = slot.teacher.model
        state = getattr(model, "cp_state", None)
        if state is not None:
            local_pos = state.begin(pos)
            hidden = model_hidden(model, cpmod.shard_rows(ids, state.size, state.rank), local_pos)
            hidden = cpmod.gather_hidden(hidden, state)
        else:
            hidden = model_hidden(model, ids, pos, segments)
        weight, vocab = local_vocab(slot.teacher.lm_head_weight, placed.group("tp"))
        out = teacher_targets(
            hidden.flatten(0, 1),
            weight,
            kd_rows,
            labels,
            top_k=min(slot.cfg.top_k, weight.shape[0] if vocab is None else vocab.total),
            temperature=slot.cfg.temperature,
            chunk_size=chunk_size,
            **({} if vocab is None else {"vocab": vocab}),
        )
        if hasattr(model, "reshard"):
            model.reshard()  # a frozen model keeps nothing gathered between steps
        return out

    # ------------------------------------------------------------------ student

    def student_hidden(self, student: nn.Module, sb: Any) -> tuple[Tensor, RowShard | None]:
        ids, pos = sb.input_ids.to(self.device), sb.position_ids.to(self.device)
        state = getattr(student, "cp_state", None)
        if state is None:
            segments = segments_of(sb, self.device)
            return model_hidden(student, ids, pos, segments).flatten(0, 1), None
        batch, length = ids.shape
        local_pos = state.begin(pos)
        hidden = model_hidden(student, cpmod.shard_rows(ids, state.size, state.rank), local_pos)
        rows = cpmod.global_rows(batch, length, state.size, state.rank, ids.device)
        group = state.group
        return hidden.flatten(0, 1), RowShard(rows, batch * length, _summer(group))

    def lm_head(self, student: nn.Module) -> tuple[Tensor, Any]:
        return local_vocab(student.get_output_embeddings().weight, self.student.group("tp"))

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
        )


def _gather_inputs(ids, pos, labels, kd_rows, group, owners: list[int]) -> _Joint:
    """Stack the teacher inputs of the distinct data ranks of `group` (`owners[i]`: the first
    group rank reading rank i's data). KD rows are re-based to the stacked layout."""
    me = dist.get_rank(group)
    size = torch.tensor([ids.shape[0], ids.shape[1], kd_rows.shape[0]], device=ids.device)
    sizes = _all_gather(size, group)
    width, most_kd = int(sizes[:, 1].max()), int(sizes[:, 2].max())
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
        b, length, m = (int(v) for v in sizes[r])
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

"""Pipeline-parallel student: its blocks split into `student.parallel.pp` x
`pp_stages_per_rank` stages over the `pp` ranks of the mesh's outermost `pp` axis, run by a
`torch.distributed.pipelining` schedule over the step's micro-batches: 1F1B or GPipe with one
stage per rank, or Interleaved1F1B with several ("virtual stages": rank r holds stages r,
r + pp, r + 2·pp, ..., so the hidden states go round the ranks once per stage a rank holds,
and the pipeline idles less).

- A rank keeps the blocks of its stages under their original names, the first rank also the
  embedding, the last the final norm and the lm_head (`distributed/stages.py`: `keep_stages`
  cuts the model at load). Each of the rank's stages runs the model's own forward with only its
  blocks (`StudentStage`).
- Tied embeddings: the last rank keeps the embedding as its lm_head weight (same name, same
  initial value). After the backward the first and last ranks add their gradients of it
  (`sync_tied_grads`), so the two copies see the same gradient and the same update; the
  gradient norm counts it once (`norm_parameters`).
- Micro-batch identity: the schedule splits a tensor of micro-batch indices along with the
  inputs, and every stage and the loss look their micro-batch's positions, segments, labels and
  teacher targets up by that index; targets of micro-batch i meet the logits of micro-batch i by
  construction, whatever order the schedule runs them in.
- Teachers: when the step's micro-batches divide evenly among the ranks, rank r computes
  the targets of micro-batches r, r + pp, r + 2·pp, ... (a teacher laid out across ranks runs
  them together, as it runs several data ranks' batches) and sends them to the last rank in
  the payload format of separate teachers (`losses/payload.py`): each rank does 1/pp of the
  teacher work. Otherwise every rank computes them all and the last rank keeps its own.
  Targets that do not come from a teacher on these ranks (a teacher cache's, or a separate
  teacher's, `teachers.N.placement: separate`, which streams them to the last stage's ranks
  alone: `distributed/streams.py`) are read by the last rank only; the others neither wait for
  nor receive them, in training and in validation (pipelines with separate teachers are no
  longer refused at load).
- The loss runs in the last stage, divided by the global batch's counts as in every layout, so
  the schedule must not scale gradients (`scale_grads=False`). Metrics are summed over the
  pipeline group (the other ranks add zeros), so every rank holds them.
- Context parallelism: each stage's ranks are a context-parallel group (`distributed/cp.py`).
  Every rank of a stage takes its own rows of each micro-batch (`shard_rows`), its attention
  gathers the keys and values of the group, and the hidden states it hands on are its own rows
  (`[B, T/cp, H]`): a pipeline group is the stages of one context-parallel rank. The last
  stage's loss takes that rank's rows of the labels and targets (`row_shard`; the targets of a
  micro-batch come whole, as without context parallelism) over the global batch's counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from crossdistill.distributed import cp as cpmod
from crossdistill.distributed.parallelize import model_hidden
from crossdistill.distributed.share import share_window_targets
from crossdistill.errors import UserError
from crossdistill.losses.payload import pack_targets, receive_like
from crossdistill.losses.sharding import RowShard
from crossdistill.losses.targets import TeacherTargets
from crossdistill.models.attention import segments_of
from crossdistill.models.forward import decoder_of

# the last rank's loss of micro-batch i from its final hidden states and their rows
LossOf = Callable[[int, Tensor, RowShard | None], Tensor]


def check_micro_batches(n: int, pp: int, schedule: str) -> None:
    """Refuse `n` micro-batches per step on each data rank where the schedule cannot run them:
    every schedule needs one per pipeline rank at least; Interleaved1F1B runs them in `n // pp`
    rounds of equal size (torch's `ScheduleInterleaved1F1B`)."""
    if n < pp:
        raise UserError(
            f"student.parallel.pp = {pp} pipeline ranks need at least {pp} micro-batches per "
            f"step on each data rank, but train.grad_accum = {n}; raise train.grad_accum to "
            f">= {pp} (a multiple of pp keeps every rank busy)"
        )
    rounds = n // pp
    if schedule == "Interleaved1F1B" and n % rounds:
        raise UserError(
            f"student.parallel.pp_schedule = Interleaved1F1B runs the micro-batches of a step in "
            f"train.grad_accum // pp = {n} // {pp} = {rounds} rounds of equal size, which "
            f"train.grad_accum = {n} does not split into; choose train.grad_accum a multiple of "
            f"pp, e.g. {rounds * pp} or {(rounds + 1) * pp}"
        )


class StudentStage(nn.Module):
    """What the schedule calls for pipeline stage `stage`: its forward on one micro-batch,
    `(x, mb) -> hidden` (`x`: token ids in stage 0, the previous stage's hidden states
    elsewhere; `mb`: the micro-batch's index, which picks its positions and segments from
    `inputs`, the list the rank's stages share)."""

    def __init__(self, model: nn.Module, stage: int, inputs: list, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.stage = stage
        self.inputs = inputs
        self.dtype = dtype

    def forward(self, x: Tensor, mb: Tensor) -> Tensor:
        pos, segments = self.inputs[int(mb.reshape(-1)[0])]
        state = getattr(self.model, "cp_state", None)
        if state is not None:  # `x` holds this rank's rows; attention sees the whole sequence
            pos, segments = state.begin(pos), None
        with decoder_of(self.model).layers.running(self.stage):
            hidden = model_hidden(self.model, x, pos, segments)
        return hidden.to(self.dtype)


class StudentPipeline:
    """The student's pipeline stages on this rank and the schedule that runs them (module doc).
    `mesh`: the student's `NamedMesh`; `dtype`: the hidden states passed between stages
    (the student's compute dtype); the stages are those `keep_stages` left in `model`."""

    def __init__(
        self,
        model: nn.Module,
        mesh: Any,
        device: torch.device,
        schedule: str,
        rows: int,
        length: int,
        dtype: torch.dtype,
        tied: bool,
    ):
        pp = mesh["pp"]
        self.group = pp.get_group()
        self.rank, self.pp = pp.get_local_rank(), pp.size()
        self.first, self.last = self.rank == 0, self.rank == self.pp - 1
        self.model, self.device, self.schedule_name = model, device, schedule
        blocks = decoder_of(model).layers
        self.num_stages = blocks.num_stages
        self.inputs: list[tuple[Tensor, Any]] = []  # per micro-batch: positions, segments
        self.modules = [StudentStage(model, s, self.inputs, dtype) for s in sorted(blocks.stages)]
        self.rows, self.length = rows, length
        self.cp = getattr(model, "cp_state", None)  # each stage's context-parallel group
        self.cp_size = self.cp.size if self.cp is not None else 1
        self.hidden_size = model.config.hidden_size
        self.dtype = dtype
        self._schedules: dict[int, Any] = {}
        self._loss_of: LossOf | None = None  # the last rank's
        self._keys: list[str] | None = None
        ranks = dist.get_process_group_ranks(self.group)
        self._ends = None  # first and last rank of this pipeline: the tied copies
        if tied:
            self._ends = _pair_group(mesh, ranks[0], ranks[-1])

    # ------------------------------------------------------------------ training

    def _schedule(self, n: int) -> Any:
        if n not in self._schedules:
            from torch.distributed.pipelining import (
                Schedule1F1B,
                ScheduleGPipe,
                ScheduleInterleaved1F1B,
            )

            stages = [self._stage(m) for m in self.modules]
            kinds = {
                "1F1B": Schedule1F1B,
                "GPipe": ScheduleGPipe,
                "Interleaved1F1B": ScheduleInterleaved1F1B,
            }
            kind = kinds[self.schedule_name]
            held = stages if kind is ScheduleInterleaved1F1B else stages[0]  # one stage or several
            self._schedules[n] = kind(held, n, loss_fn=self._loss, scale_grads=False)
        return self._schedules[n]

    def _stage(self, module: StudentStage) -> Any:
        """`module` as a `PipelineStage`, with examples of its inputs and output."""
        from torch.distributed.pipelining import PipelineStage

        shape = (self.rows, self.length // self.cp_size)  # this rank's rows
        ids = torch.zeros(shape, dtype=torch.long, device=self.device)
        hidden = torch.zeros(*shape, self.hidden_size, dtype=self.dtype, device=self.device)
        hidden.requires_grad_()  # the examples say which tensors carry gradients back
        return PipelineStage(
            module,
            module.stage,
            self.num_stages,
            self.device,
            input_args=(ids,) if module.stage == 0 else (hidden,),
            output_args=hidden,
            group=self.group,
        )

    def _loss(self, hidden: Tensor, mb: Tensor) -> Tensor:
        rows = self._rows(self.rows, self.length)
        return self._loss_of(int(mb.reshape(-1)[0]), hidden.flatten(0, 1), rows)

    def _rows(self, batch: int, length: int) -> RowShard | None:
        """The rows of a `[batch, length]` micro-batch this rank holds (None: all of them)."""
        return None if self.cp is None else cpmod.row_shard(self.cp, batch, length, self.device)

    def _local(self, ids: Tensor) -> Tensor:
        """`[B, T]` token ids -> this rank's rows (`[B, T/cp]` under context parallelism)."""
        return ids if self.cp is None else cpmod.shard_rows(ids, self.cp.size, self.cp.rank)

    def train(self, batches: list, loss_of: LossOf | None) -> None:
        """Forward and backward of every micro-batch in `batches` (this data rank's window) through
        the pipeline; `loss_of(i, hidden, rows)` returns micro-batch i's loss from the final
        hidden states `[N, H]` of the rows `rows` holds (None: all `B·T`), already divided by
        the global counts (the last rank's; None on the others). Gradients accumulate in the
        stages' parameters."""
        n = len(batches)
        check_micro_batches(n, self.pp, self.schedule_name)
        self._set_inputs(batches)
        self._loss_of = loss_of
        index = torch.arange(n).view(n, 1)
        ids = torch.stack([b.input_ids for b in batches]).flatten(0, 1).to(self.device)
        ids = self._local(ids)
        args = (ids,) if self.first else ()
        target = index if self.last else None
        self._schedule(n).step(*args, target=target, mb=index)

    def _set_inputs(self, batches: list) -> None:
        for b in batches:
            if tuple(b.input_ids.shape) != (self.rows, self.length):
                raise UserError(
                    f"pipeline parallelism passes fixed-shape micro-batches between stages "
                    f"({self.rows} x {self.length}); got one of {tuple(b.input_ids.shape)}"
                )
        self.inputs[:] = [
            (b.position_ids.to(self.device, non_blocking=True), segments_of(b, self.device))
            for b in batches
        ]

    # ------------------------------------------------------------------ teacher targets

    def spread_targets(
        self,
        batches: list,
        live: list[bool],
        compute: Callable[[int, int], TeacherTargets],
        stage_group: tuple[Any, int, int] | None = None,
        whole: list[bool] | None = None,
    ) -> list[list[TeacherTargets]] | None:
        """Every teacher's targets of every micro-batch on the last rank (None elsewhere).
        `batches[i]`: micro-batch i's teacher batches (one per teacher); `live[k]`: teacher k
        runs here (else its targets come with the batch or from a separate teacher's stream,
        and only the last rank reads them);
        `compute(i, k)`: teacher k's targets of micro-batch i on this rank (collective where the
        teacher is laid out across ranks: every pipeline rank calls it equally often).
        `stage_group`: (group, rank, size) of the ranks of this stage that read the same
        micro-batches (a tensor- or context-parallel stage); they share the work of the live
        teachers that run whole on each of them (`whole[k]`, `share.py`)."""
        n, teachers = len(batches), len(live)
        split = n % self.pp == 0  # the ranks share the teacher work
        mine = [i for i in range(n) if not split or i % self.pp == self.rank]
        out: list[list[Any]] = [[None] * teachers for _ in range(n)]
        if stage_group is None:
            for k in (k for k in range(teachers) if live[k]):
                for i in mine:
                    out[i][k] = compute(i, k)
        else:
            shared = [live[k] and bool(whole and whole[k]) for k in range(teachers)]
            got = share_window_targets(
                [batches[i] for i in mine],
                shared,
                lambda j, k: compute(mine[j], k) if live[k] else None,
                *stage_group,
            )
            for j, i in enumerate(mine):
                out[i] = got[j]
        for k in (k for k in range(teachers) if not live[k] and self.last):
            for i in range(n):
                out[i][k] = compute(i, k)
        if not split:
            return out if self.last else None
        last = self.pp - 1
        for k in (k for k in range(teachers) if live[k]):
            if not self.last:  # this rank's share, in micro-batch order
                for i in mine:
                    dist.send(pack_targets(out[i][k], "none"), group=self.group, group_dst=last)
                continue
            like = out[mine[0]][k]  # the last rank's own share gives K and the temperature
            for i in range(n):
                if out[i][k] is None:
                    out[i][k] = _receive(batches[i][k], like, self.group, i % self.pp)
        return out if self.last else None

    # ------------------------------------------------------------------ forward only

    @torch.no_grad()
    def forward(self, batch: Any) -> tuple[Tensor | None, RowShard | None]:
        """The final hidden states `[N, H]` of one micro-batch on the last rank (None on the
        others) and the rows they are (None: all `B·T`; this rank's under context
        parallelism): each stage runs it and hands it to the next, so with several stages per
        rank it goes round the ranks as many times (validation; no schedule needed)."""
        self.inputs[:] = [(batch.position_ids.to(self.device), segments_of(batch, self.device))]
        mb = torch.zeros(1, dtype=torch.long)
        out = None
        for module in self.modules:  # this rank's stages, in order
            stage = module.stage
            if stage == 0:
                x = self._local(batch.input_ids.to(self.device))
            else:  # every rank of a pipeline reads the same batch: the shape is known here
                rows, length = batch.input_ids.shape
                shape = (rows, length // self.cp_size, self.hidden_size)
                x = torch.empty(shape, dtype=self.dtype, device=self.device)
                dist.recv(x, group=self.group, group_src=(stage - 1) % self.pp)
            out = module(x, mb)
            if stage < self.num_stages - 1:
                dist.send(out.contiguous(), group=self.group, group_dst=(stage + 1) % self.pp)
        if not self.last:
            return None, None
        return out.flatten(0, 1), self._rows(*batch.input_ids.shape)

    # ------------------------------------------------------------------ sums and gradients

    def share(self, metrics: dict[str, Tensor]) -> dict[str, Tensor]:
        """The last rank's metrics on every rank of the pipeline (one all-reduce)."""
        if self._keys is None:
            keys = [list(metrics) if self.last else None]
            dist.broadcast_object_list(keys, group=self.group, group_src=self.pp - 1)
            self._keys = keys[0]
        flat = torch.zeros(len(self._keys), dtype=torch.float64, device=self.device)
        if self.last:
            flat = torch.stack(
                [torch.as_tensor(metrics[k], device=self.device).double() for k in self._keys]
            )
        dist.all_reduce(flat, group=self.group)
        return {k: flat[i] for i, k in enumerate(self._keys)}

    def sum_over_stages(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def whole_param_groups(self, optim_state: dict[str, Any]) -> dict[str, Any]:
        """`optim_state` (this rank's, from `get_state_dict`) with each param group naming the
        parameters of every stage: a checkpoint keeps one rank's copy of the groups, and a rank
        whose parameters its groups do not name would load no learning rate or betas back (a
        pipeline's checkpoint could not resume as a pipeline)."""
        groups = optim_state["param_groups"]
        every: list[Any] = [None] * self.pp
        dist.all_gather_object(every, [g["params"] for g in groups], group=self.group)
        for j, group in enumerate(groups):
            group["params"] = list(dict.fromkeys(name for rank in every for name in rank[j]))
        return optim_state

    def tied_weight(self) -> Tensor | None:
        """The tied embedding's copy on this rank (None where it holds none): the first rank's
        input embedding, the last rank's lm_head (one tensor on a rank unless a layout gives
        the head a parameter of its own)."""
        if self._ends is None:
            return None
        if self.last:
            return self.model.get_output_embeddings().weight
        return self.model.get_input_embeddings().weight

    def sync_tied_grads(self) -> None:
        """First and last rank: the tied embedding's gradient becomes the sum of both. Both
        ranks always join the sum (a copy that took no gradient adds zeros), each in its
        weight's layout (a tensor-parallel embedding's gradient comes back replicated while its
        weight is a vocabulary shard: brought to the shard first)."""
        w = self.tied_weight()
        if w is None:
            return
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        g = w.grad
        if hasattr(g, "to_local"):
            if g.placements != w.placements:
                g = w.grad = g.redistribute(w.device_mesh, w.placements)
            g = g.to_local()
        dist.all_reduce(g, group=self._ends)

    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients enter the global norm: the tied copy of the last rank
        is left out (it equals the first rank's)."""
        params = list(self.model.parameters())
        if self._ends is not None and self.last:
            w = self.tied_weight()
            params = [p for p in params if p is not w]
        return params


def _receive(tb: Any, like: TeacherTargets, group: Any, rank: int) -> TeacherTargets:
    """Targets of teacher batch `tb` sent by pipeline rank `rank` (`like`: targets of the
    same teacher computed here, for their top-k width, dtypes and temperature)."""
    return receive_like(tb, like, lambda buf: dist.recv(buf, group=group, group_src=rank))


def _pair_group(mesh: Any, first: int, last: int) -> Any:
    """A process group of the first and last rank of every pipeline: `new_group` is
    collective, so every rank creates every pair and keeps its own."""
    root = mesh.root.mesh  # [pp, dp_replicate, dp_shard, cp, tp] global ranks
    flat = root.reshape(root.shape[0], -1)
    mine = None
    for j in range(flat.shape[1]):
        pair = [int(flat[0, j]), int(flat[-1, j])]
        group = dist.new_group(pair)
        if pair == [first, last]:
            mine = group
    return mine

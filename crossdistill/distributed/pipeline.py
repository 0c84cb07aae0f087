"""Pipeline-parallel student: its blocks split into `student.parallel.pp` stages, one per rank
of the mesh's outermost `pp` axis, run by a `torch.distributed.pipelining` schedule (1F1B or
GPipe) over the step's micro-batches.

- A stage keeps its own blocks under their original names (`model.layers.5...` stays
  `model.layers.5`): the others are replaced by `HeldElsewhere`, which holds nothing. The first
  stage keeps the embedding, the last the final norm and the lm_head, so a stage's state dict is
  the slice of the whole model's, and checkpoints reshard to and from any other layout.
- Tied embeddings: the last stage keeps the embedding as its lm_head weight (same name, same
  initial value). After the backward the first and last stages add their gradients of it
  (`sync_tied_grads`), so the two copies see the same gradient and the same update; the
  gradient norm counts it once (`norm_parameters`).
- Micro-batch identity: the schedule splits a tensor of micro-batch indices along with the
  inputs, and every stage and the loss look their micro-batch's positions, segments, labels and
  teacher targets up by that index; targets of micro-batch i meet the logits of micro-batch i by
  construction, whatever order the schedule runs them in.
- Teachers: when the step's micro-batches divide evenly among the stages, stage s computes
  the targets of micro-batches s, s + pp, s + 2·pp, ... (a teacher laid out across stages runs
  them together, as it runs several data ranks' batches) and sends them to the last stage in
  the payload format of separate teachers (`losses/payload.py`): each stage does 1/pp of the
  teacher work. Otherwise every stage computes them all and the last stage keeps its own.
- The loss runs on the last stage, divided by the global batch's counts as in every layout, so
  the schedule must not scale gradients (`scale_grads=False`). Metrics are summed over the
  pipeline group (the other stages add zeros), so every rank holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from crossdistill.distributed.parallelize import model_hidden
from crossdistill.errors import UserError
from crossdistill.losses.payload import (
    pack_targets,
    payload_nbytes,
    payload_sizes,
    unpack_targets,
)
from crossdistill.losses.targets import TeacherTargets
from crossdistill.models.attention import segments_of
from crossdistill.models.forward import HeldElsewhere, decoder_of


def stage_blocks(num_blocks: int, stages: int, head_blocks: float = 0.0) -> list[range]:
    """Contiguous blocks per stage (at least one each) with the largest stage cost as small as
    it can be, a block costing 1 and the last stage `head_blocks` more for its lm_head and loss
    (the work of the stage that runs longest sets the pipeline's pace); among equal splits the
    earlier stages take more blocks. Needs `stages <= num_blocks` (refused at load:
    `ParallelLayout.check_model`)."""
    if stages > num_blocks:
        raise ValueError(f"{stages} pipeline stages cannot each hold one of {num_blocks} blocks")
    # best[s][n]: the smallest largest-stage cost of the last `s` stages holding the last `n`
    # blocks; the last stage adds `head_blocks`
    inf = float("inf")
    best = [[inf] * (num_blocks + 1) for _ in range(stages + 1)]
    take = [[0] * (num_blocks + 1) for _ in range(stages + 1)]
    for n in range(1, num_blocks + 1):
        best[1][n], take[1][n] = n + head_blocks, n
    for s in range(2, stages + 1):
        for n in range(s, num_blocks + 1):
            for first in range(n - s + 1, 0, -1):  # more blocks first: earlier stages take more
                cost = max(first, best[s - 1][n - first])
                if cost < best[s][n]:
                    best[s][n], take[s][n] = cost, first
    bounds, start, left = [], 0, num_blocks
    for s in range(stages, 0, -1):
        n = take[s][left]
        bounds.append(range(start, start + n))
        start, left = start + n, left - n
    return bounds


def head_cost(model: nn.Module) -> float:
    """The lm_head's (and loss's) work in blocks' worth, by parameters: its matmul per token
    against one block's."""
    decoder = decoder_of(model)
    block = sum(p.numel() for p in decoder.layers[0].parameters())
    head = model.get_output_embeddings()
    return head.weight.numel() / block if head is not None and block else 0.0


def keep_stage(model: nn.Module, stage: int, stages: int) -> None:
    """Cut `model` (a causal LM) down to pipeline stage `stage` of `stages` in place (see module
    doc); the kept tensors keep their names."""
    if stages == 1:
        return
    decoder = decoder_of(model)
    mine = stage_blocks(len(decoder.layers), stages, head_cost(model))[stage]
    for i in range(len(decoder.layers)):
        if i not in mine:
            decoder.layers[i] = HeldElsewhere()
    first, last = stage == 0, stage == stages - 1
    tied = _tied(model)
    if not last:
        decoder.norm = HeldElsewhere()
    if not last and not (first and tied):  # tied: the first stage's head is its embedding
        model.set_output_embeddings(None)
    if not first and not (last and tied):  # tied: the last stage's embedding is its head
        decoder.embed_tokens = None


def _tied(model: nn.Module) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


class StudentStage(nn.Module):
    """What the schedule calls: one stage's forward on one micro-batch, `(x, mb) -> hidden`
    (`x`: token ids on the first stage, the previous stage's hidden states elsewhere; `mb`: the
    micro-batch's index, which picks its positions and segments)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype
        self.inputs: list[tuple[Tensor, Any]] = []

    def forward(self, x: Tensor, mb: Tensor) -> Tensor:
        pos, segments = self.inputs[int(mb.reshape(-1)[0])]
        hidden = model_hidden(self.model, x, pos, segments)
        return hidden.to(self.dtype)


class StudentPipeline:
    """The student's pipeline stage on this rank and the schedule that runs it (module doc).
    `mesh`: the student's `NamedMesh`; `dtype`: the hidden states passed between stages
    (the student's compute dtype)."""

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
        self.stage, self.stages = pp.get_local_rank(), pp.size()
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.model, self.device, self.schedule_name = model, device, schedule
        self.module = StudentStage(model, dtype)
        self.rows, self.length = rows, length
        self.hidden_size = model.config.hidden_size
        self.dtype = dtype
        self._schedules: dict[int, Any] = {}
        self._loss_of: Callable[[int, Tensor], Tensor] | None = None  # the last stage's
        self._keys: list[str] | None = None
        ranks = dist.get_process_group_ranks(self.group)
        self._ends = None  # first and last stage of this rank's pipeline: the tied copies
        if tied:
            self._ends = _pair_group(mesh, ranks[0], ranks[-1])

    # ------------------------------------------------------------------ training

    def _schedule(self, n: int) -> Any:
        if n not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            shape = (self.rows, self.length)
            ids = torch.zeros(shape, dtype=torch.long, device=self.device)
            hidden = torch.zeros(*shape, self.hidden_size, dtype=self.dtype, device=self.device)
            hidden.requires_grad_()  # the examples say which tensors carry gradients back
            stage = PipelineStage(
                self.module,
                self.stage,
                self.stages,
                self.device,
                input_args=(ids,) if self.first else (hidden,),
                output_args=hidden,
                group=self.group,
            )
            kind = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}[self.schedule_name]
            self._schedules[n] = kind(stage, n, loss_fn=self._loss, scale_grads=False)
        return self._schedules[n]

    def _loss(self, hidden: Tensor, mb: Tensor) -> Tensor:
        return self._loss_of(int(mb.reshape(-1)[0]), hidden.flatten(0, 1))

    def train(self, batches: list, loss_of: Callable[[int, Tensor], Tensor] | None) -> None:
        """Forward and backward of every micro-batch in `batches` (this data rank's window) through
        the pipeline; `loss_of(i, hidden)` returns micro-batch i's loss from its final hidden
        states `[B·T, H]`, already divided by the global counts (the last stage's; None on the
        others). Gradients accumulate in the stage's parameters."""
        n = len(batches)
        if n < self.stages:
            raise UserError(
                f"student.parallel.pp = {self.stages} stages need at least {self.stages} "
                f"micro-batches per step on each data rank, got {n}; raise train.grad_accum"
            )
        self._set_inputs(batches)
        self._loss_of = loss_of
        index = torch.arange(n).view(n, 1)
        ids = torch.stack([b.input_ids for b in batches]).flatten(0, 1).to(self.device)
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
        self.module.inputs = [
            (b.position_ids.to(self.device, non_blocking=True), segments_of(b, self.device))
            for b in batches
        ]

    # ------------------------------------------------------------------ teacher targets

    def spread_targets(
        self, batches: list, live: list[bool], compute: Callable[[int, int], TeacherTargets]
    ) -> list[list[TeacherTargets]] | None:
        """Every teacher's targets of every micro-batch on the last stage (None elsewhere).
        `batches[i]`: micro-batch i's teacher batches (one per teacher); `live[k]`: teacher k
        runs here (else its targets come with the batch, and only the last stage reads them);
        `compute(i, k)`: teacher k's targets of micro-batch i on this rank (collective where the
        teacher is laid out across ranks: every stage calls it equally often)."""
        n, teachers = len(batches), len(live)
        split = n % self.stages == 0  # the stages share the teacher work
        mine = [i for i in range(n) if not split or i % self.stages == self.stage]
        out: list[list[Any]] = [[None] * teachers for _ in range(n)]
        for k in range(teachers):
            for i in mine if live[k] else (range(n) if self.last else ()):
                out[i][k] = compute(i, k)
        if not split:
            return out if self.last else None
        last = self.stages - 1
        for k in (k for k in range(teachers) if live[k]):
            if not self.last:  # this stage's share, in micro-batch order
                for i in mine:
                    dist.send(pack_targets(out[i][k], "none"), group=self.group, group_dst=last)
                continue
            like = out[mine[0]][k]  # the last stage's own share gives K and the temperature
            for i in range(n):
                if out[i][k] is None:
                    out[i][k] = _receive(batches[i][k], like, self.group, i % self.stages)
        return out if self.last else None

    # ------------------------------------------------------------------ forward only

    @torch.no_grad()
    def forward(self, batch: Any) -> Tensor | None:
        """The final hidden states `[B·T, H]` of one micro-batch on the last stage (None on the
        others): each stage runs it and hands it on (validation; no schedule needed)."""
        self.module.inputs = [(batch.position_ids.to(self.device), segments_of(batch, self.device))]
        mb = torch.zeros(1, dtype=torch.long)
        if self.first:
            x = batch.input_ids.to(self.device)
        else:  # every stage of a data rank reads the same batch: the shape is known here
            shape = (*batch.input_ids.shape, self.hidden_size)
            x = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(x, group=self.group, group_src=self.stage - 1)
        out = self.module(x, mb)
        if self.last:
            return out.flatten(0, 1)
        dist.send(out.contiguous(), group=self.group, group_dst=self.stage + 1)
        return None

    # ------------------------------------------------------------------ sums and gradients

    def share(self, metrics: dict[str, Tensor]) -> dict[str, Tensor]:
        """The last stage's metrics on every stage of the pipeline (one all-reduce)."""
        if self._keys is None:
            keys = [list(metrics) if self.last else None]
            dist.broadcast_object_list(keys, group=self.group, group_src=self.stages - 1)
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

    def tied_weight(self) -> Tensor | None:
        return self.model.get_input_embeddings().weight if self._ends is not None else None

    def sync_tied_grads(self) -> None:
        """First and last stage: the tied embedding's gradient becomes the sum of both."""
        w = self.tied_weight()
        if w is None or w.grad is None:
            return
        g = w.grad
        local = g.to_local() if hasattr(g, "to_local") else g
        dist.all_reduce(local, group=self._ends)

    def norm_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients enter the global norm: the tied copy of the last stage
        is left out (it equals the first stage's)."""
        params = list(self.model.parameters())
        if self._ends is not None and self.last:
            w = self.tied_weight()
            params = [p for p in params if p is not w]
        return params


def _receive(tb: Any, like: TeacherTargets, group: Any, stage: int) -> TeacherTargets:
    """Targets of teacher batch `tb` sent by pipeline stage `stage` (`like`: targets of the
    same teacher computed here, for their top-k width, dtypes and temperature)."""
    (m, n), k = payload_sizes(tb), like.topk_ids.shape[1]
    buf = torch.empty(
        payload_nbytes(m, k, n, "none"), dtype=torch.uint8, device=like.topk_ids.device
    )
    dist.recv(buf, group=group, group_src=stage)
    got = unpack_targets(buf, m, k, n, "none", like.temperature)
    got.topk_ids = got.topk_ids.to(like.topk_ids.dtype)
    return got


def _pair_group(mesh: Any, first: int, last: int) -> Any:
    """A process group of the first and last stage rank of every pipeline: `new_group` is
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

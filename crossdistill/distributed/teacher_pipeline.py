"""A separate teacher laid out as a forward-only pipeline (`teachers.N.parallel.pp` > 1).

A teacher too large for one GPU can run as pipeline stages over its own ranks
(`teachers.N.placement: separate`): its blocks are split by cost into `pp` stages as the
student's are (`stages.stage_blocks`, `stages.keep_stages`, on the mesh's outermost `pp`
axis), and each stage keeps only its blocks; the first also the embedding, the last the final
norm and the lm_head. Built from a checkpoint folder, each stage reads only its own tensors
(`loading.build_parallel_model`); built from an architecture (random init), the whole model is
made with the run's seed and cut to the stage, so every layout starts from the same weights.
A stage's ranks may shard or replicate it (`dp_shard`, `dp_replicate`); tensor and context
parallelism do not combine with a teacher's stages.

Forward only, no schedule: every stage reads the same batches (the teacher's processes run
their own loaders), so the shape of the hidden states a stage receives is known from the batch
and no sizes are exchanged. For each micro-batch, stage 0 embeds the tokens and runs its
blocks, every stage sends its hidden states to the next without waiting (`isend`), and the
last stage runs its blocks, the final norm, the lm_head and the top-k targets exactly as an
unsplit teacher does (`Placement.teacher_targets`). The last stage's ranks are the ones that
stream targets to the student (`train/serve.py`, `streams.teacher_source`). An earlier stage
starts micro-batch i + 1 while the next finishes i, up to `SENDS_IN_FLIGHT` micro-batches
ahead; a stage whose neighbour died or stalls stops after `train.teacher_timeout_s` with one
line naming it.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from crossdistill.config import ParallelConfig
from crossdistill.distributed.parallelize import model_hidden
from crossdistill.distributed.streams import wait
from crossdistill.errors import UserError
from crossdistill.models.forward import decoder_of

# micro-batches an earlier stage may run ahead of the next (its sends not yet received)
SENDS_IN_FLIGHT = 2


def check_teacher_stages(i: int, pcfg: ParallelConfig, separate: bool, ranks: int) -> None:
    """Refuse teacher `i`'s pipeline layout (`pcfg.pp` > 1) where it cannot run, before
    anything loads: a colocated teacher, stages combined with tensor or context parallelism or
    several per rank, and degrees whose product is not the teacher's `ranks`. (A `pp` larger
    than the teacher's blocks is refused by `ParallelLayout.check_model`.)"""
    pp, where = pcfg.pp, f"teachers.{i}.parallel"
    if pp == 1:
        return
    if not separate:
        raise UserError(
            f"{where}.pp = {pp}: a colocated teacher runs on the student's ranks and is not split "
            "into pipeline stages; give it ranks of its own to run it as a pipeline "
            f"(teachers.{i}.placement: separate, teachers.{i}.ranks: a multiple of {pp}), or lay "
            "it out with dp_shard, tp or cp"
        )
    if pcfg.tp > 1 or pcfg.cp > 1:
        raise UserError(
            f"{where}.pp = {pp} with tp = {pcfg.tp} and cp = {pcfg.cp}: a teacher's pipeline "
            "stages combine with data parallelism only (dp_replicate, dp_shard); set tp and cp "
            "to 1, or pp to 1"
        )
    if pcfg.pp_stages_per_rank > 1 or pcfg.pp_schedule == "Interleaved1F1B":
        raise UserError(
            f"{where}.pp_stages_per_rank = {pcfg.pp_stages_per_rank} with pp_schedule = "
            f"{pcfg.pp_schedule}: a teacher runs forward only, one stage per pipeline rank and "
            "no schedule; leave pp_stages_per_rank at 1 and pp_schedule at 1F1B"
        )
    rep, shard = pcfg.dp_replicate, pcfg.dp_shard
    if shard == -1 and ranks % (pp * rep) == 0:
        return
    if shard == -1:
        raise UserError(
            f"{where}: pp x dp_replicate = {pp} x {rep} = {pp * rep} does not divide "
            f"teachers.{i}.ranks = {ranks}; the teacher's degrees must multiply to its ranks "
            f"(choose ranks a multiple of {pp * rep}, or other degrees)"
        )
    if pp * rep * shard != ranks:
        raise UserError(
            f"{where}: pp x dp_replicate x dp_shard = {pp} x {rep} x {shard} = "
            f"{pp * rep * shard}, but teachers.{i}.ranks = {ranks}; the teacher's degrees must "
            "multiply to its ranks (dp_shard: -1 takes what pp and dp_replicate leave)"
        )


class TeacherStages:
    """This rank's stage of a teacher's pipeline (module doc): `hidden` runs one micro-batch
    through it. `mesh`: the teacher's `NamedMesh`; `model`: the teacher cut to this rank's
    stage (`keep_stages`); `timeout_s`: how long a stage waits for its neighbour."""

    def __init__(self, model: nn.Module, mesh: Any, device: torch.device, timeout_s: float):
        pp = mesh["pp"]
        self.group = pp.get_group()
        self.rank, self.pp = pp.get_local_rank(), pp.size()
        self.first, self.last = self.rank == 0, self.rank == self.pp - 1
        self.model, self.device, self.timeout_s = model, device, timeout_s
        self.hidden_size = model.config.hidden_size
        self.dtype = next(model.parameters()).dtype  # the hidden states the blocks compute in
        self.gloo = dist.get_backend(self.group) == "gloo"
        self._sends: deque[tuple[Any, Tensor]] = deque()  # (work, the buffer it sends)
        self._seq = 0

    @torch.no_grad()
    def hidden(self, ids: Tensor, pos: Tensor, segments: Any) -> Tensor | None:
        """Micro-batch `ids` / `pos` (`[B, T]`, with `segments` as for `final_hidden`) through
        this stage: the final hidden states `[B·T, H]` on the last stage, None on the others
        (their output went to the next stage)."""
        who = f"teacher pipeline stage {self.rank} of {self.pp}, micro-batch {self._seq}"
        self._seq += 1
        x = ids
        if not self.first:  # the shape follows from the batch every stage reads
            x = torch.empty((*ids.shape, self.hidden_size), dtype=self.dtype, device=self.device)
            work = dist.irecv(x, group=self.group, group_src=self.rank - 1)
            self._wait(work, f"{who}, receiving from the stage before")
        with decoder_of(self.model).layers.running(self.rank):
            out = model_hidden(self.model, x, pos, segments)
        if self.last:
            return out.flatten(0, 1)
        out = out.to(self.dtype).contiguous()
        self._sends.append((dist.isend(out, group=self.group, group_dst=self.rank + 1), out))
        while len(self._sends) > SENDS_IN_FLIGHT:
            self._settle(who)
        if hasattr(self.model, "reshard"):
            self.model.reshard()  # a frozen model keeps nothing gathered between micro-batches
        return None

    def flush(self) -> None:
        """Wait until the next stage has received everything this one sent."""
        while self._sends:
            self._settle(f"teacher pipeline stage {self.rank} of {self.pp}, last sends")

    def _settle(self, who: str) -> None:
        work, _ = self._sends.popleft()
        self._wait(work, f"{who}, sending to the stage after")

    def _wait(self, work: Any, who: str) -> None:
        wait(work, time.monotonic() + self.timeout_s, who, gloo=self.gloo)

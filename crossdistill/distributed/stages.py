"""Pipeline stages cut from a causal LM: which blocks each stage holds, balanced by cost
(`stage_blocks`, the lm_head weighed in blocks by `head_cost`), which stages a pipeline rank
holds (`rank_stages`), and the model cut down in place to a rank's stages (`keep_stages`, at
load: `distributed/loading.py`). The student's stages run under a schedule
(`distributed/pipeline.py`), a separate teacher's forward only
(`distributed/teacher_pipeline.py`).

- A rank keeps the blocks of its stages under their original names (`model.layers.5...` stays
  `model.layers.5`): the others are replaced by `HeldElsewhere`, which holds nothing. The first
  rank (stage 0) keeps the embedding, the last (the last stage) the final norm and the
  lm_head, so a rank's state dict is the slice of the whole model's, and checkpoints reshard
  to and from any other layout. Each of the rank's stages runs the model's own forward with
  only its blocks (`StageBlocks`): the embedding applies to token ids, which only stage 0
  receives, and the final norm in the last stage only.
- Tied embeddings: the last rank keeps the embedding as its lm_head weight (same name, same
  initial value); the student's pipeline adds the two copies' gradients
  (`pipeline.py`: `sync_tied_grads`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn

from crossdistill.models.forward import HeldElsewhere, decoder_of


def stage_blocks(num_blocks: int, stages: int, head_blocks: float = 0.0) -> list[range]:
    """Contiguous blocks per stage (at least one each), for all `stages` of the pipeline in
    order (`pp x stages_per_rank`: with several stages per rank, rank r runs entries r, r + pp,
    ...), with the largest stage cost as small as it can be, a block costing 1 and the last
    stage `head_blocks` more for its lm_head and loss (the work of the stage that runs longest
    sets the pipeline's pace); among equal splits the earlier stages take more blocks. Needs
    `stages <= num_blocks` (refused at load: `ParallelLayout.check_model`)."""
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


def rank_stages(rank: int, pp: int, per_rank: int) -> list[int]:
    """The pipeline stages pipeline rank `rank` of `pp` holds, in order: `rank`, `rank + pp`,
    ... (`per_rank` of them), as torch's interleaved schedules place them."""
    return [rank + j * pp for j in range(per_rank)]


def head_cost(model: nn.Module) -> float:
    """The lm_head's (and loss's) work in blocks' worth, by parameters: its matmul per token
    against one block's."""
    decoder = decoder_of(model)
    block = sum(p.numel() for p in decoder.layers[0].parameters())
    head = model.get_output_embeddings()
    return head.weight.numel() / block if head is not None and block else 0.0


class StageBlocks(nn.ModuleList):
    """The decoder's blocks on a pipeline rank, under their own names (`HeldElsewhere` where
    another rank holds them), and which of the rank's stages each belongs to (`stages`: stage
    -> its blocks). While one stage runs (`running`), the model's own forward sees that stage's
    blocks only (the rank's others pass the hidden states through), and the final norm applies
    in the last stage only (`final_norm`, a forward hook of the norm)."""

    def __init__(self, blocks: list[nn.Module], stages: dict[int, range], num_stages: int):
        super().__init__(blocks)
        self.stages = stages
        self.num_stages = num_stages
        self._running: int | None = None

    @contextmanager
    def running(self, stage: int) -> Iterator[None]:
        """The model's forward inside runs stage `stage` (one of this rank's)."""
        self._running = stage
        try:
            yield
        finally:
            self._running = None

    def _live(self) -> list[nn.Module]:
        blocks = list(self._modules.values())
        if self._running is None:
            return blocks
        mine = self.stages[self._running]
        return [b if i in mine else _PASS_THROUGH for i, b in enumerate(blocks)]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._live())

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):  # the models loop over `layers[:num_hidden_layers]`
            return nn.ModuleList(self._live()[idx])
        return super().__getitem__(idx)

    def final_norm(self, norm: nn.Module, args: tuple, out: Tensor) -> Tensor:
        """Forward hook of the final norm: a stage before the last hands on the norm's input."""
        earlier = self._running is not None and self._running != self.num_stages - 1
        return args[0] if earlier else out


_PASS_THROUGH = HeldElsewhere()


def keep_stages(model: nn.Module, rank: int, pp: int, per_rank: int = 1) -> None:
    """Cut `model` (a causal LM) down to the stages of pipeline rank `rank` of `pp`, `per_rank`
    stages each (`rank_stages`), in place (see module doc); the kept tensors keep their names."""
    if pp == 1:
        return
    decoder = decoder_of(model)
    num_stages = pp * per_rank
    split = stage_blocks(len(decoder.layers), num_stages, head_cost(model))
    mine = {s: split[s] for s in rank_stages(rank, pp, per_rank)}
    kept = [
        block if any(i in r for r in mine.values()) else HeldElsewhere()
        for i, block in enumerate(decoder.layers)
    ]
    decoder.layers = StageBlocks(kept, mine, num_stages)
    first, last = rank == 0, rank == pp - 1
    tied = _tied(model)
    if last:
        decoder.norm.register_forward_hook(decoder.layers.final_norm)
    else:
        decoder.norm = HeldElsewhere()
    if not last and not (first and tied):  # tied: the first rank's head is its embedding
        model.set_output_embeddings(None)
    if not first and not (last and tied):  # tied: the last rank's embedding is its head
        decoder.embed_tokens = None


def _tied(model: nn.Module) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight

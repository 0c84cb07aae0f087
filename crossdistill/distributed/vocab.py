"""The vocabulary shard of a tensor-parallel lm_head, and the reductions the loss needs over it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from crossdistill.losses.sharding import VocabShard

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def vocab_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """`(start, size)` of part `index` when `total` rows are split like `torch.chunk` (and DTensor
    `Shard(0)`): ceil-sized parts, the last ones shorter or empty."""
    step = -(-total // parts)
    start = min(index * step, total)
    return start, min(step, total - start)


def vocab_shard(total: int, group: Any) -> VocabShard:
    """A `VocabShard` for this rank of `group`, with its all-reduce and all-gather."""
    parts, index = dist.get_world_size(group), dist.get_rank(group)
    start, size = vocab_range(total, parts, index)

    def all_reduce(x: Tensor, op: str) -> Tensor:
        dist.all_reduce(x, op=_OPS[op], group=group)
        return x

    def all_gather(x: Tensor) -> Tensor:
        out = [torch.empty_like(x) for _ in range(parts)]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.stack(out)

    return VocabShard(start, size, total, all_reduce, all_gather)


def local_vocab(weight: Tensor, tp_group: Any) -> tuple[Tensor, VocabShard | None]:
    """An lm_head weight as the loss takes it: `[V, H]` and None, or, split over `tp_group`
    (a DTensor sharded on the vocabulary), this rank's `[V/tp, H]` rows and their shard."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(weight, DTensor):
        return weight, None
    if tp_group is None or any(p != Shard(0) for p in weight.placements):
        return weight.full_tensor(), None
    return weight.to_local(), vocab_shard(weight.shape[0], tp_group)

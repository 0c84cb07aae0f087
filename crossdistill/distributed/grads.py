"""Gradient-norm clipping over parameters that may be sharded in different ways.

Under FSDP + TP some gradients are DTensors on a 2-D mesh and others (norm weights) on the
data-parallel mesh only; `torch.nn.utils.clip_grad_norm_` stacks their norms and fails on the
mix. Here the squared norms are summed per group of equal (mesh, placements), each group's sum
completed by one reduction over its sharded axes, and the groups added: one collective per
group, and every rank gets the same norm.

Squares are accumulated in float64, in one process too. torch's float32 norm of a 2M-element
embedding gradient is off by ~5e-5 relative, and by a different amount for each way of cutting
the tensor into shards; in float64 the norm (and so the clipping) is the same for every layout
to ~1e-7. Scaling is torch's: `g *= min(1, max_norm / (norm + 1e-6))`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    counted: Iterable[torch.nn.Parameter] | None = None,
    across: Any = None,
) -> Tensor:
    """Scale gradients in place so that their global 2-norm is at most `max_norm`; returns the
    norm before clipping (float32, the same on every rank). `counted`: the parameters whose
    gradients make the norm (default: all; a copy held twice counts once); `across`: a process
    group whose ranks hold other parameters (pipeline stages): their squares are added."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    counted_grads = grads if counted is None else [p.grad for p in counted if p.grad is not None]
    groups: dict[tuple, list[Tensor]] = {}
    plain: list[Tensor] = []
    for g in counted_grads:
        if isinstance(g, DTensor):
            groups.setdefault((id(g.device_mesh), tuple(g.placements)), []).append(g)
        else:
            plain.append(g)
    squares = [_sum_squares(plain)] if plain else []
    for members in groups.values():
        locals_ = [g.to_local() for g in members]
        local_sq = _sum_squares(locals_)
        total = DTensor.from_local(
            local_sq.reshape(1), members[0].device_mesh, _partial(members[0].placements)
        ).full_tensor()
        squares.append(total.reshape(()))
    total_sq = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    if across is not None:
        total_sq = total_sq.to(grads[0].device)
        dist.all_reduce(total_sq, group=across)
    total_norm = total_sq.sqrt().float()
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local, clip_coef.to(local[0].dtype))
    return total_norm


def _sum_squares(tensors: list[Tensor]) -> Tensor:
    """Σ x² over the tensors, accumulated in float64: the shards of one tensor are summed on
    different ranks, so float32 rounding would depend on the layout."""
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)  # one multi-tensor kernel
    return torch.stack(norms).pow(2).sum()


def _partial(placements) -> list:
    """Replicated axes hold all of the sum; every other axis (`Shard`, and FSDP's
    `_StridedShard` over a TP shard, which is not a `Shard` subclass) holds a part of it."""
    from torch.distributed.tensor import Partial, Replicate

    return [Replicate() if p.is_replicate() else Partial() for p in placements]

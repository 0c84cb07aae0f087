"""Context parallelism: each rank of a `cp` group holds a part of every sequence.

Sharding is load-balanced: a sequence of T positions is cut into 2·cp equal pieces and rank r
takes piece r and piece 2·cp − 1 − r (one from the head, one from the tail), so every rank does
the same amount of causal-attention work.

Attention gathers the keys and values of the whole sequence from the group (all-gather in
forward, reduce-scatter of their gradients in backward) and each rank attends with its own query
rows under the packed-document causal mask, built once per forward from the global positions.
This is the all-gather form of context parallelism: it supports the block-diagonal masks of
packed documents, and runs on gloo (CPU) as on NCCL. PyTorch's ring-attention
`torch.distributed.tensor.experimental.context_parallel` only takes a plain causal mask and only
runs on CUDA, so it cannot keep packed documents apart; it is not used.

Labels are shifted by the data pipeline before sharding (`labels[i]` is token `i + 1`), so the
next-token target of the last position of a piece is already there, whichever rank holds the
next piece: no communication is needed for the shift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

CP_ATTENTION = "crossdistill_cp"


def load_balanced_index(length: int, cp: int, rank: int, device=None) -> Tensor:
    """`[length / cp]` positions that rank `rank` of `cp` holds: pieces `rank` and
    `2·cp − 1 − rank` of `2·cp` equal pieces, in that order."""
    piece = length // (2 * cp)
    head = torch.arange(rank * piece, (rank + 1) * piece, device=device)
    tail_start = (2 * cp - 1 - rank) * piece
    tail = torch.arange(tail_start, tail_start + piece, device=device)
    return torch.cat([head, tail])


def gathered_order(length: int, cp: int, device=None) -> Tensor:
    """`[length]` global position of each row of an all-gather of every rank's piece pair."""
    return torch.cat([load_balanced_index(length, cp, r, device) for r in range(cp)])


def document_ids(position_ids: Tensor) -> Tensor:
    """`[B, T]` document number of each position: a document starts wherever the position does
    not follow the previous one by exactly 1 (the rule the Hugging Face models apply to packed
    `position_ids`, so both paths mask alike)."""
    first = position_ids[:, :1] - 1
    step = torch.diff(position_ids, prepend=first, dim=-1)
    return (step != 1).cumsum(-1)


def cp_mask(position_ids: Tensor, cp: int, rank: int) -> Tensor:
    """`[B, 1, T/cp, T]` bool: may this rank's query row attend to the key row (in gathered
    order)? Causal in global positions, and within one document."""
    length = position_ids.shape[1]
    q = load_balanced_index(length, cp, rank, position_ids.device)
    k = gathered_order(length, cp, position_ids.device)
    doc = document_ids(position_ids)
    causal = k.unsqueeze(0) <= q.unsqueeze(1)  # [T/cp, T]
    same = doc[:, q].unsqueeze(2) == doc[:, k].unsqueeze(1)  # [B, T/cp, T]
    return (same & causal).unsqueeze(1)


def shard_rows(x: Tensor, cp: int, rank: int) -> Tensor:
    """`[B, T, ...] -> [B, T/cp, ...]`: this rank's positions of every sequence."""
    return x[:, load_balanced_index(x.shape[1], cp, rank, x.device)]


def global_rows(batch: int, length: int, cp: int, rank: int, device=None) -> Tensor:
    """`[B·T/cp]` flattened row index (`b·T + t`) of each flattened local row."""
    idx = load_balanced_index(length, cp, rank, device)
    base = torch.arange(batch, device=device).unsqueeze(1) * length
    return (base + idx.unsqueeze(0)).flatten()


@dataclass
class CPState:
    """One model's context-parallel group, and the mask of the sequence it is processing (set
    by `begin` before each forward; attention layers read it, also when recomputing)."""

    group: Any
    size: int
    rank: int
    mask: Tensor | None = None

    def begin(self, position_ids: Tensor) -> Tensor:
        """Set the mask for full `position_ids [B, T]`; return this rank's rows' positions."""
        self.mask = cp_mask(position_ids, self.size, self.rank)
        return shard_rows(position_ids, self.size, self.rank)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (`[B, H, T/cp, D] -> [B, H, T, D]`); the backward sums the
    gradients of all ranks and keeps this rank's slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = [p.contiguous() for p in grad.chunk(size, dim=2)]
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(pieces[rank])
            dist.reduce_scatter(out, pieces, group=group)
            return out, None
        # gloo has no reduce-scatter: sum everything, keep this rank's slice
        total = grad.contiguous()
        dist.all_reduce(total, group=group)
        return total.chunk(size, dim=2)[rank].contiguous(), None


def gather_sequence(x: Tensor, group: Any) -> Tensor:
    return _GatherSequence.apply(x, group)


def cp_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Hugging Face attention interface: `query [B, H, T/cp, D]`, `key`/`value`
    `[B, H_kv, T/cp, D]` -> `[B, T/cp, H, D]`."""
    state: CPState = module.cp_state
    k = gather_sequence(key, state.group)
    v = gather_sequence(value, state.group)
    out = F.scaled_dot_product_attention(
        query,
        k,
        v,
        attn_mask=state.mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=query.shape[1] != k.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def register_cp_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, cp_attention)


@torch.no_grad()
def gather_hidden(hidden: Tensor, state: CPState) -> Tensor:
    """A teacher's `[B, T/cp, H]` local hidden states -> `[B, T, H]` in sequence order."""
    parts = [torch.empty_like(hidden) for _ in range(state.size)]
    dist.all_gather(parts, hidden.contiguous(), group=state.group)
    gathered = torch.cat(parts, dim=1)
    order = gathered_order(gathered.shape[1], state.size, hidden.device)
    out = torch.empty_like(gathered)
    out[:, order] = gathered
    return out

"""Context parallelism: each rank of a `cp` group holds a part of every sequence.

Sharding is load-balanced: a sequence of T positions is cut into 2·cp equal pieces and rank r
takes piece r and piece 2·cp − 1 − r (one from the head, one from the tail), so every rank does
the same amount of causal-attention work.

Attention gathers the keys and values of the whole sequence from the group (all-gather in
forward, reduce-scatter of their gradients in backward) and each rank attends with its own query
rows. Where the flash kernel runs (CUDA, bf16/fp16), each of the rank's two pieces is cut at
document boundaries into segments, and a segment's queries attend to the keys of its document
from the document's start to the segment's end: variable-length flash attention with separate
query and key lengths (the queries are the last rows of their keys, where the kernel's causal
mask sits), so only each document's causal triangle is computed. Elsewhere the same attention
runs through SDPA under the packed-document causal mask over all gathered keys. Both are built
once per forward from the global positions. This is the all-gather form of context parallelism:
it supports packed documents, and runs on gloo (CPU) as on NCCL. PyTorch's ring-attention
`torch.distributed.tensor.experimental.context_parallel` only takes a plain causal mask and only
runs on CUDA, so it cannot keep packed documents apart; it is not used.

Labels are shifted by the data pipeline before sharding (`labels[i]` is token `i + 1`), so the
next-token target of the last position of a piece is already there, whichever rank holds the
next piece: no communication is needed for the shift.

Pipeline stages run it too (`distributed/pipeline.py`): each stage's ranks are a context-parallel
group, the hidden states a stage hands on are each rank's own rows, and the last stage's loss
takes this rank's rows (`row_shard`). A pipeline runs other micro-batches' forwards between a
micro-batch's forward and its backward, so a block recomputed for the backward (activation
checkpointing) first gets back the sequence its forward saw (`CPState.recompute_context`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from crossdistill.losses.sharding import RowShard

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
class CPSegments:
    """A rank's attention segments for the flash kernel: segment i is local query rows
    `cu_q[i]:cu_q[i+1]` (flattened `[B·T/cp]`, in the rank's order) against the gathered key
    rows `key_rows[cu_k[i]:cu_k[i+1]]` (flattened `[B·T]`, in gathered order)."""

    cu_q: Tensor
    cu_k: Tensor
    key_rows: Tensor
    max_q: int
    max_k: int

    def to(self, device: torch.device) -> CPSegments:
        move = {"device": device, "non_blocking": True}
        return CPSegments(
            self.cu_q.to(**move),
            self.cu_k.to(**move),
            self.key_rows.to(**move),
            self.max_q,
            self.max_k,
        )


def cp_segments(position_ids: Tensor, cp: int, rank: int) -> CPSegments:
    """`CPSegments` of rank `rank` for `position_ids [B, T]` (on the host: index arithmetic,
    no device work). Documents as `document_ids` finds them."""
    batch, length = position_ids.shape
    piece = length // (2 * cp)
    docs = document_ids(position_ids.cpu()).flatten()
    # every document's first flat row (a new document wherever the id changes or a row starts)
    starts = torch.ones(batch * length, dtype=torch.bool)
    starts[1:] = docs[1:] != docs[:-1]
    starts[::length] = True
    cu = torch.cat([torch.nonzero(starts).flatten(), torch.tensor([batch * length])])
    base = torch.arange(batch).unsqueeze(1) * length
    first = torch.tensor([rank * piece, (2 * cp - 1 - rank) * piece])
    a = (base + first).flatten()  # the rank's pieces, in its row order: [B·2] flat starts
    e = a + piece
    doc_a = torch.searchsorted(cu, a, right=True) - 1
    doc_e = torch.searchsorted(cu, e - 1, right=True) - 1
    counts = doc_e - doc_a + 1
    of = torch.repeat_interleave(torch.arange(a.numel()), counts)  # piece of each segment
    offsets = torch.cumsum(counts, 0) - counts
    doc = doc_a[of] + torch.arange(of.numel()) - offsets[of]
    q_start = torch.maximum(a[of], cu[doc])
    q_end = torch.minimum(e[of], cu[doc + 1])
    k_start = cu[doc]
    q_len, k_len = q_end - q_start, q_end - k_start
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(q_len, 0)])
    cu_k = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(k_len, 0)])
    flat = torch.repeat_interleave(k_start - cu_k[:-1], k_len) + torch.arange(int(cu_k[-1]))
    # global flat row b·T + t -> its row in the gathered order
    where = torch.empty(length, dtype=torch.long)
    where[gathered_order(length, cp)] = torch.arange(length)
    key_rows = flat // length * length + where[flat % length]
    return CPSegments(cu_q.int(), cu_k.int(), key_rows, int(q_len.max()), int(k_len.max()))


@dataclass
class CPState:
    """One model's context-parallel group, and the sequence it is processing (set by `begin`
    before each forward; attention layers read its mask or segments, also when recomputing,
    each built once per forward on first use)."""

    group: Any
    size: int
    rank: int
    positions: Tensor | None = None
    _mask: Tensor | None = None
    _segments: CPSegments | None = None

    def begin(self, position_ids: Tensor) -> Tensor:
        """Take full `position_ids [B, T]`; return this rank's rows' positions."""
        self.positions, self._mask, self._segments = position_ids, None, None
        return shard_rows(position_ids, self.size, self.rank)

    def recompute_context(self) -> tuple[Any, Any]:
        """Activation checkpointing's `context_fn`: the forward runs as it is, and recomputing
        it for the backward sees the sequence (positions, mask, segments) it saw, whatever ran
        in between (a pipeline's other micro-batches); the state is left as it was after."""
        return nullcontext(), self._seeing(self.positions, self._mask, self._segments)

    @contextmanager
    def _seeing(self, positions: Tensor | None, mask: Any, segments: Any) -> Iterator[None]:
        now = self.positions, self._mask, self._segments
        self.positions, self._mask, self._segments = positions, mask, segments
        try:
            yield
        finally:
            self.positions, self._mask, self._segments = now

    @property
    def mask(self) -> Tensor:
        if self._mask is None:
            self._mask = cp_mask(self.positions, self.size, self.rank)
        return self._mask

    @property
    def segments(self) -> CPSegments:
        """The flash kernel's segments (one host copy of the positions per forward)."""
        if self._segments is None:
            device = self.positions.device
            self._segments = cp_segments(self.positions, self.size, self.rank).to(device)
        return self._segments


def row_shard(state: CPState, batch: int, length: int, device=None) -> RowShard:
    """The loss's view of this rank's rows of a `[B, T]` batch (flattened, `global_rows`);
    chunk-level terms sum over the group."""
    rows = global_rows(batch, length, state.size, state.rank, device)

    def all_reduce_sum(x: Tensor) -> Tensor:
        dist.all_reduce(x, group=state.group)
        return x

    return RowShard(rows, batch * length, all_reduce_sum)


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


@torch.compiler.disable  # collectives and host-built segments: outside compiled graphs
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
    from crossdistill.models.attention import compute_dtype, flash_ok, flash_varlen, flat_heads

    state: CPState = module.cp_state
    k = gather_sequence(key, state.group)
    v = gather_sequence(value, state.group)
    dtype = compute_dtype(query)
    if not dropout and flash_ok(query, scaling, dtype):
        b, h, t, d = query.shape
        seg = state.segments
        q = flat_heads(query, dtype)
        k, v = (flat_heads(x, dtype).index_select(0, seg.key_rows) for x in (k, v))
        out = flash_varlen(q, k, v, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, scaling)
        return out.view(b, t, h, d), None
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

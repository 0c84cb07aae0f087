"""How a loss sees a student or teacher that is split over ranks, without knowing about ranks.

`VocabShard`: this rank holds columns `[start, start + size)` of a vocabulary of `total` (tensor
parallelism splits the lm_head along the vocabulary). Softmax statistics are combined with the
reductions it carries: max and sums all-reduced, bucket logits gathered as a sum in which only
the owning rank contributes, top-k as a local top-k followed by a top-k of the gathered
candidates. The full `[N, V]` logits never exist on any rank.

`RowShard`: this rank holds rows `rows` of a flattened batch of `num_rows` rows (context
parallelism splits sequences). Row-local terms need nothing; chunk-level terms, which sum label
log-probs over chunks that can cross shard edges, all-reduce one `[num_rows]` vector.

Both carry plain callables (built in `crossdistill.distributed`), so this package holds no
process group and a single device never pays for them: `None` means "not sharded".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")


@dataclass
class VocabShard:
    """Columns `[start, start + size)` of a `total`-wide vocabulary, and reductions over the
    ranks that hold the other columns: `all_reduce(x, op)` in place with op "sum" or "max",
    `all_gather(x)` -> `[ranks, *x.shape]`."""

    start: int
    size: int
    total: int
    all_reduce: Callable[[Tensor, str], Tensor]
    all_gather: Callable[[Tensor], Tensor]

    def local(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Global ids -> (local column, clamped into range; True where this rank owns the id)."""
        col = ids - self.start
        inside = (col >= 0) & (col < self.size)
        return col.clamp(0, self.size - 1), inside

    def max(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """Row max `[c]` over the whole vocabulary and the (first) global id that attains it."""
        zmax, arg = z.max(1)
        gmax = self.all_reduce(zmax.clone(), "max")
        # the smallest global id among the ranks holding the max: a max of negated ids
        cand = torch.where(zmax == gmax, -(arg + self.start), -(self.total + 1))
        return gmax, -self.all_reduce(cand, "max")

    def sum(self, x: Tensor) -> Tensor:
        return self.all_reduce(x, "sum")

    def gather(self, z: Tensor, ids: Tensor) -> Tensor:
        """`z` at global `ids [c, B]` (each value comes from the one rank that owns it)."""
        col, inside = self.local(ids)
        return self.sum(torch.where(inside, z.gather(1, col), 0.0))

    def scatter_add_(self, out: Tensor, ids: Tensor, values: Tensor) -> Tensor:
        """`out[:, ids] += values` for the ids this rank owns."""
        col, inside = self.local(ids)
        return out.scatter_add_(1, col, torch.where(inside, values, 0.0))

    def topk(self, z: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Top-k values and global ids per row: each rank's top-k, then the top-k of those."""
        vals, ids = z.topk(min(k, z.shape[1]), dim=1)
        all_vals = self.all_gather(vals)  # [R, c, k]
        all_ids = self.all_gather(ids + self.start)
        cat_vals = all_vals.permute(1, 0, 2).flatten(1)
        cat_ids = all_ids.permute(1, 0, 2).flatten(1)
        top, pos = cat_vals.topk(k, dim=1)
        return top, cat_ids.gather(1, pos)

    def tail_mass(self, e: Tensor, ids: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """e at global `ids [c, B]` and Σ e over every token not among a row's `ids` (rows with
        `keep` False count all tokens), summed directly, never as a difference. `e >= 0`."""
        col, inside = self.local(ids)
        e_ids = self.sum(torch.where(inside, e.gather(1, col), 0.0))
        e_local = torch.where(inside, e.gather(1, col), 0.0)
        # zero the owned buckets (a min with 0; +inf leaves other entries alone), sum, restore
        zero = torch.where(inside & keep.unsqueeze(1), 0.0, float("inf")).to(e.dtype)
        e.scatter_reduce_(1, col, zero, reduce="amin")
        s_tail = self.sum(e.sum(1))
        e.scatter_reduce_(1, col, e_local, reduce="amax")
        return e_ids, s_tail

    def logsumexp(self, z: Tensor) -> Tensor:
        zmax, _ = self.max(z)
        return zmax + self.sum((z - zmax.unsqueeze(1)).exp().sum(1)).log()


@dataclass
class RowShard:
    """This rank holds rows `rows [n]` of a flattened batch of `num_rows` rows; `all_reduce_sum`
    sums a tensor over the ranks holding the other rows."""

    rows: Tensor
    num_rows: int
    all_reduce_sum: Callable[[Tensor], Tensor]

    def owned(self) -> Tensor:
        """`[num_rows]` bool: the rows this rank holds."""
        mask = torch.zeros(self.num_rows, dtype=torch.bool, device=self.rows.device)
        mask[self.rows] = True
        return mask

    def to_global(self, local: Tensor) -> Tensor:
        """`[n]` values of this rank's rows -> `[num_rows]` values of all rows (summed over
        ranks; each row is held by exactly one rank)."""
        full = torch.zeros(self.num_rows, dtype=local.dtype, device=local.device)
        full[self.rows] = local
        return self.all_reduce_sum(full)

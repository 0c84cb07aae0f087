"""The vocabulary-wide passes of a part with token-group buckets (the `prefix` and
`lookahead_prefix` targets) in the fused student pass: a Triton kernel on CUDA, each with a
plain PyTorch counterpart, its reference, which also runs where Triton is missing.

A grouped part's bucket b holds every student token j whose event `events[j]` is the bucket's
event; a row holds at most G groups (`row_events [c, G]`, −1 for an empty slot), none of which
holds one of the row's single-token buckets (`lookahead._with_groups`).

1. `group_stats`: per row and group, `E_b = Σ_{j∈b} e_j` with `e = e^{(z − max)/τ}`, and the
   part's tail: the same sum over every token in none of the row's groups and none of its single
   buckets (read from the part's bucket bitmask, as `kernels.row_stats` does: exact, no `S − Σ`).
2. `group_grad`: `kernels.logit_grad`'s `Σ_τ e^{(z−max)/τ} · coef[:, τ]` plus, per grouped part,
   `e^{(z−max)/τ_p} · B_p[row, slot(j)]` at every token of one of the row's groups: a group's
   correction shared by its tokens in proportion to their e (`chunk_math.group_coefficients`).
3. `group_coef_at`: that second sum at a few ids per row (`[c, F]`), for the exact values the
   fused pass writes at its bucket and label ids.

On CUDA the group sums read each group's member list (its tokens, from `events` sorted once
per chunk: a fixed order, no atomics), and the tail and gradient passes, one read of the row's
logits each, find every column's slot in a per-row slot table `[c, num_events + 1]` (int8 up
to 127 groups a row).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from crossdistill.losses.kernels import BLOCK_GRAD, SPAN, _in_buckets, _small, available

BLOCK_TAIL = 2048


@dataclass
class GroupRows:
    """One grouped part on a chunk: `events [V]` int32, each student token's event in
    `[0, num_events]` (`num_events`: none, a token no group holds); `row_events [c, G]` int32,
    the row's group events (−1: none); `inv_tau`, its temperature's inverse; `coef [c, G]`, the
    groups' gradient coefficients (set once the loss of the part is known); `table`, the
    kernels' slot table (`slot_table`)."""

    events: Tensor
    row_events: Tensor
    num_events: int
    inv_tau: float
    coef: Tensor | None = None
    table: Tensor | None = None


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def sums(
        z_ptr, stride_z, zmax_ptr, inv_tau, rev_ptr, offsets_ptr, members_ptr, out_ptr,
        G: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # program (slot, row): the e-mass of the slot's group, over its member list (the
        # programs of one row run together, so its logits are read from L2 once)
        slot = tl.program_id(0)
        row = tl.program_id(1)
        ev = tl.load(rev_ptr + row * G + slot)
        # an empty slot (ev −1) reads [lo, lo): no members (two scalar loads, no select)
        lo = tl.load(offsets_ptr + tl.maximum(ev, 0))
        hi = tl.load(offsets_ptr + tl.maximum(ev, 0) + (ev >= 0).to(tl.int32))
        m = tl.load(zmax_ptr + row)
        z_row = z_ptr + row.to(tl.int64) * stride_z
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(lo, hi, BLOCK):
            at = start + tl.arange(0, BLOCK)
            cols = tl.load(members_ptr + at, mask=at < hi, other=0)
            x = tl.load(z_row + cols, mask=at < hi, other=float("-inf")).to(tl.float32)
            acc += tl.exp((x - m) * inv_tau)
        tl.store(out_ptr + row * G + slot, tl.sum(acc, 0))

    @triton.jit
    def tail(
        z_ptr, stride_z, vocab, span, zmax_ptr, inv_tau, ev_ptr, table_ptr, stride_t,
        bits_ptr, stride_bits, out_ptr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # program (row, part): e-mass of the columns in [part·span, (part+1)·span) that are in
        # none of the row's groups (slot table −1) and none of its single buckets
        row = tl.program_id(0)
        part = tl.program_id(1)
        lo = part * span
        hi = tl.minimum(lo + span, vocab)
        m = tl.load(zmax_ptr + row)
        z_row = z_ptr + row.to(tl.int64) * stride_z
        t_row = table_ptr + row.to(tl.int64) * stride_t
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < hi
            x = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
            ev = tl.load(ev_ptr + cols, mask=inside, other=0)
            slot = tl.load(t_row + ev, mask=inside, other=-1)
            word = tl.load(bits_ptr + row * stride_bits + cols // 32, mask=inside, other=0)
            single = ((word >> (cols % 32)) & 1) != 0
            keep = (slot < 0) & ~single
            acc += tl.where(keep, tl.exp((x - m) * inv_tau), 0.0)
        tl.store(out_ptr + row * tl.num_programs(1) + part, tl.sum(acc, 0))

    @triton.jit
    def grad(
        z_ptr, stride_z, g_ptr, stride_g, vocab, max_ptr, inv_tau_ptr, coef_ptr,
        ev_ptr, stride_ev, table_ptr, stride_tp, stride_t, b_ptr, stride_bp, ptau_ptr,
        T: tl.constexpr, P: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        m = tl.load(max_ptr + row)
        x = tl.load(z_ptr + row.to(tl.int64) * stride_z + cols, mask=inside, other=float("-inf"))
        x = x.to(tl.float32)
        g = tl.zeros([BLOCK], dtype=tl.float32)
        for t in tl.static_range(T):  # one exp per element and temperature in use
            g += tl.exp((x - m) * tl.load(inv_tau_ptr + t)) * tl.load(coef_ptr + row * T + t)
        for p in tl.static_range(P):  # one more per grouped part where the column is in a group
            ev = tl.load(ev_ptr + p * stride_ev + cols, mask=inside, other=0)
            t_row = table_ptr + p * stride_tp + row.to(tl.int64) * stride_t
            slot = tl.load(t_row + ev, mask=inside, other=-1)
            hit = slot >= 0
            b = tl.load(b_ptr + p * stride_bp + row * G + slot, mask=hit, other=0.0)
            g += tl.where(hit, tl.exp((x - m) * tl.load(ptau_ptr + p)) * b, 0.0)
        g_row = g_ptr + row.to(tl.int64) * stride_g
        tl.store(g_row + cols, g.to(g_ptr.dtype.element_ty), mask=inside)

    return triton, sums, tail, grad


def slot_table(rows: GroupRows) -> Tensor:
    """`[c, num_events + 1]` int8 (wider past 127 groups a row): each row's slot of every event, −1 for the events it has no
    group of (the last column, tokens of no event, always −1). Made once per chunk and part,
    kept on `rows` for the gradient pass."""
    if rows.table is None:
        c, g = rows.row_events.shape
        ev = rows.row_events.long()
        dtype = torch.int8 if g < 2**7 else torch.int16 if g < 2**15 else torch.int32
        table = torch.full((c, rows.num_events + 1), -1, dtype=dtype, device=ev.device)
        slots = torch.arange(g, dtype=dtype, device=ev.device).expand(c, -1)
        rows.table = table.scatter_(1, torch.where(ev >= 0, ev, rows.num_events), slots)
        rows.table[:, rows.num_events] = -1
    return rows.table


def member_lists(rows: GroupRows) -> tuple[Tensor, Tensor]:
    """Every event's student tokens, as offsets `[num_events + 2]` into `members [V]` (tokens
    sorted by event): the groups' member lists, made from `events` without a host sync."""
    events = rows.events.long()
    members = torch.sort(events, stable=True).indices.int()
    counts = torch.zeros(rows.num_events + 2, dtype=torch.long, device=events.device)
    counts.scatter_add_(0, events + 1, torch.ones_like(events))
    return counts.cumsum(0).int(), members


def _acc(z: Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def group_stats(
    z: Tensor, zmax: Tensor, rows: GroupRows, single_bits: Tensor
) -> tuple[Tensor, Tensor]:
    """(`E [c, G]`, tail `[c]`) of one grouped part (module docstring); `single_bits`: the
    part's single-token buckets as `kernels.bucket_bits` words."""
    if z.is_cuda and available() and z.dtype != torch.float64:
        return group_stats_triton(z, zmax, rows, single_bits)
    return group_stats_torch(z, zmax, rows, single_bits)


def group_stats_triton(
    z: Tensor, zmax: Tensor, rows: GroupRows, single_bits: Tensor, rows_per_launch: int = 65535
) -> tuple[Tensor, Tensor]:
    """`group_stats` through the Triton kernels: group sums over their member lists, the tail
    in one pass over the row with the slot table. The sums' grid has the rows on its second
    axis, which CUDA caps at 65,535: larger chunks take several launches of `rows_per_launch`."""
    triton, sums_k, tail_k, _ = _kernels()
    c, vocab = z.shape
    g = rows.row_events.shape[1]
    zmax = zmax.float().contiguous()
    rev = rows.row_events.contiguous()
    offsets, members = member_lists(rows)
    sums = torch.empty(c, g, dtype=torch.float32, device=z.device)
    for r0 in range(0, c, rows_per_launch):
        r = slice(r0, min(c, r0 + rows_per_launch))
        sums_k[(g, r.stop - r.start)](
            z[r], z.stride(0), zmax[r], rows.inv_tau, rev[r], offsets, members, sums[r],
            G=g, BLOCK=128, num_warps=4,
        )  # fmt: skip
    table = slot_table(rows)
    parts = triton.cdiv(vocab, SPAN)
    span = triton.cdiv(triton.cdiv(vocab, parts), BLOCK_TAIL) * BLOCK_TAIL
    tail = torch.empty(c, parts, dtype=torch.float32, device=z.device)
    tail_k[(c, parts)](
        z, z.stride(0), vocab, span, zmax, rows.inv_tau, rows.events, table, table.stride(0),
        single_bits, single_bits.stride(0), tail, BLOCK=BLOCK_TAIL, num_warps=8,
    )  # fmt: skip
    return sums, tail.sum(1)


def _slot_table(rows: GroupRows, values: Tensor, num: int) -> Tensor:
    """`[c, num + 1]`: `values [c, G]` at each row's group events, 0 at every other event (and
    at the spare last column, where the empty slots write)."""
    ev = rows.row_events.long()
    table = torch.zeros(ev.shape[0], num + 1, dtype=values.dtype, device=values.device)
    return table.scatter_(1, torch.where(ev >= 0, ev, num), values.masked_fill(ev < 0, 0))


def group_stats_torch(
    z: Tensor, zmax: Tensor, rows: GroupRows, single_bits: Tensor
) -> tuple[Tensor, Tensor]:
    """`group_stats` in plain PyTorch (the kernel's reference, and its stand-in without Triton)."""
    acc = _acc(z)
    e = ((z.to(acc) - zmax.to(acc).unsqueeze(1)) * rows.inv_tau).exp()
    events = rows.events.long().clamp(min=0).expand(e.shape[0], -1)
    num = rows.num_events + 1
    mass = torch.zeros(e.shape[0], num + 1, dtype=acc, device=e.device).scatter_add_(1, events, e)
    ev = rows.row_events.long()
    sums = torch.where(ev >= 0, mass.gather(1, ev.clamp(min=0)), 0.0)
    member = _slot_table(rows, torch.ones_like(ev, dtype=torch.bool), num).gather(1, events)
    single = _in_buckets(single_bits, z.shape[1])
    return sums, e.masked_fill(member | single, 0.0).sum(1)


def group_grad(
    z: Tensor, zmax: Tensor, taus: list[float], coef: Tensor, groups: list[GroupRows], dtype
) -> Tensor:
    """`kernels.logit_grad` plus every grouped part's group coefficients (module docstring), in
    `dtype`, written over `z` when that is its dtype."""
    if z.is_cuda and available() and z.dtype != torch.float64:
        return group_grad_triton(z, zmax, taus, coef, groups, dtype)
    return group_grad_torch(z, zmax, taus, coef, groups, dtype)


def group_grad_triton(
    z: Tensor, zmax: Tensor, taus: list[float], coef: Tensor, groups: list[GroupRows], dtype
) -> Tensor:
    """`group_grad` through the Triton kernel: per column and grouped part, its slot from the
    part's slot table and that slot's coefficient."""
    triton, _, _, grad = _kernels()
    c, vocab = z.shape
    g = max(r.row_events.shape[1] for r in groups)
    width = max(r.num_events for r in groups) + 1

    def padded(t: Tensor, size: int, fill) -> Tensor:
        extra = size - t.shape[1]
        return torch.nn.functional.pad(t, (0, extra), value=fill) if extra else t

    tables = [slot_table(r) for r in groups]
    wide = max(tables, key=lambda t: t.element_size()).dtype
    events = _stacked([r.events for r in groups])  # one part (the usual case): views, no copy
    table = _stacked([padded(t.to(wide), width, -1) for t in tables])
    b = _stacked([padded(r.coef.float(), g, 0.0) for r in groups])
    ptau = _small([r.inv_tau for r in groups], torch.float32, z.device)
    inv_tau = _small([1.0 / t for t in taus], torch.float32, z.device)
    out = z if z.dtype == dtype else torch.empty(c, vocab, dtype=dtype, device=z.device)
    grid = (c, triton.cdiv(vocab, BLOCK_GRAD))
    grad[grid](
        z, z.stride(0), out, out.stride(0), vocab, zmax.float().contiguous(), inv_tau,
        coef.float().contiguous(), events, events.stride(0), table, table.stride(0),
        table.stride(1), b, b.stride(0), ptau,
        T=len(taus), P=len(groups), G=g, BLOCK=BLOCK_GRAD, num_warps=8,
    )  # fmt: skip
    return out


def _stacked(parts: list[Tensor]) -> Tensor:
    """The parts stacked on a new first dimension; a single part as a view of itself."""
    return parts[0].unsqueeze(0) if len(parts) == 1 else torch.stack(parts)


def group_grad_torch(
    z: Tensor, zmax: Tensor, taus: list[float], coef: Tensor, groups: list[GroupRows], dtype
) -> Tensor:
    """`group_grad` in plain PyTorch."""
    shifted = z.to(coef.dtype) - zmax.to(coef.dtype).unsqueeze(1)
    out = sum(((shifted / tau).exp() * coef[:, t : t + 1] for t, tau in enumerate(taus)), 0.0)
    for rows in groups:
        table = _slot_table(rows, rows.coef.to(coef.dtype), rows.num_events + 1)
        per_token = table.gather(1, rows.events.long().clamp(min=0).expand(z.shape[0], -1))
        out = out + (shifted * rows.inv_tau).exp() * per_token
    return z.copy_(out) if z.dtype == dtype else out.to(dtype)


def group_coef_at(ids: Tensor, z_ids: Tensor, zmax: Tensor, groups: list[GroupRows]) -> Tensor:
    """Σ over grouped parts of `e^{(z−max)/τ_p} · B_p[slot]` at `ids [c, F]` (logits `z_ids`,
    float): 0 at an id in none of the row's groups."""
    out = torch.zeros_like(z_ids)
    shifted = z_ids - zmax.to(z_ids.dtype).unsqueeze(1)
    for rows in groups:  # each id's slot from the table the kernels use
        slot = slot_table(rows).gather(1, rows.events.long()[ids]).long()  # [c, F], −1: none
        b = rows.coef.to(z_ids.dtype).gather(1, slot.clamp(min=0))
        out = out + torch.where(slot >= 0, (shifted * rows.inv_tau).exp() * b, 0.0)
    return out

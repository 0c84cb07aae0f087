"""The loss of one chunk of rows and its gradient w.r.t. the logits, from a `[c, V]` block of
logits: the math every pass of the student loss shares (the chunk driver in `chunked.py`, its
vocabulary-sharded variant in `sharded.py`).

The gradient w.r.t. logits comes from the bucket view of every KD loss. With `e = exp(u − max)`,
`u = z/τ`, `S = Σ e`, a bucket of token set b has `log P_b = log Σ_{j∈b} e_j − log S`, so for a
loss D with `h_b = ∂D/∂log P_b` (closed form, `divergences.bucket_terms`):

    ∂D/∂u_j = h_{b(j)} · e_j / E_{b(j)} − e_j · Σ_b h_b / S

For a single-token bucket `e_j / E_b = 1`; for the tail bucket `E_b` is the tail's e-mass, summed
directly over the non-bucket tokens (never `S − Σ`, which cancels). The whole block is therefore
`e · A_row` plus a scatter of K corrections per row, one elementwise pass over `[c, V_s]`.

`chunk_step` makes that pass with PyTorch (about ten passes over the block);
`chunk_step_fused` does the vocabulary-wide work in two kernels (`kernels.row_stats`,
`kernels.logit_grad`) and the rest with the same small-tensor code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from crossdistill.losses.divergences import bucket_terms
from crossdistill.losses.group_kernels import GroupRows, group_coef_at, group_grad, group_stats
from crossdistill.losses.kernels import bucket_bits, logit_grad, row_stats
from crossdistill.losses.plan import Part, Plan
from crossdistill.losses.sharding import VocabShard

NEG_INF = float("-inf")


def _tail_mass(
    e: Tensor, ids: Tensor, valid: Tensor | None, shard: VocabShard | None = None
) -> tuple[Tensor, Tensor]:
    """e at `ids` and the e-mass of all other tokens, by zeroing the buckets in place, summing and
    restoring them (exact; rows with no bucket write their filler id's own value back)."""
    if shard is not None:
        keep = torch.ones_like(ids[:, 0], dtype=torch.bool) if valid is None else valid.any(1)
        return shard.tail_mass(e, ids, keep)
    e_ids = e.gather(1, ids)
    if valid is None:
        hold = torch.zeros_like(e_ids)
    else:
        hold = torch.where(valid.any(1, keepdim=True), 0.0, e_ids)
    e.scatter_(1, ids, hold)
    s_tail = e.sum(1)
    e.scatter_(1, ids, e_ids)
    return e_ids, s_tail


def finish_tail(part: Part, sl: slice, ids: Tensor, s_tail: Tensor, vocab: int) -> Tensor:
    """The tail's e-mass as the loss uses it: exactly 0 when the buckets cover the vocabulary
    (of a grouped part: its groups cover every event), else floored at the smallest normal
    number so that its log stays finite."""
    s_tail = s_tail.clamp(min=torch.finfo(s_tail.dtype).tiny)
    g = part.group_from
    if part.valid is not None:
        return torch.where(part.valid[sl, g:].sum(1) == vocab, 0.0, s_tail)
    return torch.zeros_like(s_tail) if ids.shape[1] - g == vocab else s_tail


def part_step(
    part: Part,
    sl: slice,
    z_sel: Tensor,
    e_ids: Tensor | None,
    s: Tensor,
    s_tail: Tensor | None,
    lse_u: Tensor,
    tau: float,
    weight: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """One bucket divergence on a chunk, from the logits at its buckets `z_sel [c, B]`, their
    `e` values, the row sums `s` and the tail mass `s_tail` (for parts with a tail): per-row
    values `[c]` (not weighted: `weighted_sum` weighs them for the loss and for the reported
    metric alike), the row coefficient of `e` `[c]`, and corrections `[c, B]` to add at the ids.
    Rows of weight 0 get no gradient (a zero-weight term still reports its value)."""
    valid = None if part.valid is None else part.valid[sl]
    logp = z_sel / tau - lse_u.unsqueeze(1)
    if valid is not None:
        logp = torch.where(valid, logp, NEG_INF)
    logq = part.logq[sl]
    coef_tail = None
    if s_tail is not None:
        logp_tail = s_tail.log() - s.log()
        terms, h = bucket_terms(
            part.divergence,
            torch.cat([logq, part.logq_tail[sl].unsqueeze(1)], 1),
            torch.cat([logp, logp_tail.unsqueeze(1)], 1),
            **part.params,
        )
        h, h_tail = h[:, :-1], h[:, -1]
        coef_tail = torch.where(s_tail > 0, h_tail / torch.where(s_tail > 0, s_tail, 1.0), 0.0)
    else:
        terms, h = bucket_terms(part.divergence, logq, logp, **part.params)
        h_tail = torch.zeros_like(s)
    if valid is not None:
        h = torch.where(valid, h, 0.0)
    live = weight != 0
    g = weight * (1.0 / tau)
    total_h = h.sum(1) + h_tail
    a = g * (-total_h / s if coef_tail is None else coef_tail - total_h / s)
    corr = h if coef_tail is None else h - e_ids * coef_tail.unsqueeze(1)
    corr = torch.where(live.unsqueeze(1), g.unsqueeze(1) * corr, 0.0)
    if valid is not None:
        corr = torch.where(valid, corr, 0.0)
    return terms.sum(1), torch.where(live, a, 0.0), corr


def group_sums(
    e: Tensor, part: Part, sl: slice, ids: Tensor, zmax: Tensor, tau: float, z_single: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A grouped part's buckets on a chunk: the e-mass of every event (`[c, G + 1]`, the last
    column the tokens of no event) without the row's single-token buckets (the first
    `group_from`, whose logits are `z_single`), the stand-in logits `τ·log E_b + max` at the
    group buckets that make `part_step` read `log P_b = log E_b − log S`, every bucket's e-mass
    and the tail's."""
    index = part.groups.expand(e.shape[0], -1)
    width, g = part.num_events + 1, part.group_from
    valid = None if part.valid is None else part.valid[sl]
    singles = ids[:, :g]
    e_single = e.gather(1, singles)
    if g:  # the singles leave their groups: zeroed while summing, then restored
        e.scatter_(1, singles, _held(e_single, valid, g))
    mass = torch.zeros(e.shape[0], width, dtype=e.dtype, device=e.device)
    mass.scatter_add_(1, index, e)
    if g:
        e.scatter_(1, singles, e_single)
    e_groups, s_tail = _tail_mass(mass, ids[:, g:], None if valid is None else valid[:, g:])
    s_tail = finish_tail(part, sl, ids, s_tail, width)
    tiny = torch.finfo(e.dtype).tiny
    z_groups = tau * e_groups.clamp(min=tiny).log() + zmax.unsqueeze(1)
    return torch.cat([z_single, z_groups], 1), torch.cat([e_single, e_groups], 1), s_tail, index


def _held(values: Tensor, valid: Tensor | None, g: int) -> Tensor:
    """What to write at a row's single-token ids to take them out of the groups' sums: 0, or
    their own values in a row with no valid single (its filler ids are id 0, not a bucket)."""
    if valid is None:
        return torch.zeros_like(values)
    return torch.where(valid[:, :g].any(1, keepdim=True), 0.0, values)


def group_coefficients(
    corr: Tensor, e_ids: Tensor, ids: Tensor, index: Tensor, part: Part
) -> Tensor:
    """`part_step`'s corrections of a grouped part's group buckets as a coefficient of every
    token's e `[c, V]`: a bucket's correction is shared by its tokens in proportion to their e
    (`corr · e_j / E_b`). The row's single-token buckets (the first `group_from`) are in none
    of its groups (`lookahead._with_groups`), so they get none."""
    g = part.group_from
    corr, e_ids, groups = corr[:, g:], e_ids[:, g:], ids[:, g:]
    per_mass = torch.where(e_ids > 0, corr / torch.where(e_ids > 0, e_ids, 1.0), 0.0)
    table = torch.zeros(corr.shape[0], part.num_events + 1, dtype=corr.dtype, device=corr.device)
    return table.scatter_add_(1, groups, per_mass).gather(1, index)


def weighted_sum(rows: Tensor, weight: Tensor) -> Tensor:
    """Σ rows · weight over the rows of nonzero weight: a row of weight 0 (no KD position)
    adds exactly 0, whatever its value."""
    return torch.where(weight != 0, rows * weight, 0.0).sum()


def select(
    z: Tensor, part: Part, sl: slice, shard: VocabShard | None = None
) -> tuple[Tensor, Tensor]:
    """Logits at the part's buckets, or the student's own top-k (skipping `exclude`). Buckets of
    token groups have no single logit: a grouped part gets those of its single-token buckets
    only, and `group_sums` gives the groups' mass."""
    if part.groups is not None:
        ids = part.ids[sl]
        return z.gather(1, ids[:, : part.group_from]), ids
    if shard is not None:
        return _select_sharded(z, part, sl, shard)
    if part.ids is not None:
        ids = part.ids[sl]
        return z.gather(1, ids), ids
    source = z if part.exclude is None else z.masked_fill(part.exclude, NEG_INF)
    return source.topk(min(part.logq.shape[1], z.shape[1]), dim=1)


def _select_sharded(z: Tensor, part: Part, sl: slice, shard: VocabShard) -> tuple[Tensor, Tensor]:
    """`select` on this rank's vocabulary columns; ids and top-k are over the whole vocabulary."""
    if part.ids is not None:
        ids = part.ids[sl]
        return shard.gather(z, ids), ids
    cols = slice(shard.start, shard.start + shard.size)
    source = z if part.exclude is None else z.masked_fill(part.exclude[cols], NEG_INF)
    return shard.topk(source, min(part.logq.shape[1], shard.total))


def chunk_step(
    z: Tensor,
    sl: slice,
    plan: Plan,
    label_coef: Tensor,
    want_grad: bool,
    shard: VocabShard | None = None,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor]:
    """Loss and logit gradient of one chunk. `z [c, V]` is consumed: it becomes the gradient.
    Returns (grad or None, loss, per-term weighted sums `[T]`, label log-probs `[c]`, argmax).
    `shard`: `z` holds this rank's vocabulary columns; row statistics (max, sums, bucket
    logits, top-k) are combined across ranks and the gradient returned is this rank's columns."""
    zmax, argmax = z.max(1) if shard is None else shard.max(z)
    labels = plan.labels[sl]
    labels0 = labels.clamp(min=0).unsqueeze(1)
    z_label = (z.gather(1, labels0) if shard is None else shard.gather(z, labels0)).squeeze(1)
    picked = [[select(z, p, sl, shard) for p in t.parts] for t in plan.terms]
    term_sums = torch.zeros(len(plan.terms), dtype=z.dtype, device=z.device)
    loss = torch.zeros((), dtype=z.dtype, device=z.device)
    out = None
    for tau in [t for t in plan.temperatures if t != 1.0] + [1.0]:
        last = tau == 1.0
        shifted = z.sub_(zmax.unsqueeze(1)) if last else torch.sub(z, zmax.unsqueeze(1))
        e = shifted.exp_() if last else shifted.div_(tau).exp_()  # [c, V]
        s = e.sum(1) if shard is None else shard.sum(e.sum(1))
        lse_u = zmax / tau + s.log()
        row_coef = torch.zeros_like(s)
        fixes: list[tuple[Tensor, Tensor]] = []
        dense = None  # [c, V] coefficients of e from grouped parts
        for ti, term in enumerate(plan.terms):
            if term.temperature != tau:
                continue
            weight = term.row_weight[sl]
            for part, (z_sel, ids) in zip(term.parts, picked[ti]):
                e_ids = s_tail = index = None
                if part.groups is not None:
                    z_sel, e_ids, s_tail, index = group_sums(e, part, sl, ids, zmax, tau, z_sel)
                elif part.logq_tail is not None:
                    e_ids, s_tail = _tail_mass(
                        e, ids, None if part.valid is None else part.valid[sl], shard
                    )
                    width = e.shape[1] if shard is None else shard.total
                    s_tail = finish_tail(part, sl, ids, s_tail, width)
                w = weight * part.scale
                rows, a, corr = part_step(part, sl, z_sel, e_ids, s, s_tail, lse_u, tau, w)
                term_sums[ti] += weighted_sum(rows, term.report_weight[sl] * part.scale)
                loss = loss + weighted_sum(rows, w)
                row_coef += a
                if index is None:
                    fixes.append((ids, corr))
                elif want_grad:
                    g = part.group_from
                    fixes.append((ids[:, :g], corr[:, :g]))
                    add = group_coefficients(corr, e_ids, ids, index, part)
                    dense = add if dense is None else dense.add_(add)
        if last:
            loss, logp_label = label_terms(plan, sl, z_label - lse_u, loss)
            row_coef += label_coef / s
            fixes.append((labels0, -label_coef.unsqueeze(1)))
        if want_grad:
            factor = row_coef.unsqueeze(1) if dense is None else dense.add_(row_coef.unsqueeze(1))
            if out is None:
                out = e.mul_(factor)
            elif last:
                out = e.mul_(factor).add_(out)
            else:
                out.addcmul_(e, factor)
            for ids, corr in fixes:
                if shard is None:
                    out.scatter_add_(1, ids, corr)
                else:
                    shard.scatter_add_(out, ids, corr)
        del e, shifted
    return out, loss, term_sums, logp_label, argmax


def label_terms(plan: Plan, sl: slice, logp: Tensor, loss: Tensor) -> tuple[Tensor, Tensor]:
    """CE on the chunk's labels: (loss with CE added, label log-probs `[c]`, 0 where unlabeled).
    Its gradient is `coef · (softmax − onehot(label))`: `coef / s` on every `e`, `−coef` at the
    label (chunk-likelihood terms fold into the same coefficient)."""
    logp_label = torch.where(plan.labels[sl] >= 0, logp, 0.0)
    return loss - (logp_label * plan.ce_weight[sl]).sum(), logp_label


def chunk_step_fused(
    z: Tensor, sl: slice, plan: Plan, label_coef: Tensor, want_grad: bool, grad_dtype
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor]:
    """`chunked.chunk_step` with the vocabulary-wide passes in kernels. `z [c, V]` is in the
    matmul dtype (bf16 logits, as a plain bf16 lm_head gives them; all softmax math is float32)
    and is consumed: the gradient is written over it when `grad_dtype` is its dtype. A part
    with token-group buckets takes its groups' and tail's mass from `group_kernels.group_stats`
    and its groups' gradient from `group_kernels.group_grad`."""
    vocab = z.shape[1]
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    labels0 = plan.labels[sl].clamp(min=0).unsqueeze(1)
    z_label = z.gather(1, labels0).squeeze(1).to(acc)
    picked = [[select(z, p, sl) for p in t.parts] for t in plan.terms]
    picked = [[(v.to(acc), ids) for v, ids in row] for row in picked]
    taus = [1.0] + [t for t in plan.temperatures if t != 1.0]
    masks, mask_tau, tails, grouped = [], [], {}, {}
    for ti, term in enumerate(plan.terms):
        for pi, (part, (_, ids)) in enumerate(zip(term.parts, picked[ti])):
            valid = None if part.valid is None else part.valid[sl]
            if part.groups is not None:
                grouped[ti, pi] = _group_rows(part, ids, valid, term.temperature, vocab)
            elif part.logq_tail is not None:
                tails[ti, pi] = len(masks)
                masks.append(bucket_bits(ids, valid, vocab))
                mask_tau.append(taus.index(term.temperature))
    zmax, argmax, s_all, tail_all = row_stats(z, taus, masks, mask_tau)
    coef = torch.zeros_like(s_all)
    term_sums = torch.zeros(len(plan.terms), dtype=acc, device=z.device)
    loss = torch.zeros((), dtype=acc, device=z.device)
    fixes: list[tuple[Tensor, Tensor]] = []
    for ti, term in enumerate(plan.terms):
        if not term.parts:  # chunk likelihood: folded into the label coefficient
            continue
        tau, t = term.temperature, taus.index(term.temperature)
        s, weight = s_all[:, t], term.row_weight[sl]
        lse_u = zmax / tau + s.log()
        for pi, (part, (z_sel, ids)) in enumerate(zip(term.parts, picked[ti])):
            e_ids = ((z_sel - zmax.unsqueeze(1)) / tau).exp()
            s_tail = None
            if (ti, pi) in grouped:
                rows, bits = grouped[ti, pi]
                e_groups, s_tail = group_stats(z, zmax, rows, bits)
                tiny = torch.finfo(acc).tiny
                z_groups = tau * e_groups.to(acc).clamp(min=tiny).log() + zmax.unsqueeze(1)
                z_sel = torch.cat([z_sel, z_groups], 1)
                e_ids = torch.cat([e_ids, e_groups.to(acc)], 1)
                s_tail = finish_tail(part, sl, ids, s_tail.to(acc), part.num_events + 1)
            elif (ti, pi) in tails:
                s_tail = finish_tail(part, sl, ids, tail_all[:, tails[ti, pi]], vocab)
            w = weight * part.scale
            rows_d, a, corr = part_step(part, sl, z_sel, e_ids, s, s_tail, lse_u, tau, w)
            term_sums[ti] += weighted_sum(rows_d, term.report_weight[sl] * part.scale)
            loss = loss + weighted_sum(rows_d, w)
            coef[:, t] += a
            if (ti, pi) in grouped:
                g = part.group_from
                fixes.append((ids[:, :g], corr[:, :g]))
                e_g, corr_g = e_ids[:, g:], corr[:, g:]
                rows.coef = torch.where(e_g > 0, corr_g / torch.where(e_g > 0, e_g, 1.0), 0.0)
            else:
                fixes.append((ids, corr))
    s1 = s_all[:, 0]
    loss, logp_label = label_terms(plan, sl, z_label - zmax - s1.log(), loss)
    coef[:, 0] += label_coef / s1
    fixes.append((labels0, -label_coef.unsqueeze(1)))
    if not want_grad:
        return None, loss, term_sums, logp_label, argmax
    groups = [rows for rows, _ in grouped.values()]
    # reads z: before the gradient is written over it
    ids, exact = exact_at_ids(z, zmax, taus, coef, fixes, groups)
    if groups:
        out = group_grad(z, zmax, taus, coef, groups, grad_dtype)
    else:
        out = logit_grad(z, zmax, taus, coef, grad_dtype)
    out.scatter_(1, ids, exact.to(out.dtype))  # equal values for equal ids
    return out, loss, term_sums, logp_label, argmax


def _group_rows(
    part: Part, ids: Tensor, valid: Tensor | None, tau: float, vocab: int
) -> tuple[GroupRows, Tensor]:
    """A grouped part's groups on a chunk (`group_kernels.GroupRows`) and the bitmask of its
    single-token buckets (the first `group_from`), which its tail leaves out."""
    g = part.group_from
    events = ids[:, g:]
    if valid is not None:
        events = torch.where(valid[:, g:], events, -1)
    rows = GroupRows(part.groups.int(), events.int(), part.num_events, 1.0 / tau)
    singles = ids[:, :g]
    return rows, bucket_bits(singles, None if valid is None else valid[:, :g], vocab)


def exact_at_ids(
    z: Tensor, zmax: Tensor, taus: list[float], coef: Tensor, fixes, groups=()
) -> tuple[Tensor, Tensor]:
    """The corrected gradient at every bucket and label id, `[c, F]` ids and float32 values:
    base `Σ_τ e·coef` (with the coefficients of the `groups` an id is in) plus all corrections
    at that id, to be written with a single rounding (adding a correction such as CE's `−1`
    into an already rounded bf16 value would lose the small difference that remains)."""
    ids = torch.cat([i for i, _ in fixes], 1)  # [c, F]
    corr = torch.cat([v for _, v in fixes], 1).to(coef.dtype)
    ids, order = ids.sort(1)
    corr = corr.gather(1, order)
    prev = torch.nn.functional.pad(ids[:, :-1], (1, 0), value=-1)
    slot = torch.cumsum((ids != prev).long(), 1) - 1  # one slot per distinct id of the row
    total = torch.zeros_like(corr).scatter_add_(1, slot, corr).gather(1, slot)
    z_ids = z.gather(1, ids).to(coef.dtype)
    shifted = z_ids - zmax.unsqueeze(1)
    base = sum(((shifted / tau).exp() * coef[:, t : t + 1] for t, tau in enumerate(taus)), 0.0)
    if groups:
        base = base + group_coef_at(ids, z_ids, zmax, groups)
    return ids, base + total

"""The plain PyTorch reference: full `[N, V_s]` logits, log-softmax, the public divergence
functions, autograd for every gradient. It is what the chunked pass is tested against, and the
"naive" baseline of `crossdistill bench loss`. It needs memory for several `[N, V_s]` tensors."""

from __future__ import annotations

import torch
from torch import Tensor

from crossdistill.losses import divergences as div
from crossdistill.losses.chunked import accumulate_dtype, compute_dtype
from crossdistill.losses.plan import Part, Plan, chunk_logl_s

NEG_INF = float("-inf")
_BUCKET_FNS = {
    "forward_kl": div.forward_kl,
    "reverse_kl": div.reverse_kl,
    "jsd": div.jsd,
    "skew_kl": div.skew_kl,
    "tvd": div.tvd,
}


def _tail(logp: Tensor, ids: Tensor, valid: Tensor | None) -> Tensor:
    """log of the probability of every token outside the row's buckets `[N]`."""
    hits = torch.zeros_like(logp).scatter_add_(
        1, ids, torch.ones_like(ids, dtype=logp.dtype) if valid is None else valid.to(logp.dtype)
    )
    rest = logp.masked_fill(hits > 0, NEG_INF)
    empty = (hits == 0).sum(1) == 0
    # an empty row would give logsumexp a NaN gradient: give it a finite stand-in and drop it
    rest = torch.where(empty.unsqueeze(1), 0.0, rest)
    return torch.where(empty, NEG_INF, torch.logsumexp(rest, 1))


def _part_loss(part: Part, logp: Tensor, weight: Tensor) -> Tensor:
    if part.ids is None:  # the student's own top-k (sorted-probability L1)
        source = logp if part.exclude is None else logp.masked_fill(part.exclude, NEG_INF)
        top, ids = source.topk(min(part.logq.shape[1], logp.shape[1]), dim=1)
        tail_s = None if part.logq_tail is None else _tail(logp, ids, None)
        return div.uld(part.logq, top, weight, part.logq_tail, tail_s)
    lq = torch.cat([part.logq, part.logq_tail.unsqueeze(1)], 1)
    return _BUCKET_FNS[part.divergence](lq, bucket_logprobs(part, logp), weight, **part.params)


def bucket_logprobs(part: Part, logp: Tensor) -> Tensor:
    """`[N, B + 1]`: log-probabilities `logp [N, V_s]` summed into a part's buckets (`ids` not
    None), its tail last: what the part's divergence compares with its teacher's `logq`."""
    if part.groups is not None:
        logp_b, tail = _grouped_buckets(part, logp)
    else:
        logp_b = torch.where(part.valid, logp.gather(1, part.ids), NEG_INF)
        tail = _tail(logp, part.ids, part.valid)
    return torch.cat([logp_b, tail.unsqueeze(1)], 1)


def _grouped_buckets(part: Part, logp: Tensor) -> tuple[Tensor, Tensor]:
    """Log-probabilities of a grouped part's buckets `[N, B]` and of its tail `[N]`: the log of
    each group's total, without the row's single-token buckets (the first `group_from`), which
    keep their own."""
    g = part.group_from
    singles, groups = part.ids[:, :g], part.ids[:, g:]
    marks = torch.zeros_like(logp).scatter_add(1, singles, part.valid[:, :g].to(logp.dtype))
    taken = marks > 0  # (a filler id repeats a valid one: added, never overwritten)
    index = part.groups.expand(logp.shape[0], -1)
    total = torch.zeros(logp.shape[0], part.num_events + 1, dtype=logp.dtype, device=logp.device)
    total = total.scatter_add(1, index, torch.where(taken, 0.0, logp.exp()))
    full = total > 0  # an event no student token has: −inf, with a finite gradient path
    logp_e = torch.where(full, torch.where(full, total, 1.0).log(), NEG_INF)
    logp_b = torch.cat([logp.gather(1, singles), logp_e.gather(1, groups)], 1)
    return torch.where(part.valid, logp_b, NEG_INF), _tail(logp_e, groups, part.valid[:, g:])


def reference_loss(
    hidden: Tensor, weight: Tensor, plan: Plan
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, per-term weighted sums `[T]`, label log-probs `[N]`, argmax `[N]`, chunk-likelihood
    loss), differentiable by autograd; `plan` as for the chunked pass."""
    dtype = compute_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):
        return _reference(hidden, weight, plan, dtype)


def _reference(hidden: Tensor, weight: Tensor, plan: Plan, dtype: torch.dtype):
    z = (hidden.to(dtype) @ weight.to(dtype).t()).to(accumulate_dtype(dtype))  # [N, V_s]
    logp1 = torch.log_softmax(z, dim=1)
    labeled = plan.labels >= 0
    logp_label = torch.where(labeled, logp1.gather(1, plan.labels.clamp(min=0)[:, None])[:, 0], 0.0)
    loss = div.masked_sum(-logp_label, plan.ce_weight)
    sums, cl_total = [], torch.zeros((), dtype=z.dtype, device=z.device)
    for term in plan.terms:
        logp = logp1 if term.temperature == 1.0 else torch.log_softmax(z / term.temperature, dim=1)
        value = torch.zeros((), dtype=z.dtype, device=z.device)
        report = torch.zeros((), dtype=z.dtype, device=z.device)
        for part in term.parts:
            value = value + _part_loss(part, logp, term.row_weight * part.scale)
            report = report + _part_loss(part, logp, term.report_weight * part.scale).detach()
        if term.loss == "chunk_likelihood":
            logl_s = chunk_logl_s(logp_label, term.chunks)
            value = div.chunk_likelihood(term.logl_t, logl_s, term.chunk_weight, term.temperature)
            report = div.chunk_likelihood(
                term.logl_t, logl_s.detach(), term.chunk_report, term.temperature
            )
            cl_total = cl_total + value.detach()
        loss = loss + value.to(loss.dtype)
        sums.append(report.to(loss.dtype))
    term_sums = torch.stack(sums) if sums else loss.new_zeros(0)
    return loss, term_sums, logp_label.detach(), z.argmax(1), cl_total

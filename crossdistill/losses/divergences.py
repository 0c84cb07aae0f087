"""Divergences as pure functions on log-probabilities, with masks and sum reduction.

Distribution losses compare two distributions over the same *buckets* `[M, B]`: the student
vocabulary ids that carry projected teacher mass, plus (usually) one tail bucket for everything
else, so both sides are proper distributions. A bucket that is `-inf` on both sides is empty and
contributes exactly 0 (and 0 gradient), which is how padding slots and an empty tail vanish.

Every loss here is a sum of per-bucket terms, so it has a closed-form derivative with respect to
the student's bucket log-probs, `h = dD/dlog p_s`; the chunked student pass uses it to build the
gradient w.r.t. logits without autograd (`bucket_terms`). The public functions are differentiable
with autograd as well, and the reference path uses them that way.

Conventions: `logq_t` teacher, `logp_s` student, both log-probs; `mask` is `[M]`, bool or float
row weights; masked rows contribute exactly 0 even where their values are not finite.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NEG_INF = float("-inf")


def _xlogx_ratio(loga: Tensor, logb: Tensor) -> Tensor:
    """`a · (log a − log b)` with `0 · anything = 0`; inputs are sanitized so that autograd never
    sees `-inf - -inf` (a NaN gradient would leak through `torch.where`)."""
    pos = loga > NEG_INF
    la = torch.where(pos, loga, 0.0)
    lb = torch.where(pos, logb, 0.0)
    return torch.where(pos, la.exp() * (la - lb), 0.0)


def _both_empty(logq: Tensor, logp: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Buckets with no mass on either side, and the inputs with (only) those replaced by 0, so
    that the mixture `m` is finite wherever it is used."""
    empty = (logq == NEG_INF) & (logp == NEG_INF)
    return empty, torch.where(empty, 0.0, logq), torch.where(empty, 0.0, logp)


def _mixture(lq: Tensor, lp: Tensor, w_q: float) -> Tensor:
    """`log(w_q·q + (1 − w_q)·p)`, for buckets where at least one side is non-empty."""
    if w_q == 0.0:
        return lp
    return torch.logaddexp(lq + math.log(w_q), lp + math.log1p(-w_q))


# Per-bucket terms `[.., B]` and their derivative w.r.t. the student's bucket log-prob.


def _forward_kl(logq: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
    return _xlogx_ratio(logq, logp), -logq.exp()


def _reverse_kl(logq: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
    pos = logp > NEG_INF
    lp = torch.where(pos, logp, 0.0)
    lq = torch.where(pos, logq, 0.0)
    grad = torch.where(pos, lp.exp() * (lp - lq + 1.0), 0.0)
    return _xlogx_ratio(logp, logq), grad


def _jsd(logq: Tensor, logp: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    empty, lq, lp = _both_empty(logq, logp)
    logm = _mixture(lq, lp, beta)
    terms = beta * _xlogx_ratio(lq, logm) + (1.0 - beta) * _xlogx_ratio(lp, logm)
    # dD/dlog p = (1 − β)·p·(log p − log m): the mixture's own derivative cancels the rest.
    grad = (1.0 - beta) * _xlogx_ratio(lp, logm)
    return torch.where(empty, 0.0, terms), torch.where(empty, 0.0, grad)


def _skew_kl(logq: Tensor, logp: Tensor, alpha: float) -> tuple[Tensor, Tensor]:
    empty, lq, lp = _both_empty(logq, logp)
    logm = _mixture(lq, lp, alpha)
    terms = _xlogx_ratio(lq, logm)
    grad = -(1.0 - alpha) * (lq + lp - logm).exp()
    return torch.where(empty, 0.0, terms), torch.where(empty, 0.0, grad)


def _abs_diff(logq: Tensor, logp: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    q, p = logq.exp(), logp.exp()
    return scale * (q - p).abs(), -scale * torch.sign(q - p) * p


def bucket_terms(
    name: str, logq_t: Tensor, logp_s: Tensor, beta: float = 0.5, alpha: float = 0.1
) -> tuple[Tensor, Tensor]:
    """Per-bucket loss terms `[.., B]` and `dD/dlog p_s` `[.., B]` for a bucket divergence:
    `forward_kl`, `reverse_kl`, `jsd`, `skew_kl`, `tvd` or `l1` (the sorted-probability ULD)."""
    if name == "forward_kl":
        return _forward_kl(logq_t, logp_s)
    if name == "reverse_kl":
        return _reverse_kl(logq_t, logp_s)
    if name == "jsd":
        return _jsd(logq_t, logp_s, beta)
    if name == "skew_kl":
        return _skew_kl(logq_t, logp_s, alpha)
    if name == "tvd":
        return _abs_diff(logq_t, logp_s, 0.5)
    if name == "l1":
        return _abs_diff(logq_t, logp_s, 1.0)
    raise ValueError(f"unknown bucket divergence {name!r}")


def _kept(mask: Tensor | None, like: Tensor) -> Tensor | None:
    """`mask` as bool rows broadcastable to `like` (`[M]` or `[M, ...]`), or None."""
    if mask is None:
        return None
    keep = mask if mask.dtype == torch.bool else mask != 0
    return keep.reshape(keep.shape + (1,) * (like.dim() - keep.dim()))


def _masked_inputs(mask: Tensor | None, *xs: Tensor, fill: float = 0.0) -> list[Tensor]:
    """The inputs with masked rows replaced by `fill` before any arithmetic, so that what a
    masked row holds (inf, NaN) reaches neither the value nor the gradient: `where` after the
    fact would zero the value but leak `0 · inf = NaN` into the gradient."""
    if mask is None:
        return list(xs)
    return [torch.where(_kept(mask, x), x, fill) for x in xs]


def masked_sum(rows: Tensor, mask: Tensor | None) -> Tensor:
    """Σ over rows of `rows [M]`, weighted by `mask [M]` (bool or float); masked rows give
    exactly 0 even if their value is not finite."""
    if mask is None:
        return rows.sum()
    if mask.dtype == torch.bool:
        return torch.where(mask, rows, 0.0).sum()
    return torch.where(mask != 0, rows * mask, 0.0).sum()


def _bucket_loss(name: str, logq_t: Tensor, logp_s: Tensor, mask: Tensor | None, **kw) -> Tensor:
    # masked rows become two equal (all-zero) rows: a divergence of 0 with a finite gradient
    logq_t, logp_s = _masked_inputs(mask, logq_t, logp_s)
    terms, _ = bucket_terms(name, logq_t, logp_s, **kw)
    return masked_sum(terms.sum(-1), mask)


def forward_kl(logq_t: Tensor, logp_s: Tensor, mask: Tensor | None = None) -> Tensor:
    """Σ_rows Σ_b q_b (log q_b − log p_b); `[M, B]` bucket log-probs, `mask [M]`."""
    return _bucket_loss("forward_kl", logq_t, logp_s, mask)


def reverse_kl(logq_t: Tensor, logp_s: Tensor, mask: Tensor | None = None) -> Tensor:
    """Σ_rows Σ_b p_b (log p_b − log q_b)."""
    return _bucket_loss("reverse_kl", logq_t, logp_s, mask)


def jsd(logq_t: Tensor, logp_s: Tensor, mask: Tensor | None = None, beta: float = 0.5) -> Tensor:
    """Generalized Jensen–Shannon: β·KL(q‖m) + (1−β)·KL(p‖m), m = β·q + (1−β)·p, β in (0, 1).
    β = 0.5 is the symmetric JSD; small β leans towards forward KL (scaled by β)."""
    return _bucket_loss("jsd", logq_t, logp_s, mask, beta=beta)


def skew_kl(
    logq_t: Tensor, logp_s: Tensor, mask: Tensor | None = None, alpha: float = 0.1
) -> Tensor:
    """Skew forward KL: KL(q ‖ α·q + (1−α)·p), α in [0, 1); α = 0 is forward KL. Mixing some
    teacher mass into the student side keeps the loss and its gradient bounded."""
    return _bucket_loss("skew_kl", logq_t, logp_s, mask, alpha=alpha)


def tvd(logq_t: Tensor, logp_s: Tensor, mask: Tensor | None = None) -> Tensor:
    """Total variation: ½·Σ_b |q_b − p_b|."""
    return _bucket_loss("tvd", logq_t, logp_s, mask)


def _sorted_desc(logx: Tensor, width: int) -> Tensor:
    """Log-probs sorted in descending order and padded with `-inf` to `width` columns."""
    logx = logx.sort(dim=-1, descending=True).values
    pad = width - logx.shape[-1]
    return torch.nn.functional.pad(logx, (0, pad), value=NEG_INF) if pad else logx


def uld(
    logq_t: Tensor,
    logp_s: Tensor,
    mask: Tensor | None = None,
    logq_tail_t: Tensor | None = None,
    logp_tail_s: Tensor | None = None,
) -> Tensor:
    """Universal logit distillation: L1 distance between the two sides' probabilities, each
    sorted in descending order (`logq_t [M, K_t]`, `logp_s [M, K_s]`, the shorter padded with
    zeros), plus `|q_tail − p_tail|` when tails `[M]` are given. Needs no vocabulary mapping."""
    width = max(logq_t.shape[-1], logp_s.shape[-1])
    logq_t, logp_s = _masked_inputs(mask, logq_t, logp_s, fill=NEG_INF)
    if logq_tail_t is not None and logp_tail_s is not None:
        logq_tail_t, logp_tail_s = _masked_inputs(mask, logq_tail_t, logp_tail_s, fill=NEG_INF)
    lq, lp = _sorted_desc(logq_t, width), _sorted_desc(logp_s, width)
    if logq_tail_t is not None and logp_tail_s is not None:
        lq = torch.cat([lq, logq_tail_t.unsqueeze(-1)], dim=-1)
        lp = torch.cat([lp, logp_tail_s.unsqueeze(-1)], dim=-1)
    return _bucket_loss("l1", lq, lp, mask)


def gold(
    logq_common_t: Tensor,
    logp_common_s: Tensor,
    logq_rest_t: Tensor,
    logp_rest_s: Tensor,
    mask: Tensor | None = None,
) -> Tensor:
    """Forward KL over the common vocabulary plus ULD on the rest, with equal weight.

    `logq_common_t`, `logp_common_s` `[M, B + 1]`: the common-vocabulary tokens (teacher tokens
    whose projection is an exact string match) as buckets, the last column one bucket for all
    other tokens, so both sides are proper distributions. `logq_rest_t [M, K_t]`,
    `logp_rest_s [M, K_s]`: unnormalized probabilities of non-common tokens (teacher top-k, the
    student's top-k among its non-common tokens), compared by sorted-probability L1."""
    kl = forward_kl(logq_common_t, logp_common_s, mask)
    return kl + uld(logq_rest_t, logp_rest_s, mask)


def log1mexp(x: Tensor) -> Tensor:
    """`log(1 − exp(x))` for x ≤ 0, accurate at both ends (−inf at x = 0)."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


# A chunk log-likelihood at τ is clipped below log(1 − 1e-6): a chunk that either model finds
# (numerically) certain would otherwise make log(1 − p) = −inf and the loss infinite.
MAX_CHUNK_LOGPROB = math.log1p(-1e-6)


def chunk_likelihood(
    logl_t: Tensor, logl_s: Tensor, mask: Tensor | None = None, temperature: float = 1.0
) -> Tensor:
    """Binary KL between the two models' probabilities of the same byte chunk.

    `logl_t`, `logl_s` `[C]`: each model's log-likelihood of the chunk (sum of its token
    log-probs). With `p = exp(min(l/τ, log(1 − 1e-6)))` on both sides, the loss is
    `KL(Bern(p_t) ‖ Bern(p_s)) = p_t·(a − b) + (1 − p_t)·(log(1 − p_t) − log(1 − p_s))`, computed
    in log space; τ > 1 flattens both probabilities towards 1 and so softens the comparison."""
    logl_t, logl_s = _masked_inputs(mask, logl_t, logl_s, fill=-1.0)  # equal, finite: 0
    a = (logl_t / temperature).clamp(max=MAX_CHUNK_LOGPROB)
    b = (logl_s / temperature).clamp(max=MAX_CHUNK_LOGPROB)
    terms = a.exp() * (a - b) + (-torch.expm1(a)) * (log1mexp(a) - log1mexp(b))
    return masked_sum(terms, mask)


def ce(logp_s: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Σ over labeled rows of −log p_s[label]; `logp_s [N, V_s]`, `labels [N]`."""
    valid = labels != ignore_index
    picked = logp_s.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    return masked_sum(-picked, valid)

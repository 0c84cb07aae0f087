"""Divergences on log-probs: values against float64 formulas written out plainly, gradients by
gradcheck, closed-form derivatives against autograd, masks and empty buckets exactly zero."""

from __future__ import annotations

import math

import pytest
import torch

from crossdistill.losses import (
    ce,
    chunk_likelihood,
    forward_kl,
    gold,
    jsd,
    reverse_kl,
    skew_kl,
    tvd,
    uld,
)
from crossdistill.losses.divergences import bucket_terms

NEG_INF = float("-inf")


def plain_fkl(q, p, **_):
    return sum(a * math.log(a / b) for a, b in zip(q, p) if a > 0)


def plain_rkl(q, p, **_):
    return sum(b * math.log(b / a) for a, b in zip(q, p) if b > 0)


def plain_jsd(q, p, beta=0.5):
    m = [beta * a + (1 - beta) * b for a, b in zip(q, p)]
    left = sum(a * math.log(a / c) for a, c in zip(q, m) if a > 0)
    right = sum(b * math.log(b / c) for b, c in zip(p, m) if b > 0)
    return beta * left + (1 - beta) * right


def plain_skew(q, p, alpha=0.1):
    return sum(a * math.log(a / (alpha * a + (1 - alpha) * b)) for a, b in zip(q, p) if a > 0)


def plain_tvd(q, p, **_):
    return 0.5 * sum(abs(a - b) for a, b in zip(q, p))


CASES = [
    (forward_kl, plain_fkl, {}),
    (reverse_kl, plain_rkl, {}),
    (jsd, plain_jsd, {"beta": 0.5}),
    (jsd, plain_jsd, {"beta": 0.2}),
    (skew_kl, plain_skew, {"alpha": 0.1}),
    (skew_kl, plain_skew, {"alpha": 0.0}),
    (tvd, plain_tvd, {}),
]
IDS = ["fkl", "rkl", "jsd.5", "jsd.2", "skew.1", "skew0", "tvd"]


def _buckets(gen, rows=6, width=7, zero_teacher=True):
    """Bucket log-probs with an empty bucket (both sides) and, optionally, a teacher-only zero."""
    logq = torch.log_softmax(torch.randn(rows, width, generator=gen, dtype=torch.float64) * 2, -1)
    logp = torch.log_softmax(torch.randn(rows, width, generator=gen, dtype=torch.float64) * 2, -1)
    logq[:, -1] = logp[:, -1] = NEG_INF
    logq, logp = logq.log_softmax(-1), logp.log_softmax(-1)
    if zero_teacher:
        logq[1, 0] = NEG_INF
        logq[1] = logq[1].log_softmax(-1)
    return logq, logp


@pytest.mark.parametrize("fn,plain,kw", CASES, ids=IDS)
def test_bucket_divergence_matches_plain_float64(fn, plain, kw):
    gen = torch.Generator().manual_seed(1)
    logq, logp = _buckets(gen, zero_teacher=fn is not reverse_kl)
    mask = torch.tensor([True, True, False, True, True, True])
    logq[2] = float("nan")  # a masked row contributes exactly zero, whatever it holds
    got = fn(logq, logp, mask, **kw)
    want = sum(
        plain(logq[r].exp().tolist(), logp[r].exp().tolist(), **kw) for r in range(6) if mask[r]
    )
    assert torch.isfinite(got)
    assert abs(got.item() - want) <= 1e-12 * abs(want)


@pytest.mark.parametrize("fn,plain,kw", CASES, ids=IDS)
def test_bucket_divergence_gradcheck(fn, plain, kw):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([0.5, 0.0, 2.0], dtype=torch.float64)

    def f(x, y):
        return fn(x.log_softmax(-1), y.log_softmax(-1), weights, **kw)

    assert torch.autograd.gradcheck(f, (a, b), fast_mode=True)


@pytest.mark.parametrize(
    "name,kw",
    [
        ("forward_kl", {}),
        ("reverse_kl", {}),
        ("jsd", {"beta": 0.3}),
        ("skew_kl", {"alpha": 0.2}),
        ("tvd", {}),
        ("l1", {}),
    ],
)
def test_closed_form_derivative_equals_autograd(name, kw):
    """The chunked pass relies on h = dD/dlog p_s in closed form; autograd is the judge."""
    gen = torch.Generator().manual_seed(3)
    logq, logp = _buckets(gen, zero_teacher=name != "reverse_kl")
    logp = logp.clone().requires_grad_(True)
    terms, h = bucket_terms(name, logq, logp, **kw)
    (auto,) = torch.autograd.grad(terms.sum(), logp)
    assert torch.isfinite(h).all() and torch.isfinite(auto).all()
    torch.testing.assert_close(h, auto, rtol=1e-12, atol=1e-14)
    assert (h[:, -1] == 0).all()  # the empty bucket has no gradient


def test_empty_buckets_have_zero_gradient_not_nan():
    logq = torch.tensor([[0.0, NEG_INF]], dtype=torch.float64)
    for fn, kw in [(forward_kl, {}), (reverse_kl, {}), (jsd, {}), (skew_kl, {}), (tvd, {})]:
        logp = torch.tensor([[0.0, NEG_INF]], dtype=torch.float64, requires_grad=True)
        value = fn(logq, logp, **kw)
        (grad,) = torch.autograd.grad(value, logp)
        assert abs(value.item()) < 1e-15
        assert torch.isfinite(grad).all() and grad[0, 1] == 0


def plain_sorted_l1(q, p, q_tail=None, p_tail=None):
    q, p = sorted(q, reverse=True), sorted(p, reverse=True)
    width = max(len(q), len(p))
    q, p = q + [0.0] * (width - len(q)), p + [0.0] * (width - len(p))
    total = sum(abs(a - b) for a, b in zip(q, p))
    return total + (abs(q_tail - p_tail) if q_tail is not None else 0.0)


def test_uld_matches_plain_float64_and_gradcheck():
    gen = torch.Generator().manual_seed(4)
    full_q = torch.softmax(torch.randn(4, 9, generator=gen, dtype=torch.float64), -1)
    full_p = torch.softmax(torch.randn(4, 12, generator=gen, dtype=torch.float64), -1)
    lq, lp = full_q[:, :5].log(), full_p[:, :6].log()  # unsorted partial "top-k"
    tq, tp = full_q[:, 5:].sum(-1).log(), full_p[:, 6:].sum(-1).log()
    got = uld(lq, lp, None, tq, tp)
    want = sum(
        plain_sorted_l1(
            lq[r].exp().tolist(), lp[r].exp().tolist(), tq[r].exp().item(), tp[r].exp().item()
        )
        for r in range(4)
    )
    assert abs(got.item() - want) <= 1e-12 * want
    no_tail = sum(plain_sorted_l1(lq[r].exp().tolist(), lp[r].exp().tolist()) for r in range(4))
    assert abs(uld(lq, lp).item() - no_tail) <= 1e-12 * no_tail
    x = torch.randn(2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b: uld(a.log_softmax(-1)[:, :4], b.log_softmax(-1)), (x, y)
    )


def test_gold_is_common_kl_plus_rest_l1():
    gen = torch.Generator().manual_seed(5)
    lq = torch.log_softmax(torch.randn(3, 4, generator=gen, dtype=torch.float64), -1)
    lp = torch.log_softmax(torch.randn(3, 4, generator=gen, dtype=torch.float64), -1)
    rq = torch.rand(3, 5, generator=gen, dtype=torch.float64).mul(0.1).log()
    rp = torch.rand(3, 3, generator=gen, dtype=torch.float64).mul(0.1).log()
    got = gold(lq, lp, rq, rp, None)
    want = sum(
        plain_fkl(lq[r].exp().tolist(), lp[r].exp().tolist())
        + plain_sorted_l1(rq[r].exp().tolist(), rp[r].exp().tolist())
        for r in range(3)
    )
    assert abs(got.item() - want) <= 1e-12 * want


def plain_binary_kl(lt, ls, tau):
    cap = math.log1p(-1e-6)
    a, b = min(lt / tau, cap), min(ls / tau, cap)
    pt, ps = math.exp(a), math.exp(b)
    return pt * math.log(pt / ps) + (1 - pt) * math.log((1 - pt) / (1 - ps))


@pytest.mark.parametrize("tau", [1.0, 3.0])
def test_chunk_likelihood_matches_plain_float64(tau):
    gen = torch.Generator().manual_seed(6)
    lt = -torch.rand(8, generator=gen, dtype=torch.float64) * 6
    ls = -torch.rand(8, generator=gen, dtype=torch.float64) * 6
    lt[0], ls[1] = 0.0, 0.0  # certain chunks: clipped, never infinite
    lt[2], ls[2] = -1e-9, -40.0  # near-certain vs near-impossible: log1mexp's small-|x| branch
    mask = torch.ones(8, dtype=torch.bool)
    mask[5] = False
    got = chunk_likelihood(lt, ls, mask, tau)
    want = sum(plain_binary_kl(lt[i].item(), ls[i].item(), tau) for i in range(8) if mask[i])
    assert torch.isfinite(got)
    assert abs(got.item() - want) <= 1e-10 * abs(want)


def test_chunk_likelihood_gradcheck_and_zero_at_equality():
    gen = torch.Generator().manual_seed(7)
    lt = (-torch.rand(5, generator=gen, dtype=torch.float64) * 3 - 0.1).requires_grad_(True)
    ls = (-torch.rand(5, generator=gen, dtype=torch.float64) * 3 - 0.1).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: chunk_likelihood(a, b, None, 2.0), (lt, ls))
    same = chunk_likelihood(lt.detach(), lt.detach())
    assert abs(same.item()) < 1e-15


def test_ce_matches_plain_float64():
    gen = torch.Generator().manual_seed(8)
    logp = torch.log_softmax(torch.randn(6, 11, generator=gen, dtype=torch.float64), -1)
    labels = torch.tensor([3, -100, 0, 10, -100, 7])
    want = sum(-logp[r, labels[r]].item() for r in range(6) if labels[r] >= 0)
    assert abs(ce(logp, labels).item() - want) <= 1e-12 * want


POISON = [float("inf"), float("nan"), float("-inf")]


@pytest.mark.parametrize("fn,plain,kw", CASES, ids=IDS)
@pytest.mark.parametrize("poison", POISON, ids=["inf", "nan", "-inf"])
@pytest.mark.parametrize("float_mask", [False, True], ids=["bool", "weights"])
def test_masked_rows_with_non_finite_values_give_exactly_zero(fn, plain, kw, poison, float_mask):
    """A masked row contributes exactly 0 to the value and the gradient, whatever it holds."""
    gen = torch.Generator().manual_seed(7)
    logq, logp = _buckets(gen, zero_teacher=False)  # finite on the kept rows for every loss
    keep = torch.tensor([True, True, False, True, False, True])
    bad_q, bad_p = logq.clone(), logp.clone()
    bad_q[~keep] = poison
    bad_p[2, 3] = poison
    mask = keep.double() * 0.7 if float_mask else keep
    lp_clean = logp.clone().requires_grad_(True)
    lp_bad = bad_p.clone().requires_grad_(True)
    want = fn(logq, lp_clean, mask, **kw)
    got = fn(bad_q, lp_bad, mask, **kw)
    (g_want,) = torch.autograd.grad(want, lp_clean)
    (g_got,) = torch.autograd.grad(got, lp_bad)
    assert torch.isfinite(got) and got.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.isfinite(g_got).all()
    assert torch.equal(g_got[~keep], torch.zeros_like(g_got[~keep]))
    torch.testing.assert_close(g_got[keep], g_want[keep], rtol=1e-12, atol=0)


@pytest.mark.parametrize("poison", POISON, ids=["inf", "nan", "-inf"])
def test_masked_rows_of_uld_gold_and_chunk_likelihood_give_exactly_zero(poison):
    gen = torch.Generator().manual_seed(8)
    logq, logp = _buckets(gen, zero_teacher=False)
    keep = torch.tensor([True, False, True, True, False, True])
    bad_q = logq.clone()
    bad_q[~keep] = poison
    lp = logp.clone().requires_grad_(True)
    for value in (
        uld(bad_q, lp, keep),
        gold(bad_q, lp, bad_q, lp, keep),
        chunk_likelihood(bad_q[:, 0], lp[:, 0], keep),
        chunk_likelihood(lp[:, 0], bad_q[:, 0], keep),
    ):
        (grad,) = torch.autograd.grad(value, lp)
        assert torch.isfinite(value) and torch.isfinite(grad).all()
        assert torch.equal(grad[~keep], torch.zeros_like(grad[~keep]))
    clean = logq.clone()
    clean[~keep] = logp[~keep].detach()
    assert uld(bad_q, logp, keep).item() == pytest.approx(uld(clean, logp, keep).item(), 1e-12)

"""The student objective, chunked and reference, against a float64 reference written out plainly
here (Python loops over chunks and tokens), plus gradcheck and the invariances it must keep."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from crossdistill.errors import UserError
from crossdistill.losses import (
    LOSSES,
    KDTerm,
    VocabProjection,
    ce_count,
    kd_count,
    kd_positions,
    student_loss,
    teacher_targets,
)

F64 = torch.float64


def make_chunks(n_s, n_t, gen, offset_s=0, offset_t=0):
    """A random monotone alignment of n_s student and n_t teacher tokens, as (s0, s1, t0, t1),
    including some many-to-one chunks."""
    rows, s, t = [], 0, 0
    while s < n_s and t < n_t:
        ds = 1 + int(torch.randint(0, 3, (1,), generator=gen)) // 2
        dt = 1 + int(torch.randint(0, 3, (1,), generator=gen)) // 2
        s1, t1 = min(s + ds, n_s), min(t + dt, n_t)
        if s1 == n_s or t1 == n_t:
            s1, t1 = n_s, n_t
        rows.append((s + offset_s, s1 + offset_s, t + offset_t, t1 + offset_t))
        s, t = s1, t1
    return torch.tensor(rows)


def make_problem(seed, n=14, n_t=12, h=4, v_s=16, v_t=13, k=5, dtype=F64, tau=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=F64).to(dtype)
    weight = torch.randn(v_s, h, generator=gen, dtype=F64).to(dtype)
    labels = torch.randint(0, v_s, (n,), generator=gen)
    labels[[2, n - 1]] = -100
    chunks = make_chunks(n, n_t, gen)
    h_t = torch.randn(n_t, 3, generator=gen, dtype=F64)
    w_t = torch.randn(v_t, 3, generator=gen, dtype=F64) * 1.5
    next_t = torch.randint(0, v_t, (n_t,), generator=gen)
    next_t[-1] = -100
    targets = teacher_targets(h_t, w_t, kd_positions(chunks)[1], next_t, k, tau)
    first = torch.randint(-1, v_s, (v_t,), generator=gen)
    first[:4] = torch.tensor([0, 0, 5, 6])  # some collisions
    exact = (torch.rand(v_t, generator=gen) < 0.6) & (first >= 0)
    exact[1] = False  # teacher 0 and 1 share student 0; only 0 is an exact match
    proj = VocabProjection.from_first_piece(first, v_s, exact=exact)
    # hkl's one-to-one pairs: the exact matches, and some other teacher tokens each paired with
    # a student token no other teacher token has
    matched = torch.where(exact, first, -1)
    free = [s for s in torch.randperm(v_s, generator=gen).tolist() if s not in matched.tolist()]
    for t in torch.nonzero(~exact).flatten().tolist()[: len(free)]:
        if torch.rand((), generator=gen) < 0.6:
            matched[t] = free.pop()
    proj.matched = matched
    return hidden, weight, labels, chunks, targets, proj


def _log(x):
    return torch.log(x) if isinstance(x, torch.Tensor) else math.log(x)


def plain_divergence(name, q, p, params):
    """q: teacher probabilities (floats), p: student probabilities (0-d tensors, autograd)."""
    if name == "forward_kl":
        return sum(a * (_log(a) - _log(b)) for a, b in zip(q, p) if a > 0)
    if name == "reverse_kl":
        return sum(b * (_log(b) - _log(a)) for a, b in zip(q, p) if b > 0)
    if name == "jsd":
        beta = params.get("beta", 0.5)
        m = [beta * a + (1 - beta) * b for a, b in zip(q, p)]
        left = sum(a * (_log(a) - _log(c)) for a, c in zip(q, m) if a > 0)
        right = sum(b * (_log(b) - _log(c)) for b, c in zip(p, m) if b > 0)
        return beta * left + (1 - beta) * right
    if name == "skew_kl":
        alpha = params.get("alpha", 0.1)
        return sum(a * (_log(a) - _log(alpha * a + (1 - alpha) * b)) for a, b in zip(q, p) if a > 0)
    if name == "tvd":
        return 0.5 * sum(abs(a - b) for a, b in zip(q, p))
    raise AssertionError(name)


def plain_kd(name, z_row, tg, c, proj, tau, params):
    """One KD position, the obvious way: teacher mass per student token, then a divergence
    between (buckets + tail) on both sides; z_row is the student's logits (autograd flows)."""
    p = torch.softmax(z_row / tau, -1)
    v_s = p.shape[0]
    ids = tg.topk_ids[c].tolist()
    q_top = [math.exp(x) for x in tg.topk_logprobs[c].tolist()]
    q_tail = math.exp(tg.tail_logprob[c].item())
    first, exact = proj.first_piece.tolist(), proj.exact
    if name == "uld":
        p_top = p.sort(descending=True).values[: len(ids)]
        return sum(abs(a - b) for a, b in zip(q_top, p_top)) + abs(q_tail - (1 - p_top.sum()))
    if name in ("gold", "hkl"):  # gold pairs the exact matches, hkl its own pairs
        if name == "hkl":
            first = proj.matched.tolist()
            exact = [s >= 0 for s in first]
        common = {}
        rest_t = []
        for t, q in zip(ids, q_top):
            if exact[t]:
                common[first[t]] = common.get(first[t], 0.0) + q
            else:
                rest_t.append(q)
        q_other = 1.0 - sum(common.values())
        p_b = [p[s] for s in common]
        others = [s for s in range(v_s) if s not in common]
        kl = plain_divergence(
            "forward_kl", list(common.values()) + [q_other], p_b + [p[others].sum()], {}
        )
        common_s = {first[t] for t in range(len(first)) if exact[t]}
        p_rest = sorted(
            (p[s] for s in range(v_s) if s not in common_s),
            key=lambda x: x.detach().item(),
            reverse=True,
        )
        rest_t = sorted(rest_t, reverse=True)
        width = len(ids)
        rest_t += [0.0] * (width - len(rest_t))
        p_rest = (p_rest + [torch.zeros((), dtype=p.dtype)] * width)[:width]
        return kl + sum(abs(a - b) for a, b in zip(rest_t, p_rest))
    q = {}
    for t, mass in zip(ids, q_top):
        if first[t] < 0:
            q_tail += mass
        else:
            q[first[t]] = q.get(first[t], 0.0) + mass
    buckets = sorted(q)
    p_tail = p[[s for s in range(v_s) if s not in q]].sum()
    return plain_divergence(
        name, [q[s] for s in buckets] + [q_tail], [p[s] for s in buckets] + [p_tail], params
    )


def plain_binary_kl(lt, ls):
    cap = math.log1p(-1e-6)
    a, b = min(lt, cap), torch.clamp(ls, max=cap)
    pt, ps = math.exp(a), torch.exp(b)
    return pt * (a - b) + (1 - pt) * (math.log(1 - pt) - torch.log(1 - ps))


def plain_covered(term, labels):
    """The rows whose logits the term's loss reaches, by a loop over its chunks."""
    rows = set()
    for c, (s0, s1, t0, t1) in enumerate(term.chunks.tolist()):
        if term.chunk_mask is not None and not term.chunk_mask[c]:
            continue
        if term.loss != "chunk_likelihood":
            if s0 > 0 and t0 > 0 and s1 > s0 and t1 > t0:
                rows.add(s0 - 1)
        elif (
            s0 > 0
            and min(labels[s0 - 1 : s1 - 1].tolist()) >= 0
            and term.targets.next_valid[t0 - 1 : t1 - 1].all()
        ):
            rows.update(range(s0 - 1, s1 - 1))
    return rows


def plain_student_loss(hidden, weight, labels, terms, kd_ratio, ce_den, ce_without_kd="ratio"):
    """The whole objective with loops over tokens and chunks, in float64. `ce_without_kd`
    "full": a row's CE weight is 1 − kd_ratio times the share of the teachers' weight that
    reaches it."""
    z = hidden.double() @ weight.double().t()
    logp = torch.log_softmax(z, -1)
    covered = [plain_covered(t, labels) for t in terms]
    total_w = sum(float(t.weight) for t in terms)

    def ce_coef(r):
        if ce_without_kd == "ratio":
            return 1 - kd_ratio
        share = sum(float(t.weight) for t, rows in zip(terms, covered) if r in rows)
        return 1 - kd_ratio * (share / total_w if total_w > 0 else 0.0)

    ce = sum(-logp[r, labels[r]] * ce_coef(r) for r in range(len(labels)) if labels[r] >= 0)
    loss = ce / max(ce_den, 1)
    for term in terms:
        tg, tau = term.targets, term.temperature
        kd = 0.0
        for c, (s0, s1, t0, t1) in enumerate(term.chunks.tolist()):
            if not (s0 > 0 and t0 > 0 and s1 > s0 and t1 > t0):
                continue
            if term.chunk_mask is not None and not term.chunk_mask[c]:
                continue
            if term.loss != "chunk_likelihood":
                kd = kd + plain_kd(term.loss, z[s0 - 1], tg, c, term.projection, tau, term.params)
                continue
            lab = labels[s0 - 1 : s1 - 1].tolist()
            if min(lab) < 0 or not tg.next_valid[t0 - 1 : t1 - 1].all():
                continue
            ls = sum(logp[j, lab[j - s0 + 1]] for j in range(s0 - 1, s1 - 1))
            lt = sum(tg.next_logprobs[j].item() for j in range(t0 - 1, t1 - 1))
            kd = kd + plain_binary_kl(lt / tau, ls / tau)
        den = float(term.denominator)
        loss = loss + kd_ratio * float(term.weight) * tau**2 * kd / (den if den > 0 else 1.0)
    return loss


def terms_for(loss, seed=0, tau=1.0, **problem):
    hidden, weight, labels, chunks, targets, proj = make_problem(seed, tau=tau, **problem)
    params = {"jsd": {"beta": 0.3}, "skew_kl": {"alpha": 0.2}}.get(loss, {})
    term = KDTerm(
        targets, proj, chunks, torch.tensor(0.0), loss, weight=0.8, params=params, name=loss
    )
    term.denominator = kd_count(term, labels).double()
    return hidden, weight, labels, [term]


def run(
    backend, hidden, weight, labels, terms, kd_ratio=0.6, chunk_size=4, ce_den=None,
    ce_without_kd="ratio",
):  # fmt: skip
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    den = ce_count(labels) if ce_den is None else ce_den
    loss, metrics = student_loss(
        h, w, labels, terms, kd_ratio, den, chunk_size, backend, ce_without_kd=ce_without_kd
    )
    loss.backward()
    return loss.detach(), h.grad, w.grad, metrics


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-300)).item()


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("loss", LOSSES)
def test_matches_plain_float64_reference(loss, tau):
    hidden, weight, labels, terms = terms_for(loss, seed=1, tau=tau)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    want = plain_student_loss(h, w, labels, terms, 0.6, int(ce_count(labels)))
    gh, gw = torch.autograd.grad(want, (h, w))
    for backend in ("chunked", "reference"):
        got, got_h, got_w, metrics = run(backend, hidden, weight, labels, terms)
        assert torch.isfinite(got)
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())
        assert rel(got_h, gh) < 1e-10 and rel(got_w, gw) < 1e-10
        assert metrics[f"kd/{loss}"] > 0  # the term is really there


@pytest.mark.parametrize("loss", LOSSES)
def test_a_term_with_every_parameter_as_training_builds_it(loss):
    """Training gives every term both `beta` and `alpha` (`runtime.make_term`); each divergence
    takes its own and the others none, so both backends give what a term with only its own
    parameter gives (the reference path once passed `beta` to `forward_kl`)."""
    hidden, weight, labels, terms = terms_for(loss, seed=2)
    own = run("chunked", hidden, weight, labels, terms)[0]
    both = {"beta": 0.3, "alpha": 0.2}
    built = [dataclasses.replace(terms[0], params=both)]
    for backend in ("chunked", "reference"):
        got = run(backend, hidden, weight, labels, built)[0]
        assert torch.isfinite(got)
        assert abs(got.item() - own.item()) <= 1e-10 * abs(own.item())


@pytest.mark.parametrize(
    "loss", ["forward_kl", "jsd", "tvd", "uld", "gold", "hkl", "chunk_likelihood"]
)
def test_chunked_gradcheck(loss):
    hidden, weight, labels, terms = terms_for(loss, seed=2, tau=1.5, n=7, n_t=6, v_s=9, v_t=8, k=3)

    def f(h, w):
        return student_loss(h, w, labels, terms, 0.6, ce_count(labels), chunk_size=3)[0]

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (h, w), fast_mode=True)


def test_several_teachers_with_their_own_temperatures_match_plain():
    """Two temperatures besides 1 take the pass's extra-buffer route."""
    terms = []
    for i, (loss, tau) in enumerate(
        [("forward_kl", 2.0), ("jsd", 1.0), ("uld", 3.0), ("chunk_likelihood", 1.5)]
    ):
        hidden, weight, labels, (term,) = terms_for(loss, seed=3 + i, tau=tau)
        term.weight = 0.3 + 0.2 * i
        terms.append(term)
    hidden, weight, labels, _ = terms_for("tvd", seed=3)  # the student of the first problem
    terms[1:] = [_rebase(t, labels) for t in terms[1:]]
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    want = plain_student_loss(h, w, labels, terms, 0.7, int(ce_count(labels)))
    gh, gw = torch.autograd.grad(want, (h, w))
    for chunk in (3, 100):
        got, got_h, got_w, metrics = run("chunked", hidden, weight, labels, terms, 0.7, chunk)
        assert abs(got.item() - want.item()) <= 1e-10 * want.item()
        assert rel(got_h, gh) < 1e-10 and rel(got_w, gw) < 1e-10
        assert {f"kd/{t.name}" for t in terms} <= set(metrics)


@pytest.mark.parametrize("loss", ["forward_kl", "chunk_likelihood"])
def test_full_ce_where_no_teacher_reaches_matches_plain_float64(loss):
    """`ce_without_kd="full"`: rows no KD term reaches (later tokens of a chunk, masked chunks)
    get CE weight 1, covered rows 1 − kd_ratio; two teachers cover different rows."""
    hidden, weight, labels, (first,) = terms_for(loss, seed=5)
    _, _, _, (second,) = terms_for("jsd", seed=6)
    second = _rebase(second, labels)
    first.chunk_mask = torch.arange(first.chunks.shape[0]) % 3 != 1
    first.denominator = kd_count(first, labels).double()
    first.weight, second.weight = 0.75, 0.25
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    den = int(ce_count(labels))
    for terms in ([first], [first, second]):
        # the case can fail: some labeled rows are covered by no term, some by one of two
        rows = set().union(*(plain_covered(t, labels) for t in terms))
        labeled = {r for r in range(len(labels)) if labels[r] >= 0}
        assert labeled - rows and labeled & rows
        want = plain_student_loss(h, w, labels, terms, 0.6, den, "full")
        ratio = plain_student_loss(h, w, labels, terms, 0.6, den)
        assert want.item() > ratio.item() * (1 + 1e-3)
        gh, gw = torch.autograd.grad(want, (h, w))
        for backend in ("chunked", "reference"):
            got, got_h, got_w, _ = run(backend, hidden, weight, labels, terms, 0.6, 3, None, "full")
            assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())
            assert rel(got_h, gh) < 1e-10 and rel(got_w, gw) < 1e-10
    with pytest.raises(UserError, match="ce_without_kd must be one of ratio, full"):
        run("chunked", hidden, weight, labels, [first], ce_without_kd="half")


def _rebase(term, labels):
    """The same teacher term counted against another student's labels."""
    term.denominator = kd_count(term, labels).double()
    return term


def _identity_problem(seed, n=9, v=11, tau=1.0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 4, generator=gen, dtype=F64)
    weight = torch.randn(v, 4, generator=gen, dtype=F64)
    tokens = torch.randint(0, v, (n + 1,), generator=gen)
    labels = tokens[1:].clone()
    z_t = torch.randn(n, v, generator=gen, dtype=F64) * 2
    # a teacher given directly by its logits: hidden = identity, lm_head = logitsᵀ
    targets = teacher_targets(
        torch.eye(n, dtype=F64), z_t.t().contiguous(), torch.arange(n), labels, v, tau
    )
    idx = torch.arange(1, n)
    chunks = torch.stack([idx, idx + 1, idx, idx + 1], 1)  # 1:1, KD rows 0..n-2
    rows = torch.arange(n - 1)
    targets.topk_ids = targets.topk_ids[rows]
    targets.topk_logprobs = targets.topk_logprobs[rows]
    targets.tail_logprob = targets.tail_logprob[rows]
    return hidden, weight, labels, chunks, targets, z_t


def ordinary_per_token(loss, z_s, z_t, labels, tau):
    """The same-tokenizer loss over full vocabularies, summed over rows 0..n-2."""
    total = 0.0
    for r in range(z_s.shape[0] - 1):
        p, q = torch.softmax(z_s[r] / tau, -1), torch.softmax(z_t[r] / tau, -1)
        if loss in ("forward_kl", "gold", "hkl"):
            total = total + (q * (q.log() - p.log())).sum()
        elif loss == "reverse_kl":
            total = total + (p * (p.log() - q.log())).sum()
        elif loss == "jsd":
            m = 0.3 * q + 0.7 * p
            total = (
                total
                + 0.3 * (q * (q.log() - m.log())).sum()
                + 0.7 * (p * (p.log() - m.log())).sum()
            )
        elif loss == "skew_kl":
            total = total + (q * (q.log() - (0.2 * q + 0.8 * p).log())).sum()
        elif loss == "tvd":
            total = total + 0.5 * (q - p).abs().sum()
        elif loss == "uld":
            total = total + (q.sort().values - p.sort().values).abs().sum()
        else:  # chunk_likelihood of a one-token chunk: that token's probability, both sides
            a = torch.log_softmax(z_t[r], -1)[labels[r]] / tau
            b = torch.log_softmax(z_s[r], -1)[labels[r]] / tau
            total = (
                total
                + a.exp() * (a - b)
                + (1 - a.exp()) * (torch.log1p(-a.exp()) - torch.log1p(-b.exp()))
            )
    return total


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("loss", LOSSES)
def test_identical_tokenizers_reduce_to_the_ordinary_loss(loss, tau):
    hidden, weight, labels, chunks, targets, z_t = _identity_problem(11, tau=tau)
    labels[-1] = -100
    targets.next_valid[-1] = False
    targets.next_logprobs[-1] = 0.0
    v = weight.shape[0]
    params = {"jsd": {"beta": 0.3}, "skew_kl": {"alpha": 0.2}}.get(loss, {})
    term = KDTerm(
        targets, VocabProjection.identity(v), chunks, torch.tensor(1.0), loss, params=params
    )
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    want = tau**2 * ordinary_per_token(loss, h @ w.t(), z_t, labels, tau)
    gh, gw = torch.autograd.grad(want, (h, w))
    for backend in ("chunked", "reference"):
        got, got_h, got_w, _ = run(
            backend, hidden, weight, labels, [term], kd_ratio=1.0, chunk_size=4
        )
        assert abs(got.item() - want.item()) <= 1e-10 * want.item()
        assert rel(got_h, gh) < 1e-10 and rel(got_w, gw) < 1e-10
        # the teacher covers every labeled row: giving CE the uncovered rows' KD share is
        # the same objective, to the bit
        full = run(backend, hidden, weight, labels, [term], 0.6, 4, None, "full")
        ratio = run(backend, hidden, weight, labels, [term], 0.6, 4, None, "ratio")
        assert all(torch.equal(a, b) for a, b in zip(full[:3], ratio[:3]))


def test_top1_agreement_and_aligned_nll_metrics():
    hidden, weight, labels, chunks, targets, _ = _identity_problem(12)
    v = weight.shape[0]
    # the teacher is the student itself: its top-1 always agrees
    z_s = hidden @ weight.t()
    same = teacher_targets(hidden, weight, torch.arange(8), labels, 3)
    term = KDTerm(same, VocabProjection.identity(v), chunks, torch.tensor(8.0), name="self")
    _, _, _, m = run("chunked", hidden, weight, labels, [term])
    assert m["top1/self"].item() == 1.0 and m["num_kd/self"].item() == 8
    logp = torch.log_softmax(z_s, -1)
    want_nll = -sum(logp[r, labels[r]].item() for r in range(8))
    assert (
        abs(m["nll_s/self"].item() - want_nll) < 1e-10
        and abs(m["nll_t/self"].item() - want_nll) < 1e-10
    )
    assert m["num_chunks/self"].item() == 8
    # a foreign teacher: agreement is whatever a plain count says
    hidden, weight, labels, tchunks, tg, proj = make_problem(13)
    term = KDTerm(tg, proj, tchunks, torch.tensor(5.0), name="t")
    _, _, _, m = run("chunked", hidden, weight, labels, [term])
    arg = (hidden @ weight.t()).argmax(-1)
    hits = sum(
        int(arg[s0 - 1] == proj.first_piece[tg.topk_ids[c, 0]])
        for c, (s0, s1, t0, t1) in enumerate(tchunks.tolist())
        if s0 > 0 and t0 > 0
    )
    assert abs(m["top1/t"].item() - hits / 5.0) < 1e-12
    ce = -sum(
        torch.log_softmax(hidden @ weight.t(), -1)[r, labels[r]].item()
        for r in range(14)
        if labels[r] >= 0
    )
    assert abs(m["ce"].item() - ce / int(ce_count(labels))) < 1e-12


def test_unit_upstream_skips_the_scaling_and_checks_it():
    hidden, weight, labels, terms = terms_for("forward_kl", seed=7)
    grads = []
    for unit in (False, True):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        loss, _ = student_loss(h, w, labels, terms, 0.6, ce_count(labels), 4, unit_upstream=unit)
        loss.backward()
        grads.append((h.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, _ = student_loss(h, w, labels, terms, 0.6, ce_count(labels), 4, unit_upstream=True)
    with pytest.raises(RuntimeError):
        (2 * loss).backward()  # a scaled upstream gradient is caught, not silently ignored


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("zero", ["weight", "kd_ratio"])
def test_a_zero_weight_term_still_reports_its_value(loss, zero):
    """The logged `kd/<teacher>` is the term's true value when its weight (a teacher not chosen
    under `teacher_mode: best`) or `kd_ratio` is 0; the term then adds nothing to the loss or
    its gradient. Every backend agrees with the reference."""
    hidden, weight, labels, (term,) = terms_for(loss, seed=4)
    _, _, _, live = run("reference", hidden, weight, labels, [term])
    kd_ratio = 0.0 if zero == "kd_ratio" else 0.6
    if zero == "weight":
        term.weight = torch.zeros((), dtype=F64)  # as `best` mode gives it: a 0-dim tensor
    ce_only = run(
        "reference", hidden, weight, labels, [], kd_ratio=1.0 if zero == "weight" else 0.0
    )
    for backend in ("chunked", "reference"):
        got, got_h, got_w, metrics = run(backend, hidden, weight, labels, [term], kd_ratio)
        assert metrics[f"kd/{loss}"].item() == pytest.approx(live[f"kd/{loss}"].item(), rel=1e-10)
        assert metrics[f"kd/{loss}"] > 0
        if zero == "kd_ratio":  # CE alone, exactly
            assert abs(got.item() - ce_only[0].item()) <= 1e-12 * abs(ce_only[0].item())
            assert rel(got_w, ce_only[2]) < 1e-12
        else:  # kd_ratio 0.6 on a zero-weight term: 0.4 · CE
            assert got.item() == pytest.approx(0.4 * ce_only[3]["ce"].item(), rel=1e-10)
    # the fused pass (its PyTorch reference kernels on the CPU)
    _, fused = student_loss(
        hidden, weight, labels, [term], kd_ratio, ce_count(labels), 4, fused=True
    )
    assert fused[f"kd/{loss}"].item() == pytest.approx(live[f"kd/{loss}"].item(), rel=1e-10)


@pytest.mark.parametrize("loss", LOSSES)
def test_a_batch_of_padding_only_gives_zero_and_no_error(loss):
    """Validation pads the ranks short of a batch with an all-padding one: every loss takes it
    (no labels, no chunks) and gives exactly 0."""
    hidden, weight, labels, (term,) = terms_for(loss, seed=5)
    labels = torch.full_like(labels, -100)
    term.chunks, term.chunk_mask = term.chunks[:0], None
    term.targets = term.targets.__class__(
        **{
            f: (
                getattr(term.targets, f)[:0]
                if f.startswith(("topk", "tail"))
                else getattr(term.targets, f)
            )
            for f in (
                "topk_ids",
                "topk_logprobs",
                "tail_logprob",
                "next_logprobs",
                "next_valid",
                "temperature",
            )
        }
    )
    for backend in ("chunked", "reference"):
        got, _, _, metrics = run(backend, hidden, weight, labels, [term], ce_den=torch.ones(()))
        assert got.item() == 0.0 and metrics[f"kd/{loss}"].item() == 0.0

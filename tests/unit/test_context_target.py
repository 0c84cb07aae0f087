"""The context-aware target against a dense float64 reference on fresh random inputs: at a chunk
of one student token over several teacher tokens, the part of the observed teacher token's mass
that continues to the student's token moves to that token; nothing else changes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from crossdistill.errors import UserError
from crossdistill.losses import KDTerm, TeacherTargets, VocabProjection, project_topk, student_loss
from crossdistill.losses.plan import continuation
from crossdistill.losses.projection import Continuation
from tests.unit.test_losses_targets import _dense_target, _from_buckets, _random_targets

NEG_INF = float("-inf")
V_S = 9


def _projection(seed: int) -> VocabProjection:
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(-1, V_S, (15,), generator=gen)  # collisions and unmapped ids
    return VocabProjection.from_first_piece(first, num_student=V_S)


def _continuation(ids, seed: int, rows: int) -> Continuation:
    gen = torch.Generator().manual_seed(seed + 100)
    in_topk = ids[torch.arange(rows), torch.randint(0, ids.shape[1], (rows,), generator=gen)]
    other = torch.randint(0, 15, (rows,), generator=gen)
    use_topk = torch.rand(rows, generator=gen) < 0.8
    return Continuation(
        first_t=torch.where(use_topk, in_topk.long(), other),
        label=torch.randint(-1, V_S, (rows,), generator=gen),
        log_rest=-torch.rand(rows, generator=gen, dtype=torch.float64) * 3,
        active=torch.rand(rows, generator=gen) < 0.7,
    )


def _dense_context(ids, logq, tail, proj, c: Continuation) -> torch.Tensor:
    """The reference: the first-piece target, then q·r moved from the observed token's pieces
    (or the tail, where it has none) to the student's observed token."""
    out = _dense_target(ids, logq, tail, proj, V_S)
    for m in range(ids.shape[0]):
        row = ids[m].tolist()
        t = int(c.first_t[m])
        if not c.active[m] or c.label[m] < 0 or t not in row:
            continue
        moved = math.exp(logq[m, row.index(t)].item()) * math.exp(c.log_rest[m].item())
        piece = int(proj.first_piece[t])
        out[m, piece if piece >= 0 else V_S] -= moved
        out[m, int(c.label[m])] += moved
    return out


@pytest.mark.parametrize("seed", range(6))
def test_context_target_matches_dense_reference(seed):
    rows = 40
    ids, logq, tail = _random_targets(seed, rows=rows)
    proj = _projection(seed)
    c = _continuation(ids, seed, rows)
    got = _from_buckets(project_topk(ids, logq, tail, proj, c), V_S)
    want = _dense_context(ids, logq, tail, proj, c)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(got.sum(-1), torch.ones(rows, dtype=torch.float64))
    assert not got.isnan().any() and (got >= -1e-15).all()
    moved = (got - _dense_target(ids, logq, tail, proj, V_S)).abs().sum(-1) > 1e-12
    assert 5 < int(moved.sum()) < rows  # the draw exercises both cases


def test_no_active_chunk_gives_the_first_piece_target_exactly():
    ids, logq, tail = _random_targets(3, rows=12)
    proj = _projection(3)
    c = _continuation(ids, 3, 12)
    c.active = torch.zeros(12, dtype=torch.bool)
    got = _from_buckets(project_topk(ids, logq, tail, proj, c), V_S)
    assert torch.equal(got, _from_buckets(project_topk(ids, logq, tail, proj), V_S))


def test_certain_continuation_moves_all_of_the_observed_mass():
    """r = 1 (the teacher is sure of the rest of the chunk): the teacher token's pieces keep
    nothing of it, with no NaN from log(1 − r)."""
    ids, logq, tail = _random_targets(4, rows=3)
    proj = VocabProjection.from_first_piece(torch.arange(15) % V_S, num_student=V_S)
    c = Continuation(ids[:, 0].long(), torch.tensor([8, 8, 8]), torch.zeros(3), torch.ones(3) > 0)
    got = _from_buckets(project_topk(ids, logq, tail, proj, c), V_S)
    torch.testing.assert_close(got, _dense_context(ids, logq, tail, proj, c), rtol=1e-10, atol=0)


def _term(first_t=None, loss="forward_kl"):
    """One sequence: student tokens [a, b, c, d] over teacher tokens [A, B1, B2, C, D] where
    student b spans teacher B1 B2 (chunk 1), the rest 1:1."""
    chunks = torch.tensor([[0, 1, 0, 1], [1, 2, 1, 3], [2, 3, 3, 4], [3, 4, 4, 5]])
    gen = torch.Generator().manual_seed(0)
    logp = torch.randn(5, 15, generator=gen, dtype=torch.float64).log_softmax(-1)
    kd_rows = torch.tensor([0, 0, 2, 3])  # teacher row t0 − 1 of each chunk (chunk 0: none)
    top, tid = logp[kd_rows].topk(6, -1)
    tail = logp[kd_rows].scatter(1, tid, NEG_INF).logsumexp(-1)
    next_ids = torch.tensor([3, 4, 5, 6, -1])  # teacher tokens A..D as ids; B1 = 3, B2 = 4
    next_lp = logp.gather(1, next_ids.clamp(min=0).view(-1, 1)).squeeze(1)
    targets = TeacherTargets(tid.int(), top, tail, torch.where(next_ids >= 0, next_lp, 0.0),
                             next_ids >= 0)  # fmt: skip
    return KDTerm(targets, _projection(11), chunks, torch.tensor(3.0), loss=loss,
                  first_t=first_t)  # fmt: skip


def test_continuation_reads_the_chunk_the_teacher_and_the_labels():
    term = _term(first_t=torch.tensor([2, 3, 5, 6]))
    labels = torch.tensor([7, 1, 2, -100])
    c = continuation(term, labels)
    assert c.active.tolist() == [False, True, False, False]
    assert c.label.tolist() == [-1, 7, 1, 2]
    # chunk 1 covers teacher tokens 1, 2: the rest after token 1 is token 2, predicted on row 1
    assert c.log_rest[1].item() == pytest.approx(term.targets.next_logprobs[1].item(), abs=1e-14)
    assert continuation(_term(), labels) is None


def test_context_term_trains_and_changes_only_the_multi_token_chunk():
    """Through `student_loss` (full-logits reference): with the context target the KD value
    differs from the first-piece one, by the split at chunk 1 only."""
    torch.manual_seed(0)
    hidden = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V_S, 8, dtype=torch.float64)
    labels = torch.tensor([7, 1, 2, -100])
    plain, ctx = _term(), _term(first_t=torch.tensor([2, 3, 5, 6]))
    out = {}
    for name, term in (("plain", plain), ("ctx", ctx)):
        loss, metrics = student_loss(hidden, head, labels, [term], kd_ratio=1.0, ce_denominator=3)
        (grad,) = torch.autograd.grad(loss, hidden)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        out[name] = (loss.item(), grad)
    assert out["plain"][0] != out["ctx"][0]
    rows_changed = (out["plain"][1] - out["ctx"][1]).abs().sum(-1) > 0
    assert rows_changed.tolist() == [True, False, False, False]  # row 0 predicts chunk 1


def test_context_target_needs_a_projected_loss():
    with pytest.raises(UserError, match="context target needs a projected loss"):
        _term(first_t=torch.tensor([2, 3, 5, 6]), loss="chunk_likelihood").check()
    from crossdistill.train.validate import _check_top_k

    t = SimpleNamespace(loss="gold", target="context", top_k=8, alpha=0.1)
    with pytest.raises(UserError, match="teachers.0.target = context needs a projected loss"):
        _check_top_k(t, 0, 100, 100)


def context_terms(seed: int, **problem):
    """`terms_for`'s random problem with the context target on (the observed teacher token is
    each chunk's second most likely one, so the split happens)."""
    from tests.unit.test_losses_student import terms_for

    hidden, weight, labels, terms = terms_for("forward_kl", seed=seed, **problem)
    terms[0].first_t = terms[0].targets.topk_ids[:, 1].long()
    assert continuation(terms[0], labels).active.sum() >= 3
    return hidden, weight, labels, terms


def test_chunked_and_reference_passes_agree_with_the_context_target():
    from crossdistill.losses import ce_count
    from tests.unit.test_losses_student import rel, run

    hidden, weight, labels, terms = context_terms(5)
    got = {b: run(b, hidden, weight, labels, terms) for b in ("chunked", "reference")}
    (lc, hc, wc, _), (lr, hr, wr, _) = got["chunked"], got["reference"]
    assert torch.isfinite(lc) and abs(lc.item() - lr.item()) <= 1e-10 * abs(lr.item())
    assert rel(hc, hr) < 1e-10 and rel(wc, wr) < 1e-10
    first_piece = run("reference", hidden, weight, labels, [_without_context(terms[0])])
    assert abs(first_piece[0].item() - lr.item()) > 1e-6  # the target did change
    assert ce_count(labels) > 0


def _without_context(term):
    import dataclasses

    return dataclasses.replace(term, first_t=None)


def test_a_certain_continuation_trains_without_nan():
    """A teacher sure of the rest of the chunk (log-prob 0, as float32 rounds a confident one):
    the observed token's piece keeps a bucket of probability 0; loss and gradient stay finite."""
    torch.manual_seed(1)
    term = _term(first_t=torch.tensor([2, 3, 5, 6]))
    term.targets.next_logprobs[1] = 0.0
    term.targets.topk_ids[1, 0] = 3  # the observed first teacher token is the most likely one
    hidden = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V_S, 8, dtype=torch.float64)
    labels = torch.tensor([7, 1, 2, -100])
    for backend in ("chunked", "reference"):
        loss, _ = student_loss(hidden, head, labels, [term], 1.0, 3, backend=backend)
        (grad,) = torch.autograd.grad(loss, hidden)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()

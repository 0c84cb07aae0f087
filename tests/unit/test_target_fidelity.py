"""`benchmarks/target_fidelity.py`: the per-row KD loss it reads off the reference path, against
the reference's own total and against a float64 loss written out plainly, and its row classes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.target_fidelity import (
    LARGE_DROP,
    boundary_drops,
    bucket_reach,
    classes_by_row,
    observed_split,
    row_losses,
    seed_floor,
)
from crossdistill.losses import KDTerm, VocabProjection, kd_count, kd_positions, teacher_targets
from tests.unit.test_losses_student import make_problem, plain_kd


def identity_problem(seed: int, n: int = 12, v: int = 20, h: int = 5, k: int = 6):
    """A model on the student's tokenizer as its own teacher, one token per chunk: its hidden
    states, lm_head, labels, its top-k KD term through the identity projection, and the
    generator to draw more from."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=gen)
    idx = torch.arange(n)
    chunks = torch.stack([idx, idx + 1, idx, idx + 1], 1)
    targets = teacher_targets(hidden, weight, kd_positions(chunks)[1], labels, k)
    term = KDTerm(targets, VocabProjection.identity(v), chunks, torch.tensor(1.0), "forward_kl")
    return hidden, weight, labels, term, gen


def test_row_losses_add_up_to_the_plain_float64_loss():
    """Each KD row's value is the plain forward KL of the projected target against the
    stand-in's distribution there; rows without KD are NaN."""
    hidden, weight, labels, chunks, targets, proj = make_problem(3)
    term = KDTerm(targets, proj, chunks, torch.tensor(1.0), "forward_kl")
    term.denominator = torch.ones((), dtype=torch.float64)
    got = row_losses(term, labels, hidden, weight)
    z = hidden @ weight.t()
    kd_rows = 0
    for c in range(chunks.shape[0]):
        s0 = int(chunks[c, 0])
        if kd_positions(chunks[c : c + 1])[0].item() < 0:
            continue
        want = plain_kd("forward_kl", z[s0 - 1], targets, c, proj, 1.0, {})
        if not np.isnan(got[s0 - 1]):
            kd_rows += 1
            assert abs(got[s0 - 1] - float(want)) <= 1e-10 * max(1.0, abs(float(want)))
    assert kd_rows == int(kd_count(term, labels)) > 3
    assert np.isnan(got).sum() == got.shape[0] - kd_rows


def test_a_model_standing_in_for_itself_pays_nothing():
    """One model on both sides through the identity projection: its top-k and tail are its own
    distribution's buckets, so every row's forward KL is 0."""
    hidden, weight, labels, term, _ = identity_problem(0)
    got = row_losses(term, labels, hidden, weight)
    kd = got[~np.isnan(got)]
    assert kd.size == hidden.shape[0] - 1 and np.abs(kd).max() < 1e-12


def test_classes_by_row_put_each_chunk_at_its_kd_position():
    chunks = np.array([[0, 1, 0, 1], [1, 3, 1, 2], [3, 4, 2, 4], [4, 5, 0, 1]])
    text, align = np.array([2, 0, 0, 1]), np.array([0, 2, 1, 0])
    t, a = classes_by_row(chunks, text, align, 6)
    # chunk 0 starts the sequence and chunk 3 its teacher side: no KD position; chunk 1's is
    # row 0, chunk 2's row 2
    assert t.tolist() == [0, -1, 0, -1, -1, -1]
    assert a.tolist() == [2, -1, 1, -1, -1, -1]


def _plain_bucket_kl(p, q, buckets):
    """Forward KL between two float64 distributions summed into `buckets` (lists of ids)."""
    total = 0.0
    for ids in buckets:
        a, b = sum(float(p[i]) for i in ids), sum(float(q[i]) for i in ids)
        total += a * math.log(a / b) if a > 0 else 0.0
    return total


def test_bucket_reach_against_plain_float64_sums():
    """`full`, `own` and `target` are the forward KL from the reference to the other model over
    the whole vocabulary, over the reference's top-k and the rest, and over the first-piece
    target's buckets (each student id holding its teacher tokens' mass, the rest the tail),
    written out plainly; a bucketed KL never exceeds the full one."""
    hidden, weight, labels, chunks, targets, proj = make_problem(5)
    term = KDTerm(targets, proj, chunks, torch.tensor(1.0), "forward_kl")
    term.denominator = torch.ones((), dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    other = (torch.randn(hidden.shape, generator=gen, dtype=torch.float64), weight)
    k = 4
    got = bucket_reach(term, labels, (hidden, weight), other, k, rows=5)
    p_all = torch.softmax(hidden @ weight.t(), 1)
    q_all = torch.softmax(other[0] @ weight.t(), 1)
    v_s = weight.shape[0]
    rows = 0
    for c in range(chunks.shape[0]):
        if kd_positions(chunks[c : c + 1])[0].item() < 0:
            continue
        r = int(chunks[c, 0]) - 1
        if np.isnan(got["target"][r]):
            continue
        rows += 1
        p, q = p_all[r], q_all[r]
        full = _plain_bucket_kl(p, q, [[i] for i in range(v_s)])
        top = p.topk(k).indices.tolist()
        own = _plain_bucket_kl(p, q, [[i] for i in top] + [[i for i in range(v_s) if i not in top]])
        images = sorted({int(proj.first_piece[t]) for t in targets.topk_ids[c].tolist()} - {-1})
        target = _plain_bucket_kl(
            p, q, [[i] for i in images] + [[i for i in range(v_s) if i not in images]]
        )
        for name, want in (("full", full), ("own", own), ("target", target)):
            assert abs(got[name][r] - want) <= 1e-12 * max(1.0, want), (name, r)
        assert got["own"][r] <= full + 1e-12 and got["target"][r] <= full + 1e-12
    assert rows == int(kd_count(term, labels)) > 3
    assert np.isnan(got["target"]).sum() == got["target"].shape[0] - rows


def test_bucket_reach_of_a_teacher_on_the_students_tokenizer_is_its_own_top_k():
    """Through the identity projection the target's buckets are the teacher's top-k and the
    tail: with that teacher as the reference, the target holds exactly what same-tokenizer KD
    holds."""
    hidden, weight, labels, term, gen = identity_problem(2)
    other = (torch.randn(hidden.shape, generator=gen, dtype=torch.float64), weight)
    got = bucket_reach(term, labels, (hidden, weight), other, 6)
    kd = ~np.isnan(got["target"])
    assert kd.sum() == hidden.shape[0] - 1
    assert np.abs(got["target"][kd] - got["own"][kd]).max() < 1e-12
    assert (got["full"][kd] > got["own"][kd]).all()


def test_observed_split_against_plain_float64_sums():
    """At each KD row: the first-piece target's and the reference's probability of the bucket
    holding the text's token (its student id, or the tail when no top-k teacher token lands
    there), the whole KL, which is `row_losses`' value, and the two-way KL of that bucket
    against the rest, written out plainly."""
    hidden, weight, labels, chunks, targets, proj = make_problem(7)
    term = KDTerm(targets, proj, chunks, torch.tensor(1.0), "forward_kl")
    term.denominator = torch.ones((), dtype=torch.float64)
    got = observed_split(term, labels, (hidden, weight), rows=4)
    whole = row_losses(term, labels, hidden, weight)
    p_all = torch.softmax(hidden @ weight.t(), 1)
    tails = seen = 0
    for c in range(chunks.shape[0]):
        r = int(chunks[c, 0]) - 1
        if kd_positions(chunks[c : c + 1])[0].item() < 0 or np.isnan(got["kl"][r]):
            continue
        seen += 1
        q = targets.topk_logprobs[c].exp()
        mass: dict[int, float] = {}
        for t, w in zip(targets.topk_ids[c].tolist(), q.tolist()):
            s = int(proj.first_piece[t])
            mass[s] = mass.get(s, 0.0) + w  # -1: the tail
        mass[-1] = mass.get(-1, 0.0) + float(targets.tail_logprob[c].exp())
        label = int(labels[r])
        own = label if label in mass else -1
        singles = [i for i in mass if i >= 0]
        p_tail = 1.0 - sum(float(p_all[r, i]) for i in singles)
        p_of = {i: float(p_all[r, i]) for i in singles} | {-1: p_tail}
        t_obs, p_obs = mass[own], p_of[own]
        kl = sum(m * math.log(m / p_of[i]) for i, m in mass.items() if m > 0)
        two = t_obs * math.log(t_obs / p_obs) + (1 - t_obs) * math.log((1 - t_obs) / (1 - p_obs))
        for name, want in (("t_obs", t_obs), ("p_obs", p_obs), ("kl", kl), ("kl_obs", two)):
            assert abs(got[name][r] - want) <= 1e-10 * max(1.0, abs(want)), (name, r)
        assert abs(got["kl"][r] - whole[r]) <= 1e-10 * max(1.0, abs(whole[r]))
        assert got["in_tail"][r] == float(own == -1)
        tails += own == -1
    no_token = sum(
        1
        for c in range(chunks.shape[0])
        if kd_positions(chunks[c : c + 1])[0].item() >= 0 and labels[int(chunks[c, 0]) - 1] < 0
    )
    assert seen == int(kd_count(term, labels)) - no_token > 3
    assert np.isnan(got["kl"]).sum() == got["kl"].shape[0] - seen
    assert 0 < tails < seen  # both kinds of row are checked


def test_seed_floor_is_same_tokenizer_kd_from_the_other_seed():
    """The floor at each KD row is the forward KL from the other seed's model to the reference
    over the other seed's own top-k and the rest, written out plainly: the loss the reference
    pays under same-tokenizer KD from it; a model against itself pays nothing."""
    hidden, weight, labels, chunks, targets, proj = make_problem(7)
    term = KDTerm(targets, proj, chunks, torch.tensor(1.0), "forward_kl")
    term.denominator = torch.ones((), dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    other = (hidden + 0.7 * torch.randn(hidden.shape, generator=gen, dtype=torch.float64), weight)
    k = 4
    got = seed_floor(term, labels, other, (hidden, weight), k, rows=3)
    p_all = torch.softmax(other[0] @ weight.t(), 1)
    q_all = torch.softmax(hidden @ weight.t(), 1)
    v_s = weight.shape[0]
    kd = ~np.isnan(got)
    assert kd.sum() == int(kd_count(term, labels)) > 3
    for r in np.nonzero(kd)[0]:
        p, q = p_all[r], q_all[r]
        top = p.topk(k).indices.tolist()
        want = _plain_bucket_kl(
            p, q, [[i] for i in top] + [[i for i in range(v_s) if i not in top]]
        )
        assert abs(got[r] - want) <= 1e-12 * max(1.0, want) and want > 0
    same = seed_floor(term, labels, (hidden, weight), (hidden, weight), k)
    assert np.abs(same[kd]).max() < 1e-12


@pytest.mark.parametrize("seed", [4, 8])
def test_boundary_drops_count_each_kd_row_as_written_out(seed):
    """Per KD row (a chunk's first student row less one): whether any top-k entry is dropped,
    the teacher's mass dropped, summed by hand, and whether that is over `LARGE_DROP`; NaN at
    rows that are no KD position."""
    from tests.unit.test_boundaries import with_table
    from tests.unit.test_losses_student import terms_for

    _, _, labels, (term,) = terms_for("forward_kl", seed=seed)
    term = with_table(term, 1, seed=seed)
    got = boundary_drops(term, labels.shape[0])
    b, before, tg = term.projection.boundaries, term.before, term.targets
    seen = large = 0
    for c, (s0, _, _, _) in enumerate(term.chunks.tolist()):
        if before[c, 0] < 0:
            continue
        u, t, first = before[c].tolist()
        mass = 0.0
        for x, lp in zip(tg.topk_ids[c].tolist(), tg.topk_logprobs[c].tolist()):
            byte = int(b.first_byte[x])
            if x == first or byte < 0:
                continue
            if (
                u * 256 + byte in b.blocked_s.tolist()
                and t * 256 + byte not in b.blocked_t.tolist()
            ):
                mass += math.exp(lp)
        assert got["mass"][s0 - 1] == pytest.approx(mass, abs=1e-12)
        assert got["any"][s0 - 1] == float(mass > 0)
        assert got["large"][s0 - 1] == float(mass > LARGE_DROP)
        seen += mass > 0
        large += mass > LARGE_DROP
    assert seen > large > 0
    kd_rows = {s0 - 1 for c, (s0, _, _, _) in enumerate(term.chunks.tolist()) if before[c, 0] >= 0}
    assert all(np.isnan(got["mass"][r]) for r in range(labels.shape[0]) if r not in kd_rows)

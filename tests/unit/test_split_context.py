"""`benchmarks/split_context.py` and the counts under it (`train.short_share`): the boundary
events are the ones the split's share has always been counted on, the pair shares are drawn
toward each token's own share as the module says, and the two log-losses are the binary
log-losses of the shares they name."""

from __future__ import annotations

import math

import numpy as np

from benchmarks.split_context import log_losses, top_pairs
from tests.unit.test_teacher_boundary_share import TEXTS


def test_events_are_the_shares_boundaries(tokenizer_dir):
    """The events against the per-token counting as it was before the events existed."""
    from crossdistill.alignment.projection import build_projection
    from crossdistill.models import load_tokenizer
    from crossdistill.train.auto_target import aligned_sample
    from crossdistill.train.short_share import boundary_events, counts_of

    tok_s = load_tokenizer(str(tokenizer_dir("llama3")))
    tok_t = load_tokenizer(str(tokenizer_dir("mistral")))
    first = build_projection(tok_t, tok_s).first_piece.numpy()
    of_student = build_projection(tok_s, tok_t).first_piece.numpy()
    texts = TEXTS * 3
    events = boundary_events(tok_s, tok_t, texts, first, of_student)
    want_short, want_longer, want_prev = np.zeros_like(first), np.zeros_like(first), []
    for ids_s, ids_t, chunks in aligned_sample(tok_s, tok_t, texts):
        for s0, s1, t0, t1 in chunks.tolist():
            x, s = int(ids_t[t0]), int(ids_s[s0])
            if s1 - s0 != 1 or x < 0 or s < 0:
                continue
            if t1 - t0 == 1 and first[x] == s:
                want_short[x] += 1
            elif t1 - t0 > 1 and of_student[s] == x:
                want_longer[x] += 1
            else:
                continue
            want_prev.append(int(ids_s[s0 - 1]) if s0 > 0 else -1)
    short, longer = counts_of(events, len(first))
    np.testing.assert_array_equal(short, want_short)
    np.testing.assert_array_equal(longer, want_longer)
    assert events[:, 1].tolist() == want_prev
    assert short.sum() > 0 and longer.sum() > 0 and max(want_prev) >= 0


def test_pair_shares_by_hand():
    from crossdistill.train.short_share import PRIOR_COUNT, pair_shares

    shares = np.array([0.25, 0.5, 0.9])
    events = np.array([[1, 7, 1], [1, 7, 1], [1, 2, 0], [2, 2, 1], [0, -1, 1]], dtype=np.int64)
    keys, got = pair_shares(events, shares)
    assert keys.tolist() == [2 * 3 + 1, 2 * 3 + 2, 7 * 3 + 1]  # sorted u·V_t + x; no u: none
    want = [
        (0 + PRIOR_COUNT * 0.5) / (1 + PRIOR_COUNT),
        (1 + PRIOR_COUNT * 0.9) / (1 + PRIOR_COUNT),
        (2 + PRIOR_COUNT * 0.5) / (2 + PRIOR_COUNT),
    ]
    np.testing.assert_allclose(got, want, rtol=1e-15)


def test_log_losses_by_hand():
    from crossdistill.train.short_share import PRIOR_COUNT

    # token 0: exact after student token 7, longer after 8, three times each
    counted = np.array([[0, 7, 1]] * 3 + [[0, 8, 0]] * 3, dtype=np.int64)
    read = np.array([[0, 7, 1], [0, 8, 0], [0, 9, 1]], dtype=np.int64)
    got = log_losses(counted, read, 2)
    pi = (3 + PRIOR_COUNT * 0.5) / (6 + PRIOR_COUNT)  # the overall share is one half
    by_7 = (3 + PRIOR_COUNT * pi) / (3 + PRIOR_COUNT)
    by_8 = (0 + PRIOR_COUNT * pi) / (3 + PRIOR_COUNT)
    want = -(math.log(pi) + math.log(1 - pi) + math.log(pi)) / 3
    want_prev = -(math.log(by_7) + math.log(1 - by_8) + math.log(pi)) / 3
    assert got["events"] == 3 and got["exact_rate"] == 2 / 3
    assert math.isclose(got["share"], want, rel_tol=1e-12)
    assert math.isclose(got["share_by_previous"], want_prev, rel_tol=1e-12)
    assert got["share_by_previous"] < got["share"]  # the previous token tells here
    assert got["ambiguous"] == 1.0
    assert math.isclose(got["share_ambiguous"], want, rel_tol=1e-12)
    # the share counted on a smaller sample: two events, one exact and one longer
    small = log_losses(counted, read, 2, sampled=counted[2:4])
    pi_small = (1 + PRIOR_COUNT * 0.5) / (2 + PRIOR_COUNT)
    want_small = -(math.log(pi_small) + math.log(1 - pi_small) + math.log(pi_small)) / 3
    assert math.isclose(small["share_sampled"], want_small, rel_tol=1e-12)
    assert "share_sampled" not in got


def test_top_pairs_put_the_furthest_frequent_pair_first(tokenizer_dir):
    from crossdistill.models import load_tokenizer
    from crossdistill.train.short_share import PRIOR_COUNT

    tok_s = load_tokenizer(str(tokenizer_dir("llama3")))
    tok_t = load_tokenizer(str(tokenizer_dir("mistral")))
    # teacher token 5: exact after student token 10 (eight times), longer after 11 (eight
    # times) and after 12 (twice, level with the token); the third pair is the nearest
    events = np.array(
        [[5, 10, 1]] * 8 + [[5, 11, 0]] * 8 + [[5, 12, 1], [5, 12, 0]], dtype=np.int64
    )
    got = top_pairs(tok_s, tok_t, events, 40, 3)
    assert [p["previous"] for p in got][2] == tok_s.decode([12])
    assert {p["previous"] for p in got[:2]} == {tok_s.decode([10]), tok_s.decode([11])}
    pi = (9 + PRIOR_COUNT * 0.5) / (18 + PRIOR_COUNT)
    assert all(p["teacher"] == tok_t.convert_ids_to_tokens(5) for p in got)
    assert all(abs(p["token_share"] - pi) < 1e-12 for p in got)
    first = next(p for p in got if p["previous"] == tok_s.decode([10]))
    assert first["count"] == 8
    assert abs(first["pair_share"] - (8 + PRIOR_COUNT * pi) / (8 + PRIOR_COUNT)) < 1e-12

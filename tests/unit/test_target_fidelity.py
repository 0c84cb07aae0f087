"""`benchmarks/target_fidelity.py`: the per-row KD loss it reads off the reference path, against
the reference's own total and against a float64 loss written out plainly, and its row classes."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.target_fidelity import classes_by_row, row_losses
from crossdistill.losses import KDTerm, VocabProjection, kd_count, kd_positions, teacher_targets
from tests.unit.test_losses_student import make_problem, plain_kd


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
    gen = torch.Generator().manual_seed(0)
    n, v, h = 12, 20, 5
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(v, h, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=gen)
    idx = torch.arange(n)
    chunks = torch.stack([idx, idx + 1, idx, idx + 1], 1)
    targets = teacher_targets(hidden, weight, kd_positions(chunks)[1], labels, 6)
    term = KDTerm(targets, VocabProjection.identity(v), chunks, torch.tensor(1.0), "forward_kl")
    got = row_losses(term, labels, hidden, weight)
    kd = got[~np.isnan(got)]
    assert kd.size == n - 1 and np.abs(kd).max() < 1e-12


def test_classes_by_row_put_each_chunk_at_its_kd_position():
    chunks = np.array([[0, 1, 0, 1], [1, 3, 1, 2], [3, 4, 2, 4], [4, 5, 0, 1]])
    text, align = np.array([2, 0, 0, 1]), np.array([0, 2, 1, 0])
    t, a = classes_by_row(chunks, text, align, 6)
    # chunk 0 starts the sequence and chunk 3 its teacher side: no KD position; chunk 1's is
    # row 0, chunk 2's row 2
    assert t.tolist() == [0, -1, 0, -1, -1, -1]
    assert a.tolist() == [2, -1, 1, -1, -1, -1]

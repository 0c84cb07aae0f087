"""The two-kernel flow of the chunked pass (`losses.kernels`, `losses.chunk_math.chunk_step_fused`): on CPU its kernels run as their
PyTorch references, so the flow around them is checked here against the plain PyTorch pass."""

from __future__ import annotations

import pytest
import torch

from crossdistill.losses import LOSSES, ce_count, student_loss
from crossdistill.losses.kernels import bucket_bits, row_stats_torch
from tests.unit.test_losses_student import rel, terms_for


def _both(hidden, weight, labels, terms, chunk=4):
    out = []
    for fused in (False, True):
        h = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        loss, metrics = student_loss(h, w, labels, terms, 0.6, ce_count(labels), chunk, fused=fused)
        loss.backward()
        out.append((loss.detach(), h.grad, w.grad, metrics))
    return out


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("loss", LOSSES)
def test_fused_flow_matches_the_plain_pass(loss, tau):
    plain, fused = _both(*terms_for(loss, seed=30, tau=tau))
    assert abs(fused[0].item() - plain[0].item()) <= 1e-13 * plain[0].item()
    assert rel(fused[1], plain[1]) < 1e-13 and rel(fused[2], plain[2]) < 1e-13
    assert all(abs(fused[3][k] - plain[3][k]) < 1e-12 for k in plain[3])


def test_fused_flow_with_several_temperatures():
    terms = []
    for i, (loss, tau) in enumerate([("forward_kl", 2.0), ("jsd", 1.0), ("uld", 3.0)]):
        hidden, weight, labels, (term,) = terms_for(loss, seed=31 + i, tau=tau)
        terms.append(term)
    hidden, weight, labels, _ = terms_for("tvd", seed=31)
    plain, fused = _both(hidden, weight, labels, terms, chunk=5)
    assert abs(fused[0].item() - plain[0].item()) <= 1e-13 * plain[0].item()
    assert rel(fused[1], plain[1]) < 1e-13 and rel(fused[2], plain[2]) < 1e-13


def test_bucket_bits_mark_exactly_the_valid_ids():
    gen = torch.Generator().manual_seed(32)
    vocab = 100
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:7] for _ in range(5)])
    valid = torch.rand(5, 7, generator=gen) < 0.7
    words = bucket_bits(ids, valid, vocab)
    for r in range(5):
        marked = {c for c in range(vocab) if (words[r, c // 32] >> (c % 32)) & 1}
        assert marked == set(ids[r][valid[r]].tolist())


def test_row_stats_reference_matches_plain_sums():
    gen = torch.Generator().manual_seed(33)
    z = torch.randn(4, 70, generator=gen, dtype=torch.float64) * 3
    ids = torch.stack([torch.randperm(70, generator=gen)[:5] for _ in range(4)])
    zmax, arg, s, tail = row_stats_torch(z, [1.0, 2.5], [bucket_bits(ids, None, 70)], [1])
    assert torch.equal(arg, z.argmax(1))
    for r in range(4):
        e1 = (z[r] - z[r].max()).exp()
        e2 = ((z[r] - z[r].max()) / 2.5).exp()
        out = [c for c in range(70) if c not in ids[r].tolist()]
        assert abs(s[r, 0] - e1.sum()) < 1e-12 and abs(s[r, 1] - e2.sum()) < 1e-12
        assert abs(tail[r, 0] - e2[out].sum()) < 1e-12


_INTERPRETED = """
import torch
from crossdistill.losses import kernels as fz
g = torch.Generator().manual_seed(0)
for c, vocab, taus, parts, dtype in [
    (3, 40000, [1.0], 1, torch.float32), (2, 70001, [1.0, 2.0], 2, torch.float32),
    (2, 5000, [0.5, 1.0, 3.0], 0, torch.float32), (2, 33000, [1.0], 1, torch.bfloat16),
    (2, 128 * 37, [1.0, 0.7], 1, torch.bfloat16),
]:
    z = (torch.randn(c, vocab, generator=g) * 3).to(dtype)
    masks = []
    for _ in range(parts):
        ids = torch.stack([torch.randperm(vocab, generator=g)[:7] for _ in range(c)])
        masks.append(fz.bucket_bits(ids, torch.rand(c, 7, generator=g) > 0.2, vocab))
    mask_tau = [p % len(taus) for p in range(parts)]
    got = fz.row_stats_triton(z, taus, masks, mask_tau)
    want = fz.row_stats_torch(z, taus, masks, mask_tau)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(got[2:], want[2:]):
        assert ((a - b).abs() <= 1e-6 * b.abs()).all()
    if vocab % 128 == 0:  # the per-block maxima and sums of the teacher targets
        b_got = fz.block_stats_triton(z, 128, taus)
        b_want = fz.block_stats_torch(z, 128, taus)
        assert torch.equal(b_got[0], b_want[0])
        assert ((b_got[1] - b_want[1]).abs() <= 1e-6 * b_want[1]).all()
    coef = torch.randn(c, len(taus), generator=g)
    a = fz.logit_grad_triton(z.clone().float(), want[0], taus, coef, torch.float32)
    b = fz.logit_grad_torch(z.clone().float(), want[0], taus, coef, torch.float32)
    assert (a - b).abs().max() <= 1e-6 * b.abs().max()
print("ok")
"""


def test_triton_kernels_match_reference_in_the_interpreter():
    """The Triton kernels themselves, run by Triton's CPU interpreter where Triton is installed
    (the GPU tests run them compiled)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]

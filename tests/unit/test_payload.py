"""The byte buffer a separate teacher sends: exact unquantised, int8 as the teacher cache reads
it, checked against a float64 reference on fresh random targets."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from crossdistill.losses import TeacherTargets
from crossdistill.losses.payload import (
    batch_id,
    pack_targets,
    payload_nbytes,
    unpack_targets,
)


def _targets(m: int, k: int, n: int, vocab: int, seed: int) -> TeacherTargets:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, vocab, generator=g, dtype=torch.float64) * 3
    lp = torch.log_softmax(logits, dim=-1)
    top, ids = lp.topk(k, dim=-1)
    tail = torch.log1p(-top.exp().sum(-1).clamp(max=1 - 1e-12))
    valid = torch.rand(n, generator=g) > 0.2
    next_lp = torch.where(valid, -torch.rand(n, generator=g, dtype=torch.float64) * 9, 0.0)
    return TeacherTargets(ids, top.float(), tail.float(), next_lp.float(), valid)


@pytest.mark.parametrize("seed", range(4))
def test_unquantised_payload_is_bit_exact(seed):
    t = _targets(37, 16, 45, 300, seed)
    buf = pack_targets(t, "none")
    assert buf.dtype == torch.uint8 and buf.numel() == payload_nbytes(37, 16, 45, "none")
    got = unpack_targets(buf, 37, 16, 45, "none", 1.0)
    assert torch.equal(got.topk_ids.long(), t.topk_ids)
    for name in ("topk_logprobs", "tail_logprob", "next_logprobs", "next_valid"):
        assert torch.equal(getattr(got, name), getattr(t, name)), name


@pytest.mark.parametrize("seed", range(4))
def test_int8_payload_matches_a_float64_reference(seed):
    t = _targets(29, 32, 31, 500, seed)
    buf = pack_targets(t, "int8")
    assert buf.numel() == payload_nbytes(29, 32, 31, "int8")
    got = unpack_targets(buf, 29, 32, 31, "int8", 1.0)
    # reference: codes in steps of 1/8 nat, then each row with its tail renormalised
    codes = np.clip(np.rint(-t.topk_logprobs.double().numpy() * 8), 0, 255)
    lp = -codes / 8
    tail = t.tail_logprob.double().numpy()
    both = np.concatenate([lp, tail[:, None]], axis=1)
    lse = np.array([math.log(sum(math.exp(x) for x in row)) for row in both])
    np.testing.assert_allclose(got.topk_logprobs.numpy(), lp - lse[:, None], rtol=0, atol=2e-6)
    np.testing.assert_allclose(got.tail_logprob.numpy(), tail - lse, rtol=0, atol=2e-6)
    total = torch.logsumexp(torch.cat([got.topk_logprobs, got.tail_logprob[:, None]], 1), 1)
    assert torch.isfinite(total).all() and total.abs().max() < 1e-5
    assert torch.equal(got.topk_ids.long(), t.topk_ids)  # ids travel whole
    assert torch.equal(got.next_logprobs, t.next_logprobs)
    # within half a step of the teacher's own log-probs, before renormalisation
    assert (
        got.topk_logprobs + torch.from_numpy(lse).float()[:, None] - t.topk_logprobs
    ).abs().max() <= 1 / 16 + 1e-6


def test_int8_payload_reads_as_the_teacher_cache_does():
    """The cache stores a row in id order, quantised the same way (its tail in float16): both
    give the same ids and, up to the cache's float16 tail, the same renormalised row."""
    from crossdistill.data.teacher_cache import DocTargets, decode_record, encode_record

    t = _targets(12, 8, 12, 200, 7)
    doc = DocTargets(
        ids=np.arange(12),
        text_bytes=np.ones(12, dtype=np.int64),
        next_logprobs=t.next_logprobs.numpy(),
        topk_ids=t.topk_ids.int().numpy(),
        topk_logprobs=t.topk_logprobs.numpy(),
        tail_logprob=t.tail_logprob.numpy(),
    )
    blob, raw = encode_record(doc, "int8")
    cached = decode_record(blob, raw, 12, 8, "int8")
    sent = unpack_targets(pack_targets(t, "int8"), 12, 8, 12, "int8", 1.0)
    order = np.argsort(sent.topk_ids.numpy(), axis=1)
    corder = np.argsort(cached.topk_ids, axis=1)
    np.testing.assert_array_equal(
        np.take_along_axis(sent.topk_ids.numpy(), order, 1),
        np.take_along_axis(cached.topk_ids, corder, 1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(sent.topk_logprobs.numpy(), order, 1),
        np.take_along_axis(cached.topk_logprobs, corder, 1),
        rtol=0,
        atol=1e-3,
    )
    np.testing.assert_allclose(sent.tail_logprob.numpy(), cached.tail_logprob, atol=1e-2)


def test_batch_id_names_the_batch():
    ids = torch.randint(0, 1000, (2, 16))
    labels = ids.clone()
    labels[:, :3] = -100
    a = batch_id(3, ids, labels)
    assert torch.equal(a, batch_id(3, ids.clone(), labels.clone()))
    assert not torch.equal(a, batch_id(4, ids, labels))
    other = ids.clone()
    other[1, 5] += 1
    assert not torch.equal(a, batch_id(3, other, labels))
    masked = labels.clone()
    masked[0, 7] = -100
    assert not torch.equal(a, batch_id(3, ids, masked))


def test_a_buffer_of_another_size_is_refused():
    t = _targets(4, 4, 5, 50, 0)
    buf = pack_targets(t, "none")
    with pytest.raises(ValueError, match="payload holds"):
        unpack_targets(torch.cat([buf, buf[:4]]), 4, 4, 5, "none", 1.0)

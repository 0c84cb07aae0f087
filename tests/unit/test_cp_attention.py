"""Context-parallel attention's two forms agree: the flash form (each rank's pieces cut into
document segments, queries against their documents' gathered keys, separate query and key
lengths) against the masked form (SDPA under the packed-document causal mask over every
gathered key), on random packed rows with documents shorter and longer than a piece, padding,
several batch rows, grouped-query heads and cp = 2, 3. On the CPU the segments run through
`varlen_reference`; on a GPU through the flash kernel itself (bf16, against float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from crossdistill.distributed.cp import (
    cp_mask,
    cp_segments,
    gathered_order,
    load_balanced_index,
)
from crossdistill.models.attention import varlen_reference


def _positions(seed: int, batch: int, length: int) -> torch.Tensor:
    """Packed rows: documents of random lengths (1 token to longer than the row), then padding
    of zeros at the end of some rows."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < length:
            n = int(torch.randint(1, length + length // 2, (1,), generator=g))
            if torch.rand(1, generator=g) < 0.5:
                n = max(1, n // 8)
            row.extend(range(n))
        row = row[:length]
        pad = int(torch.randint(0, length // 4, (1,), generator=g))
        if pad:
            row[-pad:] = [0] * pad
        rows.append(row)
    return torch.tensor(rows)


def _inputs(seed: int, batch: int, length: int, heads=(4, 2), dim=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h, h_kv = heads
    q = torch.randn(batch, h, length, dim, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, h_kv, length, dim, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def _both(q, k, v, pos, cp, rank, attend):
    """(masked form, segment form) of rank `rank`'s attention, `[B, T/cp, H, D]` each."""
    b, h, t, d = q.shape
    mine = load_balanced_index(t, cp, rank)
    order = gathered_order(t, cp)
    q_local, k_all, v_all = q[:, :, mine], k[:, :, order], v[:, :, order]
    masked = F.scaled_dot_product_attention(
        q_local, k_all, v_all, attn_mask=cp_mask(pos, cp, rank), enable_gqa=True
    ).transpose(1, 2)
    seg = cp_segments(pos, cp, rank)
    flat_q = q_local.transpose(1, 2).reshape(b * t // cp, h, d)
    flat_k, flat_v = (
        x.transpose(1, 2).reshape(b * t, x.shape[1], d).index_select(0, seg.key_rows.to(x.device))
        for x in (k_all, v_all)
    )
    out = attend(flat_q, flat_k, flat_v, seg)
    return masked, out.view(b, t // cp, h, d), seg


@pytest.mark.parametrize("cp", [2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_segments_give_the_masked_attention(cp, seed):
    length = 12 * cp * 2
    pos = _positions(seed, batch=3, length=length)
    q, k, v = _inputs(seed + 10, 3, length)
    for rank in range(cp):
        masked, got, seg = _both(
            q,
            k,
            v,
            pos,
            cp,
            rank,
            lambda a, b, c, s: varlen_reference(a, b, c, s.cu_q, s.cu_k, None),
        )
        torch.testing.assert_close(got, masked, rtol=1e-12, atol=1e-12)
        # every query row is in exactly one segment, and no segment has more queries than keys
        q_len, k_len = seg.cu_q.diff(), seg.cu_k.diff()
        assert int(seg.cu_q[-1]) == 3 * length // cp and bool((q_len <= k_len).all())
        assert seg.max_q == int(q_len.max()) and seg.max_k == int(k_len.max())


def test_segments_skip_other_documents_keys():
    """Many short documents: the segments' scores are a small part of the mask's T/cp × T."""
    length, cp = 96, 2
    pos = torch.arange(8).repeat(length // 8).view(1, length)  # twelve documents of 8 tokens
    seg = cp_segments(pos, cp, 0)
    work = int((seg.cu_q.diff() * seg.cu_k.diff()).sum())
    assert work <= 8 * 8 * (length // cp // 8)
    assert work * 10 < (length // cp) * length


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cp", [2, 3])
def test_flash_kernel_runs_the_segments(cp):
    """The flash kernel with separate query and key lengths (bottom-right causal alignment)
    computes the segments' attention: bf16 forward and gradients against the float64 masked
    form."""
    from crossdistill.models.attention import flash_varlen

    length = 64 * cp * 2
    pos = _positions(7, batch=2, length=length)
    q, k, v = _inputs(8, 2, length, heads=(8, 2), dim=64)
    for rank in range(cp):
        leaves = [x.cuda().bfloat16().requires_grad_(True) for x in (q, k, v)]

        def flash(a, b, c, s):
            s = s.to(torch.device("cuda"))
            return flash_varlen(a, b, c, s.cu_q, s.cu_k, s.max_q, s.max_k, None)

        _, got, _ = _both(*leaves, pos.cuda(), cp, rank, flash)
        ref = [x.clone().requires_grad_(True) for x in (q, k, v)]
        masked, _, _ = _both(*ref, pos, cp, rank, lambda *a: a[0])  # the masked form only
        grad = torch.randn_like(masked)
        got.float().backward(grad.cuda().float())
        masked.backward(grad)
        scale = masked.abs().max()
        assert (got.double().cpu() - masked).abs().max() / scale < 2e-2
        for leaf, want in zip(leaves, ref):
            err = (leaf.grad.double().cpu() - want.grad).abs().max() / want.grad.abs().max()
            assert err < 3e-2, err

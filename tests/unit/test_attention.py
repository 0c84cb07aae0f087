"""Varlen attention over packed documents: the same hidden states as transformers' own SDPA
path, with segments from the collator or derived from positions; flash on CUDA (marked gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from crossdistill.data.batch import segments_from_docs
from crossdistill.models import attention, build_causal_lm
from crossdistill.models.attention import (
    VARLEN,
    block_causal_mask,
    compute_dtype,
    segments_from_positions,
    set_attention,
    varlen_attention,
)
from crossdistill.models.forward import final_hidden
from crossdistill.models.presets import TINY


def _packed(seed: int, b: int = 3, t: int = 24) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Random rows of several documents each, the last row ending in padding."""
    g = np.random.default_rng(seed)
    doc = np.full((b, t), -1, dtype=np.int64)
    pos = np.zeros((b, t), dtype=np.int64)
    for r in range(b):
        end = t - (5 if r == b - 1 else 0)
        cuts = np.sort(g.choice(np.arange(1, end), size=g.integers(0, 4), replace=False))
        bounds = [0, *cuts.tolist(), end]
        for d, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            doc[r, lo:hi], pos[r, lo:hi] = d, np.arange(hi - lo)
        pos[r, end:] = np.arange(t - end)  # padding: one run, counting on
    ids = torch.as_tensor(g.integers(0, 512, (b, t)))
    return ids, torch.as_tensor(pos), doc


def test_segments_from_docs_and_positions_agree():
    for seed in range(20):
        _, pos, doc = _packed(seed)
        cu, longest = segments_from_docs(doc)
        cu_p, longest_p = segments_from_positions(pos)
        assert cu.dtype == np.int32 and cu_p.dtype == torch.int32
        np.testing.assert_array_equal(cu, cu_p.numpy())
        assert longest == longest_p == int(np.diff(cu).max())
        assert cu[0] == 0 and cu[-1] == doc.size and (np.diff(cu) > 0).all()
    cu, longest = segments_from_docs(np.zeros((2, 5), dtype=np.int64))
    assert cu.tolist() == [0, 5, 10] and longest == 5  # a row is never joined to the next


@pytest.mark.parametrize("arch", sorted(TINY))
def test_varlen_model_equals_sdpa_with_packed_positions(arch):
    """Same weights, same packed batch: our attention (collator segments, or derived from the
    positions) gives transformers' block-diagonal SDPA result at every real token."""
    model = build_causal_lm(arch=arch, seed=0, attn_implementation="sdpa")
    ids, pos, doc = _packed(seed=7)
    real = torch.as_tensor(doc >= 0)
    want = final_hidden(model, ids, pos)
    set_attention(model, "varlen")
    assert model.config._attn_implementation == VARLEN
    cu, longest = segments_from_docs(doc)
    got = final_hidden(model, ids, pos, (torch.as_tensor(cu), longest))
    got_derived = final_hidden(model, ids, pos)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_derived[real], want[real], rtol=1e-5, atol=1e-5)
    # gradients flow through it as through SDPA
    got.float().pow(2).sum().backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


def test_default_attention_is_varlen():
    model = build_causal_lm(arch="tiny-llama", seed=0)
    assert model.config._attn_implementation == VARLEN


def test_attention_computes_in_the_autocast_dtype(monkeypatch):
    """A float32 model under bf16 autocast hands attention float32 queries (its rotary embedding
    multiplies the bf16 projections by float32 cos/sin); attention computes in bf16, as SDPA under
    autocast would, so that on CUDA the flash kernel takes them."""
    seen = []

    def spy(query):
        seen.append((query.dtype, compute_dtype(query)))
        return seen[-1][1]

    monkeypatch.setattr(attention, "compute_dtype", spy)
    model = build_causal_lm(arch="tiny-llama", seed=0)
    ids, pos, _ = _packed(seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        final_hidden(model, ids, pos)
    assert seen and set(seen) == {(torch.float32, torch.bfloat16)}
    seen.clear()
    final_hidden(model, ids, pos)
    assert set(seen) == {(torch.float32, torch.float32)}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(torch.zeros(1, dtype=torch.float64)) == torch.float64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_float32_model_under_autocast_runs_flash(monkeypatch):
    """The mixed-precision student (float32 weights, bf16 autocast) runs the flash varlen kernel,
    not the masked path, and agrees with transformers' SDPA under the same autocast."""
    calls = []
    apply = attention._FlashVarlen.apply

    def counted(*args):
        calls.append(args[0].dtype)
        return apply(*args)

    monkeypatch.setattr(attention._FlashVarlen, "apply", counted)
    model = build_causal_lm(arch="tiny-llama", seed=0, device=torch.device("cuda"))
    ids, pos, doc = _packed(seed=9, b=3, t=128)
    ids, pos = ids.cuda(), pos.cuda()
    cu, longest = segments_from_docs(doc)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = final_hidden(model, ids, pos, (torch.as_tensor(cu).cuda(), longest))
        set_attention(model, "sdpa")
        want = final_hidden(model, ids, pos)
    assert calls and set(calls) == {torch.bfloat16}
    real = torch.as_tensor(doc >= 0).cuda()
    err = (got[real].float() - want[real].float()).abs().max() / want[real].float().abs().max()
    assert err < 2e-2


def _reference(q, k, v, doc):
    """float64 attention written plainly: softmax over earlier keys of the same document."""
    b, h, t, d = q.shape
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) / d**0.5
    mask = block_causal_mask(torch.as_tensor(doc))
    scores = scores.masked_fill(~mask, float("-inf"))
    return (F.softmax(scores, -1) @ v).transpose(1, 2)


def test_fallback_matches_float64_reference():
    g = torch.Generator().manual_seed(3)
    _, pos, doc = _packed(seed=11, b=2, t=20)
    q = torch.randn(2, 4, 20, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 20, 16, generator=g, dtype=torch.float64) for _ in range(2))
    cu, longest = segments_from_docs(doc)
    out, _ = varlen_attention(
        None, q, k, v, None, cu_seq_lens_q=torch.as_tensor(cu), max_length_q=longest
    )
    want = _reference(q, k, v, doc)
    real = torch.as_tensor(doc >= 0)
    torch.testing.assert_close(out[real], want[real], rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads", [(8, 8), (8, 2)])
def test_flash_varlen_matches_float64_reference(heads):
    """On CUDA in bf16 the flash varlen kernel runs (no mask): forward and gradients against
    float64, and no host synchronisation when the segments come from the collator."""
    from crossdistill.models import attention

    flash_ok = attention.flash_ok

    h, h_kv = heads
    g = torch.Generator().manual_seed(5)
    _, _, doc = _packed(seed=13, b=3, t=256)
    q = torch.randn(3, h, 256, 64, generator=g)
    k, v = (torch.randn(3, h_kv, 256, 64, generator=g) for _ in range(2))
    cu, longest = segments_from_docs(doc)
    leaves = [x.cuda().bfloat16().requires_grad_(True) for x in (q, k, v)]
    assert flash_ok(leaves[0], None)
    cu_d = torch.as_tensor(cu).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, _ = varlen_attention(None, *leaves, None, cu_seq_lens_q=cu_d, max_length_q=longest)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref_leaves = [x.detach().double().cpu().requires_grad_(True) for x in leaves]
    want = _reference(*ref_leaves, doc)
    real = torch.as_tensor(doc >= 0)
    err = (out.double().cpu()[real] - want[real]).abs().max() / want[real].abs().max()
    assert err < 2e-2
    # gradients of a loss over real tokens only (padding attends only to padding)
    w = torch.randn(out.shape, generator=g) * real[:, :, None, None]
    (out.float() * w.cuda()).sum().backward()
    grads = torch.autograd.grad((want * w.double()).sum(), ref_leaves)
    for leaf, ref in zip(leaves, grads):
        e = (leaf.grad.double().cpu() - ref).abs().max() / ref.abs().max()
        assert e < 3e-2


def test_sliding_window_layers_keep_their_window():
    """A sliding-window model (Mistral-style, window 4 here) under varlen attention gives
    transformers' own sliding-window SDPA result on packed rows; without the window it would
    not."""
    model = build_causal_lm(
        arch="tiny-mistral", seed=0, attn_implementation="sdpa", overrides={"sliding_window": 4}
    )
    ids, pos, doc = _packed(seed=9)
    real = torch.as_tensor(doc >= 0)
    want = final_hidden(model, ids, pos)
    set_attention(model, "varlen")
    cu, longest = segments_from_docs(doc)
    got = final_hidden(model, ids, pos, (torch.as_tensor(cu), longest))
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    model.config.sliding_window = None
    full = final_hidden(model, ids, pos, (torch.as_tensor(cu), longest))
    assert not torch.allclose(full[real], want[real], atol=1e-3)


def test_soft_capped_models_get_eager_attention():
    """Gemma-2 caps attention logits, which only transformers' eager attention applies."""
    from types import SimpleNamespace

    from crossdistill.errors import UserError
    from crossdistill.models.attention import resolve_attention

    capped = SimpleNamespace(attn_logit_softcapping=50.0)
    assert resolve_attention("auto", capped) == "eager"
    assert resolve_attention("auto", SimpleNamespace()) == VARLEN
    with pytest.raises(UserError, match="soft-capping"):
        resolve_attention("varlen", capped)


def test_compiled_partial_rotary_hands_attention_token_major_queries(monkeypatch):
    """Phi-3's partial rotary embedding ends in a `cat`, so transformers hands attention
    head-major queries and keys (flash would then write its output head-major and the block
    copy it back). Compiled blocks hand them over token-major, bit for bit the same result as
    compiled blocks without the change; eager code is left as it was."""
    import transformers.models.phi3.modeling_phi3 as phi3

    from crossdistill.distributed.parallelize import apply_compile

    head_major = []
    masked = attention._masked_sdpa

    def spy(query, *args):
        head_major.append(query.stride(1) > query.stride(2))
        return masked(query, *args)

    def run(compiled: bool) -> torch.Tensor:
        head_major.clear()
        model = build_causal_lm(
            arch="tiny-phi3", seed=0, dtype=torch.float64, overrides={"partial_rotary_factor": 0.5}
        )
        if compiled:
            apply_compile(model)
        with torch.no_grad():
            return final_hidden(model, ids, pos)

    monkeypatch.setattr(attention, "_masked_sdpa", spy)
    ids, pos, _ = _packed(seed=4)
    eager = run(compiled=False)
    assert head_major and all(head_major)
    got = run(compiled=True)
    assert head_major and not any(head_major)
    assert phi3.apply_rotary_pos_emb.token_major
    plain = phi3.apply_rotary_pos_emb.__wrapped__
    monkeypatch.setattr(phi3, "apply_rotary_pos_emb", plain)
    monkeypatch.setattr(attention, "token_major_rotary", lambda module: None)
    want = run(compiled=True)
    assert head_major and all(head_major)
    assert torch.equal(got, want) and not got.isnan().any()
    # (transformers' RMSNorm computes in float32 even here: compiled and eager differ by that)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)

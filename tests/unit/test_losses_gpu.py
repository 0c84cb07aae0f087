"""The chunked pass on CUDA: bf16 matmuls with float32 logits, no host synchronisation."""

from __future__ import annotations

import pytest
import torch

from crossdistill.losses import LOSSES, ce_count, student_loss
from tests.unit.test_losses_student import plain_student_loss, rel, terms_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _on_cuda(terms):
    for t in terms:
        t.targets = t.targets.to("cuda")
        t.projection = t.projection.to("cuda")
        t.chunks, t.denominator = t.chunks.cuda(), t.denominator.cuda()
    return terms


def _bf16_cuda_against_float64(problem, fused: bool, reference=None) -> None:
    """The CUDA pass on bf16 inputs against a float64 loss of the same bf16-rounded inputs
    (`reference(h64, w64, labels, terms)`; default the plain loop reference)."""
    hidden, weight, labels, terms = problem
    h64 = hidden.bfloat16().double().requires_grad_(True)
    w64 = weight.bfloat16().double().requires_grad_(True)
    if reference is None:
        want = plain_student_loss(h64, w64, labels, terms, 0.6, int(ce_count(labels)))
    else:
        want = reference(h64, w64, labels, terms)
    gh, gw = torch.autograd.grad(want, (h64, w64))
    h = hidden.bfloat16().cuda().requires_grad_(True)
    w = weight.bfloat16().cuda().requires_grad_(True)
    labels = labels.cuda()
    loss_v, _ = student_loss(
        h, w, labels, _on_cuda(terms), 0.6, ce_count(labels), chunk_size=16, fused=fused
    )
    loss_v.backward()
    assert abs(loss_v.item() - want.item()) < 1e-3 * abs(want.item())
    # bf16 gradient matmuls and bf16 storage: ~2^-9 per element
    assert rel(h.grad.double().cpu(), gh) < 1e-2 and rel(w.grad.double().cpu(), gw) < 1e-2


def _reference_pass(h64, w64, labels, terms):
    """The full-logits reference backend in float64 on the CPU."""
    args = (h64, w64, labels, terms, 0.6, ce_count(labels))
    return student_loss(*args, chunk_size=16, backend="reference")[0]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("loss", ["forward_kl", "jsd", "uld", "gold", "hkl", "chunk_likelihood"])
def test_cuda_bf16_matches_float64(loss, fused):
    problem = terms_for(loss, seed=40, n=64, n_t=60, v_s=3000, v_t=2500, k=32)
    _bf16_cuda_against_float64(problem, fused)


@pytest.mark.parametrize("fused", [False, True])
def test_cuda_context_target_matches_float64(fused):
    """The context-aware target adds one bucket per row (B = K + 1): the CUDA pass, fused
    kernels included, against the float64 reference pass on the CPU."""
    from tests.unit.test_context_target import context_terms

    problem = context_terms(44, n=64, n_t=60, v_s=3000, v_t=2500, k=32)
    _bf16_cuda_against_float64(problem, fused, _reference_pass)


def test_float32_master_weight_under_autocast_matches_float64():
    """The training setup: a float32 lm_head under bf16 autocast. The weight gradient is a bf16
    matmul accumulated into float32 (`accumulate_mm`), never a float32 matmul."""
    hidden, weight, labels, terms = terms_for(
        "forward_kl", seed=43, n=96, n_t=90, v_s=3000, v_t=2500, k=32
    )
    h64 = hidden.bfloat16().double().requires_grad_(True)
    w64 = weight.bfloat16().double().requires_grad_(True)
    want = plain_student_loss(h64, w64, labels, terms, 0.6, int(ce_count(labels)))
    gh, gw = torch.autograd.grad(want, (h64, w64))
    h = hidden.bfloat16().cuda().requires_grad_(True)
    w = weight.float().cuda().requires_grad_(True)
    labels = labels.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_v, _ = student_loss(h, w, labels, _on_cuda(terms), 0.6, ce_count(labels), 32)
    loss_v.backward()
    assert w.grad.dtype == torch.float32
    assert abs(loss_v.item() - want.item()) < 1e-3 * abs(want.item())
    assert rel(h.grad.double().cpu(), gh) < 1e-2 and rel(w.grad.double().cpu(), gw) < 1e-2


def test_accumulate_mm_adds_bf16_products_into_float32():
    from crossdistill.losses.chunked import accumulate_mm

    g = torch.Generator().manual_seed(0)
    parts = [
        (torch.randn(256, 96, generator=g), torch.randn(96, 200, generator=g)) for _ in range(3)
    ]
    acc = None
    for a, b in parts:
        acc = accumulate_mm(acc, a.cuda().bfloat16(), b.cuda().bfloat16(), torch.float32)
    assert acc.dtype == torch.float32
    want = sum(a.bfloat16().double() @ b.bfloat16().double() for a, b in parts)
    assert rel(acc.double().cpu(), want) < 1e-5  # float32 accumulation of exact bf16 products


def test_cuda_pass_does_not_synchronize():
    hidden, weight, labels, terms = terms_for("forward_kl", seed=41, n=64, v_s=3000, v_t=2500, k=32)
    h = hidden.float().cuda().requires_grad_(True)
    w = weight.float().cuda().requires_grad_(True)
    labels, terms = labels.cuda(), _on_cuda(terms)
    den = ce_count(labels)
    student_loss(h, w, labels, terms, 0.5, den, chunk_size=16)[0].backward()  # warm up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, metrics = student_loss(h, w, labels, terms, 0.5, den, chunk_size=16)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()


@pytest.mark.parametrize("loss", LOSSES)
def test_triton_kernels_match_their_pytorch_reference(loss):
    """float32 on CUDA: the Triton flow against the plain PyTorch pass, several temperatures."""
    from crossdistill.losses import kernels as fz

    assert fz.available()
    terms = []
    for i, (name, tau) in enumerate([(loss, 2.0), ("forward_kl", 1.0), ("jsd", 0.7)]):
        hidden, weight, labels, (term,) = terms_for(
            name, seed=42 + i, n=80, n_t=70, v_s=5000, v_t=4000, k=24, tau=tau
        )
        terms.append(term)
    hidden, weight, labels, _ = terms_for("tvd", seed=42, n=80, n_t=70, v_s=5000, v_t=4000, k=24)
    terms, labels = _on_cuda(terms), labels.cuda()
    out = []
    for fused in (False, True):
        h = hidden.float().cuda().requires_grad_(True)
        w = weight.float().cuda().requires_grad_(True)
        value, _ = student_loss(h, w, labels, terms, 0.6, ce_count(labels), 32, fused=fused)
        value.backward()
        out.append((value.item(), h.grad.double().cpu(), w.grad.double().cpu()))
    (a, ah, aw), (b, bh, bw) = out
    assert abs(a - b) < 1e-5 * abs(a)
    assert rel(bh, ah) < 1e-5 and rel(bw, aw) < 1e-5


@pytest.mark.parametrize("fused", [False, True])
def test_cuda_lookahead_prefix_target_matches_float64(fused):
    """Token-group buckets next to single ones (`lookahead_prefix`): the CUDA pass, the group
    kernels included, against the float64 reference pass on the CPU."""
    from tests.unit.test_lookahead_prefix import plan_problem

    hidden, weight, labels, term = plan_problem(3, "forward_kl", tau=1.5)
    _bf16_cuda_against_float64((hidden, weight, labels, [term]), fused, _reference_pass)


def test_triton_group_kernels_match_the_plain_pass_without_synchronizing():
    """The prefix target on a 5000-token vocabulary, float32: the fused flow with the group
    kernels against the plain PyTorch pass, and no host synchronisation in it."""
    from tests.unit.test_prefix_target import grouped, make_term

    hidden, weight, labels, chunks, targets, proj = grouped(7, tau=1.5, v_s=5000, v_t=4000)
    (term,) = _on_cuda([make_term("forward_kl", targets, proj, chunks, labels)])
    labels = labels.cuda()
    den = ce_count(labels)
    out = []
    for fused in (False, True, True):
        h = hidden.float().cuda().requires_grad_(True)
        w = weight.float().cuda().requires_grad_(True)
        if len(out) == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            value, _ = student_loss(h, w, labels, [term], 0.6, den, 32, fused=fused)
            value.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out.append((value.item(), h.grad.double().cpu(), w.grad.double().cpu()))
    (a, ah, aw), (b, bh, bw), _ = out
    assert abs(a - b) < 1e-5 * abs(a)
    assert rel(bh, ah) < 1e-5 and rel(bw, aw) < 1e-5

"""What must not change the student loss: chunk size, micro-batch split, padding; what must
contribute exactly nothing: masked positions, empty chunks, an all-masked batch. Plus bf16
accuracy, and the chunked pass's promises (no [N, V] tensor, no per-token Python work)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from crossdistill.losses import (
    LOSSES,
    KDTerm,
    TeacherTargets,
    ce_count,
    flatten_chunks,
    kd_count,
    student_loss,
)
from tests.unit.test_losses_student import make_problem, plain_student_loss, rel, run, terms_for

F64 = torch.float64


@pytest.mark.parametrize("loss", ["forward_kl", "gold", "hkl", "uld", "chunk_likelihood"])
def test_chunk_size_does_not_change_loss_or_gradient(loss):
    hidden, weight, labels, terms = terms_for(loss, seed=20, tau=1.5)
    base = run("chunked", hidden, weight, labels, terms, chunk_size=hidden.shape[0])
    for chunk in (1, 3, 5):
        got = run("chunked", hidden, weight, labels, terms, chunk_size=chunk)
        assert abs(got[0].item() - base[0].item()) <= 1e-13 * abs(base[0].item())
        assert rel(got[1], base[1]) < 1e-13 and rel(got[2], base[2]) < 1e-13


def _cat_targets(a: TeacherTargets, b: TeacherTargets) -> TeacherTargets:
    return TeacherTargets(
        **{k: torch.cat([a.tensors()[k], b.tensors()[k]]) for k in a.tensors()},
        temperature=a.temperature,
    )


@pytest.mark.parametrize("loss", ["forward_kl", "jsd", "gold", "chunk_likelihood"])
def test_micro_batch_split_sums_to_the_whole_batch(loss):
    """Two sequences as one batch, or as two micro-batches with the global counts: the same
    loss and gradient."""
    h1, w, l1, c1, t1, proj = make_problem(21, tau=2.0)
    h2, _, l2, c2, t2, _ = make_problem(22, tau=2.0)
    n1, nt1 = h1.shape[0], t1.next_logprobs.shape[0]
    chunks, mask = flatten_chunks([c1, c2], [n1, h2.shape[0]], [nt1, t2.next_logprobs.shape[0]])
    assert mask.sum() == len(chunks) - 2  # each sequence's first chunk has no KD position
    whole = (torch.cat([h1, h2]), torch.cat([l1, l2]), chunks, _cat_targets(t1, t2))

    def term(chunks, targets, mask=None):
        return KDTerm(targets, proj, chunks, torch.tensor(0.0), loss, weight=0.9, chunk_mask=mask)

    parts = [term(c1, t1), term(c2, t2)]
    kd_den = sum(kd_count(t, lab) for t, lab in zip(parts, (l1, l2))).double()
    ce_den = ce_count(l1) + ce_count(l2)
    for t in parts:
        t.denominator = kd_den
    big = term(whole[2], whole[3], mask)
    big.denominator = kd_den
    assert kd_count(big, whole[1]) == kd_den
    full = run("chunked", whole[0], w, whole[1], [big], chunk_size=5, ce_den=ce_den)
    first = run("chunked", h1, w, l1, [parts[0]], chunk_size=5, ce_den=ce_den)
    second = run("chunked", h2, w, l2, [parts[1]], chunk_size=5, ce_den=ce_den)
    assert abs((first[0] + second[0]).item() - full[0].item()) <= 1e-13 * full[0].item()
    assert rel(torch.cat([first[1], second[1]]), full[1]) < 1e-13
    assert rel(first[2] + second[2], full[2]) < 1e-13
    for key in ("ce", "kd/teacher", "top1/teacher"):
        assert abs(first[3][key] + second[3][key] - full[3][key]) < 1e-12


def test_padding_rows_change_nothing_and_get_zero_gradient():
    hidden, weight, labels, terms = terms_for("skew_kl", seed=23)
    pad = torch.randn(5, hidden.shape[1], dtype=F64) * 100
    padded_h = torch.cat([hidden, pad])
    padded_l = torch.cat([labels, torch.full((5,), -100)])
    base = run("chunked", hidden, weight, labels, terms)
    got = run("chunked", padded_h, weight, padded_l, terms)
    assert abs(got[0].item() - base[0].item()) <= 1e-13 * base[0].item()
    assert rel(got[1][: hidden.shape[0]], base[1]) < 1e-13 and rel(got[2], base[2]) < 1e-13
    assert (got[1][hidden.shape[0] :] == 0).all()


@pytest.mark.parametrize("loss", LOSSES)
def test_masked_and_empty_chunks_contribute_exactly_zero(loss):
    hidden, weight, labels, (term,) = terms_for(loss, seed=24, tau=1.5)
    chunks = term.chunks.clone()
    mask = torch.ones(len(chunks), dtype=torch.bool)
    mask[[2, 5]] = False
    # poison the masked chunks' teacher rows: whatever they hold must not reach the loss
    targets = TeacherTargets(
        **{k: v.clone() for k, v in term.targets.tensors().items()}, temperature=term.temperature
    )
    targets.topk_logprobs[[2, 5]] = float("nan")
    targets.tail_logprob[[2, 5]] = float("nan")
    masked = KDTerm(
        targets,
        term.projection,
        chunks,
        term.denominator,
        loss,
        params=term.params,
        chunk_mask=mask,
    )
    want = plain_student_loss(hidden, weight, labels, [masked], 0.6, int(ce_count(labels)))
    got = run("chunked", hidden, weight, labels, [masked])
    assert torch.isfinite(got[0]) and torch.isfinite(got[1]).all() and torch.isfinite(got[2]).all()
    assert abs(got[0].item() - want.item()) <= 1e-10 * want.item()
    # an empty chunk (one side covers no token) inserted anywhere changes nothing
    s0, s1, t0, t1 = chunks[4].tolist()
    empty = torch.tensor([[s0, s0, t0, t1], [s0, s1, t0, t0]])
    with_empty = torch.cat([chunks[:4], empty[:1], chunks[4:5], empty[1:], chunks[5:]])
    rows = [0, 1, 2, 3, 2, 4, 2, 5] + list(range(6, len(chunks)))  # any teacher rows: masked out
    poisoned = TeacherTargets(
        **{k: (v[rows] if v.shape[0] == len(chunks) else v) for k, v in targets.tensors().items()},
        temperature=term.temperature,
    )
    poisoned.topk_logprobs[[4, 6]] = float("nan")
    mask_e = torch.cat([mask[:4], torch.tensor([True]), mask[4:5], torch.tensor([True]), mask[5:]])
    term_e = KDTerm(
        poisoned,
        term.projection,
        with_empty,
        term.denominator,
        loss,
        params=term.params,
        chunk_mask=mask_e,
    )
    got_e = run("chunked", hidden, weight, labels, [term_e])
    assert kd_count(term_e, labels) == kd_count(masked, labels)
    assert got_e[0].item() == got[0].item()
    assert torch.equal(got_e[1], got[1]) and torch.equal(got_e[2], got[2])


@pytest.mark.parametrize("backend", ["chunked", "reference"])
@pytest.mark.parametrize("loss", LOSSES)
def test_all_masked_batch_gives_zero_loss_and_zero_gradient(loss, backend):
    hidden, weight, labels, (term,) = terms_for(loss, seed=25)
    labels = torch.full_like(labels, -100)
    term.chunk_mask = torch.zeros(len(term.chunks), dtype=torch.bool)
    term.denominator = kd_count(term, labels)
    assert term.denominator.item() == 0
    loss_v, g_h, g_w, metrics = run(
        backend, hidden, weight, labels, [term], ce_den=ce_count(labels)
    )
    assert loss_v.item() == 0.0
    assert (g_h == 0).all() and (g_w == 0).all()
    assert all(torch.isfinite(v).all() for v in metrics.values())


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "uld", "chunk_likelihood"])
def test_bf16_inputs_stay_within_1e3_of_float64(loss):
    hidden, weight, labels, terms = terms_for(loss, seed=26, n=40, n_t=36, v_s=300, v_t=250, k=16)
    hidden, weight = hidden.bfloat16(), weight.bfloat16()
    # the float64 reference sees exactly the bf16 values
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    want = plain_student_loss(h64, w64, labels, terms, 0.6, int(ce_count(labels)))
    gh, gw = torch.autograd.grad(want, (h64, w64))
    got, got_h, got_w, _ = run("chunked", hidden, weight, labels, terms, chunk_size=16)
    assert got_h.dtype == torch.bfloat16 and got_w.dtype == torch.bfloat16
    assert abs(got.item() - want.item()) < 1e-3 * abs(want.item())
    # the gradients are stored in bf16 themselves (2^-9 relative rounding per element)
    assert rel(got_h.double(), gh) < 5e-3 and rel(got_w.double(), gw) < 5e-3


def test_autocast_on_cpu_matches_reference():
    hidden, weight, labels, terms = terms_for("jsd", seed=27, n=30, v_s=200, k=8)
    results = []
    for backend in ("chunked", "reference"):
        h = hidden.float().requires_grad_(True)
        w = weight.float().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = student_loss(h, w, labels, terms, 0.6, ce_count(labels), 7, backend)
        loss.backward()  # outside autocast, as recommended
        results.append((loss.detach(), h.grad, w.grad))
    (got, got_h, got_w), (ref, ref_h, ref_w) = results
    assert got_h.dtype == torch.float32 and got_w.dtype == torch.float32
    assert abs(got.item() - ref.item()) < 1e-5 * ref.item()
    assert rel(got_h, ref_h) < 1e-5 and rel(got_w, ref_w) < 1e-5


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.largest = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _record(n, chunk):
    hidden, weight, labels, terms = terms_for("gold", seed=28, n=n, n_t=n, v_s=64, v_t=50, k=4)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with _Recorder() as rec:
        loss, _ = student_loss(h, w, labels, terms, 0.5, ce_count(labels), chunk_size=chunk)
        loss.backward()
    return rec


def test_chunked_pass_never_holds_full_logits_and_does_no_per_token_python_work():
    rec = _record(n=64, chunk=16)
    assert rec.largest < 64 * 64  # N·V_s = 4096 never exists; a chunk's 16·64 does
    assert rec.largest >= 16 * 64
    # the same number of chunks over twice the tokens issues the same number of ops
    assert _record(n=32, chunk=8).ops == _record(n=64, chunk=16).ops


HOT_PATH = ["chunked.py", "plan.py", "objective.py", "divergences.py", "targets.py"]


@pytest.mark.parametrize("name", HOT_PATH)
def test_no_host_sync_in_the_hot_path(name):
    source = (Path(__file__).parents[2] / "crossdistill" / "losses" / name).read_text()
    found = re.findall(
        r"\.item\(\)|\.tolist\(\)|\.cpu\(\)|\.numpy\(\)|torch\.equal|nonzero\(", source
    )
    assert found == []


def test_chunk_slices_are_balanced_and_cover_every_row():
    from crossdistill.losses.chunked import chunk_slices

    assert [(s.start, s.stop) for s in chunk_slices(8192, 3072)] == [
        (0, 2816), (2816, 5632), (5632, 8192)
    ]  # fmt: skip
    assert [(s.start, s.stop) for s in chunk_slices(8192, 4096)] == [(0, 4096), (4096, 8192)]
    assert chunk_slices(0, 16) == []
    for n in range(1, 300, 7):
        for c in (1, 5, 16, 100, 128, 1000):
            sl = chunk_slices(n, c)
            assert sl[0].start == 0 and sl[-1].stop == n
            assert all(a.stop == b.start for a, b in zip(sl, sl[1:]))
            assert all(0 < s.stop - s.start <= c for s in sl)
            assert len(sl) == -(-n // c)


def test_accumulate_mm_on_the_cpu_matches_float64():
    from crossdistill.losses.chunked import accumulate_mm

    g = torch.Generator().manual_seed(1)
    parts = [(torch.randn(40, 12, generator=g), torch.randn(12, 30, generator=g)) for _ in range(3)]
    acc = None
    for a, b in parts:
        acc = accumulate_mm(acc, a, b, torch.float32)
    want = sum(a.double() @ b.double() for a, b in parts)
    assert (acc.double() - want).abs().max() < 1e-5
    acc16 = None
    for a, b in parts:  # bf16 operands, float32 accumulator: the products are exact in float32
        acc16 = accumulate_mm(acc16, a.bfloat16(), b.bfloat16(), torch.float32)
    want16 = sum(a.bfloat16().double() @ b.bfloat16().double() for a, b in parts)
    assert acc16.dtype == torch.float32 and (acc16.double() - want16).abs().max() < 1e-5

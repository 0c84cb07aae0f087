"""Teacher targets and vocabulary projection against plain float64 computations."""

from __future__ import annotations

import math

import pytest
import torch

from crossdistill.errors import UserError
from crossdistill.losses import (
    TeacherTargets,
    VocabProjection,
    kd_positions,
    next_token_nll,
    project_topk,
    teacher_targets,
)

NEG_INF = float("-inf")


def _teacher(seed, rows=9, hidden=5, vocab=23, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen, dtype=dtype)
    w = torch.randn(vocab, hidden, generator=gen, dtype=dtype)
    nxt = torch.randint(0, vocab, (rows,), generator=gen)
    nxt[-1] = -100
    return h, w, nxt


@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_teacher_targets_match_plain_float64(tau):
    h, w, nxt = _teacher(0)
    kd = torch.tensor([0, 3, -1, 8, 4])
    got = teacher_targets(h, w, kd, nxt, top_k=4, temperature=tau, chunk_size=2)
    z = h @ w.t()
    for m, row in enumerate(kd.tolist()):
        row = max(row, 0)
        probs = [math.exp(v / tau) for v in z[row].tolist()]
        total = sum(probs)
        probs = [p / total for p in probs]
        order = sorted(range(len(probs)), key=lambda i: -probs[i])[:4]
        assert got.topk_ids[m].tolist() == order
        for k, i in enumerate(order):
            assert abs(got.topk_logprobs[m, k].item() - math.log(probs[i])) < 1e-12
        tail = sum(p for i, p in enumerate(probs) if i not in order)
        assert abs(got.tail_logprob[m].item() - math.log(tail)) < 1e-12
    for r in range(9):
        if nxt[r] < 0:
            assert not got.next_valid[r] and got.next_logprobs[r] == 0
            continue
        lse = math.log(sum(math.exp(v) for v in z[r].tolist()))
        assert abs(got.next_logprobs[r].item() - (z[r, nxt[r]].item() - lse)) < 1e-12


def test_teacher_targets_chunk_size_invariant_and_full_topk_has_empty_tail():
    h, w, nxt = _teacher(1)
    kd = torch.arange(9)
    ref = teacher_targets(h, w, kd, nxt, top_k=23, chunk_size=100)
    assert (ref.tail_logprob == NEG_INF).all()
    torch.testing.assert_close(ref.topk_logprobs.exp().sum(-1), torch.ones(9, dtype=torch.float64))
    for chunk in (1, 4):
        other = teacher_targets(h, w, kd, nxt, top_k=23, chunk_size=chunk)
        assert torch.equal(other.topk_ids, ref.topk_ids)
        torch.testing.assert_close(other.topk_logprobs, ref.topk_logprobs, rtol=0, atol=1e-14)


def test_teacher_targets_bf16_is_close_to_float64():
    h, w, nxt = _teacher(2, vocab=200)
    kd = torch.arange(9)
    ref = teacher_targets(h.bfloat16().double(), w.bfloat16().double(), kd, nxt, 8)
    got = teacher_targets(h.bfloat16(), w.bfloat16(), kd, nxt, 8)
    assert got.topk_logprobs.dtype == torch.float32
    # bf16 logits carry ~3 significant digits; compare probabilities where the order agrees
    same = (got.topk_ids == ref.topk_ids).all(-1)
    assert same.sum() >= 5
    err = (got.topk_logprobs[same].double().exp() - ref.topk_logprobs[same].exp()).abs().max()
    assert err < 5e-3


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [5, 23])
def test_fused_chunk_flow_matches_the_plain_path(tau, top_k):
    """The CUDA bitmask flow (top-k, one stats pass with a top-k bitmask, gather), here on its
    PyTorch stand-ins, gives the plain path's targets."""
    from crossdistill.losses.targets import fused_chunk

    h, w, nxt = _teacher(3)
    kd = torch.arange(9)
    want = teacher_targets(h, w, kd, nxt, top_k=top_k, temperature=tau, chunk_size=4)
    floor = torch.finfo(torch.float32).tiny if top_k < 23 else 0.0
    next_lp, top_lp, ids, tail = fused_chunk(h @ w.t(), nxt, top_k, tau, floor, flow="bitmask")
    assert torch.equal(ids.to(torch.int32), want.topk_ids)
    torch.testing.assert_close(top_lp.double(), want.topk_logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(tail.double(), want.tail_logprob, rtol=0, atol=1e-12)
    valid = nxt >= 0
    torch.testing.assert_close(
        next_lp.double()[valid], want.next_logprobs[valid], rtol=0, atol=1e-12
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_cuda_bf16_teacher_targets_match_float64(tau):
    """On CUDA, bf16 hidden states take the fused flow: against float64 on the same bf16
    logits."""
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(300, 64, generator=gen).bfloat16()
    w = (torch.randn(5000, 64, generator=gen) * 0.3).bfloat16()
    nxt = torch.randint(0, 5000, (300,), generator=gen)
    kd = torch.arange(300)
    got = teacher_targets(h.cuda(), w.cuda(), kd.cuda(), nxt.cuda(), 32, tau, chunk_size=128)
    z = (h.cuda() @ w.cuda().t()).double().cpu()  # the bf16 logits both paths see
    want = teacher_targets(z, torch.eye(5000, dtype=torch.float64), kd, nxt, 32, tau, 128)
    # bf16 logits tie often, and tied ids may come in any order: compare values, and check
    # that each id's own logit gives its log-prob
    torch.testing.assert_close(
        got.topk_logprobs.cpu().double(), want.topk_logprobs, rtol=0, atol=1e-4
    )
    at_ids = z.gather(1, got.topk_ids.cpu().long())
    lse_tau = torch.logsumexp(z / tau, 1, keepdim=True)
    torch.testing.assert_close(
        got.topk_logprobs.cpu().double(), at_ids / tau - lse_tau, rtol=0, atol=1e-4
    )
    torch.testing.assert_close(
        got.tail_logprob.cpu().double(), want.tail_logprob, rtol=0, atol=1e-4
    )
    torch.testing.assert_close(
        got.next_logprobs.cpu().double(), want.next_logprobs, rtol=0, atol=1e-4
    )


def test_size_per_token_is_as_documented():
    h, w, nxt = _teacher(3)
    h, w = h.float(), w.float()
    got = teacher_targets(h, w, torch.arange(6), nxt, top_k=4)
    assert got.topk_ids.dtype == torch.int32 and got.topk_logprobs.dtype == torch.float32
    expected = 6 * TeacherTargets.bytes_per_kd_position(4) + 9 * TeacherTargets.BYTES_PER_TOKEN
    assert got.nbytes() == expected
    assert TeacherTargets.bytes_per_kd_position(64) == 516
    moved = got.to("cpu")
    assert moved.temperature == got.temperature and torch.equal(moved.topk_ids, got.topk_ids)


def test_bad_top_k_and_temperature_are_user_errors():
    h, w, nxt = _teacher(4)
    with pytest.raises(UserError, match="top_k"):
        teacher_targets(h, w, torch.arange(3), nxt, top_k=0)
    with pytest.raises(UserError, match="temperature"):
        teacher_targets(h, w, torch.arange(3), nxt, top_k=2, temperature=0.0)


def test_kd_positions_and_next_token_nll():
    chunks = torch.tensor([[0, 1, 0, 2], [1, 3, 2, 3], [3, 3, 3, 4], [3, 4, 4, 4], [4, 5, 4, 6]])
    s, t = kd_positions(chunks)
    assert s.tolist() == [-1, 0, -1, -1, 3]  # first chunk, empty student side, empty teacher side
    assert t.tolist() == [-1, 1, -1, -1, 3]
    h, w, nxt = _teacher(5)
    got = teacher_targets(h, w, torch.arange(2), nxt, 3)
    nll, count = next_token_nll(got)
    want = sum(-got.next_logprobs[r].item() for r in range(9) if nxt[r] >= 0)
    assert count.item() == 8 and abs(nll.item() - want) < 1e-12


def _dense_target(ids, logq, tail, projection, num_student):
    """Plain projection through a dense [V_t, V_s + 1] matrix; the last column is the tail."""
    v_t = projection.pieces.shape[0]
    dense = torch.zeros(v_t, num_student + 1, dtype=torch.float64)
    for t in range(v_t):
        pieces = [
            (s, wt)
            for s, wt in zip(projection.pieces[t].tolist(), projection.weights[t].tolist())
            if s >= 0
        ]
        if not pieces:
            dense[t, num_student] = 1.0
        for s, wt in pieces:
            dense[t, s] += wt
    out = torch.zeros(ids.shape[0], num_student + 1, dtype=torch.float64)
    for m in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            out[m] += math.exp(logq[m, k].item()) * dense[ids[m, k]]
        out[m, num_student] += math.exp(tail[m].item())
    return out


def _from_buckets(b, num_student):
    out = torch.zeros(b.ids.shape[0], num_student + 1, dtype=torch.float64)
    for m in range(b.ids.shape[0]):
        seen = set()
        for j in range(b.ids.shape[1]):
            if b.valid[m, j]:
                sid = b.ids[m, j].item()
                assert sid not in seen  # valid slots are distinct tokens
                seen.add(sid)
                out[m, sid] = math.exp(b.logq[m, j].item())
            else:
                assert b.logq[m, j] == NEG_INF
                assert b.ids[m, j].item() in seen or not b.valid[m].any()
        out[m, num_student] = math.exp(b.logq_tail[m].item())
    return out


def _random_targets(seed, rows=5, k=6, v_t=15):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, v_t, generator=gen, dtype=torch.float64)
    logp = logits.log_softmax(-1)
    top, ids = logp.topk(k, -1)
    rest = logp.scatter(1, ids, NEG_INF).logsumexp(-1)
    return ids.to(torch.int32), top, rest


def test_first_piece_projection_matches_dense_matrix():
    ids, logq, tail = _random_targets(6)
    # collisions (several teacher ids -> one student id) and unmapped ids (-1 -> tail)
    first = torch.tensor([0, 0, 1, -1, 2, 2, 2, 3, -1, 4, 5, 6, 0, 7, -1])
    proj = VocabProjection.from_first_piece(first, num_student=9)
    got = _from_buckets(project_topk(ids, logq, tail, proj), 9)
    want = _dense_target(ids, logq, tail, proj, 9)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got.sum(-1), torch.ones(5, dtype=torch.float64))


def test_multi_piece_projection_matches_dense_matrix():
    ids, logq, tail = _random_targets(7)
    rows = torch.tensor([0, 0, 1, 2, 2, 2, 4, 5, 6, 7, 8, 9, 10, 11, 11, 12, 13, 14])
    cols = torch.tensor([1, 2, 2, 0, 3, 4, 4, 5, 6, 7, 8, 1, 0, 2, 6, 3, 4, 5])
    wts = torch.tensor(
        [0.5, 0.5, 1.0, 0.2, 0.3, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.9, 0.1, 1.0, 1.0, 1.0]
    )
    proj = VocabProjection.from_sparse(rows, cols, wts, num_teacher=15, num_student=9)
    assert proj.pieces.shape == (15, 3) and proj.pieces[3].tolist() == [-1, -1, -1]
    got = _from_buckets(project_topk(ids, logq, tail, proj), 9)
    torch.testing.assert_close(got, _dense_target(ids, logq, tail, proj, 9), rtol=1e-12, atol=1e-15)


def test_row_with_no_mapped_token_puts_everything_in_tail():
    ids, logq, tail = _random_targets(8, rows=2)
    proj = VocabProjection.from_first_piece(torch.full((15,), -1), num_student=4)
    b = project_topk(ids, logq, tail, proj)
    assert not b.valid.any() and (b.ids == 0).all()
    torch.testing.assert_close(b.logq_tail, torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-14)


def test_identity_projection_is_exact():
    ids, logq, tail = _random_targets(9)
    b = project_topk(ids, logq, tail, VocabProjection.identity(15))
    assert b.valid.all() and torch.equal(b.logq_tail, tail)
    for m in range(ids.shape[0]):
        want = dict(zip(ids[m].tolist(), logq[m].tolist()))
        got = dict(zip(b.ids[m].tolist(), b.logq[m].tolist()))
        assert got == want  # bit-exact: merging a single entry must not round


def test_common_vocabulary_and_exact_only():
    first = torch.tensor([2, 0, -1, 2, 3])
    exact = torch.tensor([True, False, False, False, True])
    proj = VocabProjection.from_first_piece(first, num_student=5, exact=exact)
    assert proj.exact_only().first_piece.tolist() == [2, -1, -1, -1, 3]
    assert proj.common_student().tolist() == [False, False, True, True, False]
    with pytest.raises(UserError, match="exact"):
        VocabProjection.from_first_piece(first, 5).exact_only()


@pytest.mark.parametrize("seed", range(4))
def test_topk_by_blocks_gives_topk_values_exactly(seed):
    """Top-k from the blocks with the largest maxima: the same values as `torch.topk` (ties,
    clusters of the top-k in one block, constant rows), each id holding its value, k distinct
    ids; falls back where the blocks would not help."""
    from crossdistill.losses.targets import topk_by_blocks

    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, 128 * 96, generator=g) * 3
    z[1] = z[1].round()  # thousands of ties at the k-th value
    z[2, 640:700] += 40  # the whole top-k inside one block
    z[3] = 0.0  # every value tied
    z[4, torch.randperm(z.shape[1], generator=g)[:20]] = float("inf")
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = z.to(dtype)
        for k in (1, 8, 23):
            vals, ids = topk_by_blocks(x, k)
            assert torch.equal(vals, x.topk(k, dim=1).values)
            assert torch.equal(x.gather(1, ids), vals)
            assert all(len(set(r.tolist())) == k for r in ids)
    vals, ids = topk_by_blocks(z[:, :1000], 8)  # 1000 columns: no whole blocks, torch.topk
    assert torch.equal(vals, z[:, :1000].topk(8, dim=1).values)


@pytest.mark.parametrize("tau", [1.0, 0.7, 2.0])
def test_block_flow_matches_the_plain_path(tau):
    """The targets from per-block maxima and sums (`_blocks_chunk`: row max, S_τ, top-k from the
    top blocks, tail from the other blocks and the left-over candidates) equal the plain path's
    in float64, including a row whose top-k sits in one block."""
    from crossdistill.losses.targets import _blocks_chunk

    gen = torch.Generator().manual_seed(6)
    h = torch.randn(12, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(128 * 150, 16, generator=gen, dtype=torch.float64)
    w[300:330] += 3 * h[2] / h[2].norm()  # row 2: its top-k clustered in blocks 2 and 3
    nxt = torch.randint(0, w.shape[0], (12,), generator=gen)
    nxt[5] = -1
    want = teacher_targets(h, w, torch.arange(12), nxt, top_k=20, temperature=tau, chunk_size=5)
    floor = torch.finfo(torch.float32).tiny
    next_lp, top_lp, ids, tail = _blocks_chunk(h @ w.t(), nxt, 20, tau, floor)
    assert torch.equal(ids.to(torch.int32), want.topk_ids)
    torch.testing.assert_close(top_lp, want.topk_logprobs, rtol=0, atol=1e-12)
    torch.testing.assert_close(tail, want.tail_logprob, rtol=0, atol=1e-12)
    valid = nxt >= 0
    torch.testing.assert_close(next_lp[valid], want.next_logprobs[valid], rtol=0, atol=1e-12)
    assert _blocks_chunk(h @ w[:1000].t(), nxt.clamp(max=999), 20, tau, floor) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("flow", ["bitmask", "blocks"])
def test_cuda_bf16_targets_at_a_real_vocabulary(flow):
    """Qwen3's vocabulary (151,936 = 1,187 blocks of 128), bf16 logits: both CUDA flows against
    float64 on the same logits (`teacher_targets` runs the default one, "blocks")."""
    from crossdistill.losses.targets import fused_chunk

    gen = torch.Generator().manual_seed(8)
    h = torch.randn(256, 64, generator=gen).bfloat16()
    w = (torch.randn(151936, 64, generator=gen) * 0.3).bfloat16()
    nxt = torch.randint(0, 151936, (256,), generator=gen)
    kd = torch.arange(256)
    got = teacher_targets(h.cuda(), w.cuda(), kd.cuda(), nxt.cuda(), 64, 2.0, chunk_size=128)
    if flow == "bitmask":
        tiny = torch.finfo(torch.float32).tiny
        next_lp, top_lp, ids, tail = fused_chunk(
            h.cuda() @ w.cuda().t(), nxt.cuda(), 64, 2.0, tiny, flow
        )
        got.topk_logprobs, got.tail_logprob, got.next_logprobs = top_lp, tail, next_lp
        got.topk_ids = ids
    z = (h.cuda() @ w.cuda().t()).double().cpu()  # the bf16 logits, in float64
    vals, ids = z.topk(64, dim=1)
    lse_tau = torch.logsumexp(z / 2.0, 1)
    rest = (z / 2.0 - lse_tau[:, None]).exp().scatter(1, ids, 0.0).sum(1).log()
    want = {
        "topk_logprobs": vals / 2.0 - lse_tau[:, None],
        "tail_logprob": rest,
        "next_logprobs": z.gather(1, nxt[:, None]).squeeze(1) - torch.logsumexp(z, 1),
    }
    for name, b in want.items():
        torch.testing.assert_close(getattr(got, name).cpu().double(), b, rtol=0, atol=1e-4)
    assert torch.equal(z.gather(1, got.topk_ids.cpu().long()), vals)

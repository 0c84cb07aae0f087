"""The fused pass with token-group buckets (`losses.group_kernels`, the `prefix` and
`lookahead_prefix` targets): on CPU its kernels run as their PyTorch references, checked here
against sums written out by hand and the whole flow against the plain PyTorch pass, in float64;
the Triton kernels themselves run in Triton's CPU interpreter (compiled: `test_losses_gpu`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from crossdistill.config import DISTRIBUTION_LOSSES
from crossdistill.losses import kd_count
from crossdistill.losses.group_kernels import (
    GroupRows,
    group_coef_at,
    group_grad_torch,
    group_stats_torch,
)
from crossdistill.losses.kernels import bucket_bits
from tests.unit.test_lookahead_prefix import plan_problem
from tests.unit.test_losses_fused import _both
from tests.unit.test_losses_student import rel
from tests.unit.test_prefix_target import grouped, make_term


def random_rows(gen: torch.Generator, c: int, vocab: int, num_events: int, g: int):
    """Events of a vocabulary (a fifth of the tokens in none: `num_events`), each row's g
    distinct group events (some slots empty) and a few single tokens outside its groups."""
    events = torch.randint(0, num_events, (vocab,), generator=gen)
    events[torch.rand(vocab, generator=gen) < 0.2] = num_events
    row_events = torch.stack([torch.randperm(num_events, generator=gen)[:g] for _ in range(c)])
    row_events[torch.rand(c, g, generator=gen) < 0.2] = -1
    singles = []
    for r in range(c):
        free = [j for j in range(vocab) if int(events[j]) not in row_events[r].tolist()]
        pick = torch.randperm(len(free), generator=gen)[:5]
        singles.append(torch.tensor([free[int(i)] for i in pick]))
    return events.int(), row_events.int(), torch.stack(singles)


def test_group_stats_reference_matches_sums_by_hand():
    gen = torch.Generator().manual_seed(60)
    c, vocab, num_events, g = 4, 90, 12, 5
    z = torch.randn(c, vocab, generator=gen, dtype=torch.float64) * 3
    events, row_events, singles = random_rows(gen, c, vocab, num_events, g)
    valid = torch.rand(c, 5, generator=gen) < 0.8
    rows = GroupRows(events, row_events, num_events, 1 / 1.7)
    zmax = z.max(1).values
    sums, tail = group_stats_torch(z, zmax, rows, bucket_bits(singles, valid, vocab))
    for r in range(c):
        e = ((z[r] - zmax[r]) / 1.7).exp()
        taken = set(singles[r][valid[r]].tolist())
        for b, ev in enumerate(row_events[r].tolist()):
            want = e[[j for j in range(vocab) if ev >= 0 and int(events[j]) == ev]].sum()
            assert abs(sums[r, b] - want) <= 1e-14 * max(float(want), 1.0)
            assert ev >= 0 or sums[r, b] == 0
        held = set(row_events[r].tolist())
        rest = [j for j in range(vocab) if j not in taken and int(events[j]) not in held]
        assert abs(tail[r] - e[rest].sum()) <= 1e-14 * float(e.sum())


def test_group_grad_and_coefficients_at_ids_match_sums_by_hand():
    gen = torch.Generator().manual_seed(61)
    c, vocab, taus = 3, 70, [1.0, 2.0]
    z = torch.randn(c, vocab, generator=gen, dtype=torch.float64) * 2
    zmax = z.max(1).values
    coef = torch.randn(c, 2, generator=gen, dtype=torch.float64)
    groups = []
    for tau in (2.0, 1.0):  # two grouped parts with their own events
        events, row_events, _ = random_rows(gen, c, vocab, 9, 4)
        rows = GroupRows(events, row_events, 9, 1 / tau)
        rows.coef = torch.randn(c, 4, generator=gen, dtype=torch.float64)
        groups.append(rows)
    got = group_grad_torch(z.clone(), zmax, taus, coef, groups, torch.float64)
    ids = torch.randint(0, vocab, (c, 6), generator=gen)
    at_ids = group_coef_at(ids, z.gather(1, ids), zmax, groups)
    for r in range(c):
        for j in range(vocab):
            d = float(z[r, j] - zmax[r])
            extra = 0.0
            for rows in groups:
                for b, ev in enumerate(rows.row_events[r].tolist()):
                    if ev >= 0 and int(rows.events[j]) == ev:
                        extra += math.exp(d * rows.inv_tau) * float(rows.coef[r, b])
            base = sum(math.exp(d / t) * float(coef[r, i]) for i, t in enumerate(taus))
            assert abs(float(got[r, j]) - (base + extra)) < 1e-13
            for f in (ids[r] == j).nonzero().flatten().tolist():
                assert abs(float(at_ids[r, f]) - extra) < 1e-13


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("loss", DISTRIBUTION_LOSSES)
def test_fused_flow_with_lookahead_prefix_groups_matches_the_plain_pass(loss, tau):
    hidden, weight, labels, term = plan_problem(1, loss, tau=tau)
    plain, fused = _both(hidden, weight, labels, [term])
    assert not fused[0].isnan() and abs(fused[0].item() - plain[0].item()) <= 1e-13 * abs(
        plain[0].item()
    )
    assert rel(fused[1], plain[1]) < 1e-13 and rel(fused[2], plain[2]) < 1e-13
    assert all(abs(fused[3][k] - plain[3][k]) < 1e-12 for k in plain[3])


@pytest.mark.parametrize("loss", ["forward_kl", "jsd", "tvd"])
def test_fused_flow_with_prefix_groups_matches_the_plain_pass(loss):
    hidden, weight, labels, chunks, targets, proj = grouped(3, tau=2.0)
    term = make_term(loss, targets, proj, chunks, labels)
    plain, fused = _both(hidden, weight, labels, [term])
    assert abs(fused[0].item() - plain[0].item()) <= 1e-13 * abs(plain[0].item())
    assert rel(fused[1], plain[1]) < 1e-13 and rel(fused[2], plain[2]) < 1e-13


def test_fused_flow_with_groups_beside_another_teachers_single_buckets():
    """A grouped teacher next to a first-piece teacher at another temperature: the second
    teacher's bucket ids fall inside the first one's groups, and the exact values written there
    carry both teachers' coefficients."""
    hidden, weight, labels, grouped_term = plan_problem(2, "forward_kl", tau=1.0)
    _, _, _, other = plan_problem(2, "jsd", tau=2.0)
    other.name, other.lookahead = "plain", None
    other.projection = dataclasses.replace(other.projection, groups=None, joins=None)
    other.targets = dataclasses.replace(
        other.targets,
        topk_ids=other.targets.topk_ids[:: grouped_term.lookahead.shape[1]].contiguous(),
        topk_logprobs=other.targets.topk_logprobs[:: grouped_term.lookahead.shape[1]].contiguous(),
        tail_logprob=other.targets.tail_logprob[:: grouped_term.lookahead.shape[1]].contiguous(),
    )
    other.denominator = kd_count(other, labels).double()
    plain, fused = _both(hidden, weight, labels, [grouped_term, other], chunk=5)
    assert abs(fused[0].item() - plain[0].item()) <= 1e-13 * abs(plain[0].item())
    assert rel(fused[1], plain[1]) < 1e-13 and rel(fused[2], plain[2]) < 1e-13
    assert plain[3]["kd/plain"] > 0


_INTERPRETED = """
import torch
from crossdistill.losses import group_kernels as gk
from crossdistill.losses.kernels import bucket_bits
from tests.unit.test_group_kernels import random_rows
g = torch.Generator().manual_seed(0)
for c, vocab, num_events, width, dtype in [
    (2, 20000, 900, 7, torch.float32), (2, 17001, 300, 64, torch.bfloat16), (3, 5000, 40, 3, torch.float32),
    (2, 9000, 400, 130, torch.float32),
]:
    z = (torch.randn(c, vocab, generator=g) * 3).to(dtype)
    zmax = z.float().max(1).values
    groups = []
    for tau in (1.0, 0.5):
        events, rev, singles = random_rows(g, c, vocab, num_events, width)
        rows = gk.GroupRows(events, rev, num_events, 1 / tau)
        rows.coef = torch.randn(c, width, generator=g)
        groups.append(rows)
        bits = bucket_bits(singles, None, vocab)
        a, ta = gk.group_stats_triton(z, zmax, rows, bits)
        b, tb = gk.group_stats_torch(z, zmax, rows, bits)
        assert ((a - b).abs() <= 1e-5 * b.abs() + 1e-30).all(), (a - b).abs().max()
        assert ((ta - tb).abs() <= 1e-5 * tb.abs()).all()
        split = gk.group_stats_triton(z, zmax, rows, bits, rows_per_launch=1)  # one row a launch
        assert torch.equal(split[0], a) and torch.equal(split[1], ta)
    coef = torch.randn(c, 2, generator=g)
    groups[1].row_events = groups[1].row_events[:, : max(1, width // 2)].contiguous()
    groups[1].coef = groups[1].coef[:, : groups[1].row_events.shape[1]].contiguous()
    groups[1].table = None  # its slot table is made again for the narrower rows
    a = gk.group_grad_triton(z.clone().float(), zmax, [1.0, 2.0], coef, groups, torch.float32)
    b = gk.group_grad_torch(z.clone().float(), zmax, [1.0, 2.0], coef, groups, torch.float32)
    assert (a - b).abs().max() <= 1e-6 * b.abs().max()
print("ok")
"""


def test_triton_group_kernels_match_reference_in_the_interpreter():
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
        pytest.skip(
            "Triton's interpreter before 3.7 gives a loaded scalar the shape (1,), which a loop "
            "bound cannot take; the compiled kernels are checked in test_losses_gpu"
        )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd()}
    out = subprocess.run(
        [sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, env=env, timeout=900
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]

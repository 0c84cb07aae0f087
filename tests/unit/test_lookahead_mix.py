"""`teachers.N.target: lookahead_mix`: the `lookahead_end` and `lookahead_prefix_end` divergences
at half weight each, from one teacher's targets, as one KD term.

- loss, gradients and the term's reported KD value against the two targets as two terms of half
  the weight each (what `bench quality --target lookahead_end+lookahead_prefix_end` trains, with
  the teacher run twice), for every projected loss at τ = 1 and 2, chunked pass and full-logits
  reference in float64; the fused flow (its PyTorch reference here) against the plain pass;
- the value is neither target's alone;
- with identical tokenizers (no lookahead rows) it is the ordinary loss, exactly;
- the term names its own target when it refuses a loss.
"""

from __future__ import annotations

import copy

import pytest
import torch

from crossdistill.config import DISTRIBUTION_LOSSES
from crossdistill.errors import UserError
from crossdistill.losses import PrefixGroups, VocabProjection, kd_count
from tests.unit.test_lookahead_prefix import plan_problem
from tests.unit.test_losses_fused import _both
from tests.unit.test_losses_student import make_problem, rel, run


def _three_terms(seed: int, loss: str, tau: float = 1.0):
    """The mix term, and the same problem as a `lookahead_end` and a `lookahead_prefix_end`
    term of half the weight each (all three with the same global denominator)."""
    hidden, weight, labels, prefix_end = plan_problem(seed, loss, tau=tau, past_end=True)
    prefix_end.name = "prefix_end"
    end = copy.copy(prefix_end)
    end.projection = copy.copy(prefix_end.projection)
    end.projection.groups = None
    end.name = "end"
    mix = copy.copy(prefix_end)
    mix.mix, mix.name = True, "mix"
    for t in (end, prefix_end):
        t.weight = 0.5
    return hidden, weight, labels, mix, end, prefix_end


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("loss", DISTRIBUTION_LOSSES)
def test_the_mix_is_both_targets_at_half_weight(loss, tau):
    hidden, weight, labels, mix, end, prefix_end = _three_terms(3, loss, tau)
    assert mix.target == "lookahead_mix" and end.target == "lookahead_end"
    assert prefix_end.target == "lookahead_prefix_end"
    for backend in ("chunked", "reference"):
        one = run(backend, hidden, weight, labels, [mix])
        two = run(backend, hidden, weight, labels, [end, prefix_end])
        assert not one[0].isnan() and abs(one[0].item() - two[0].item()) <= 1e-12 * two[0].abs()
        assert rel(one[1], two[1]) < 1e-11 and rel(one[2], two[2]) < 1e-11, backend
        # each term reports its divergence unweighted; the mix's is their mean
        kd = (two[3]["kd/end"] + two[3]["kd/prefix_end"]) / 2
        assert abs(one[3]["kd/mix"].item() - kd.item()) <= 1e-12 * abs(kd.item()), backend
        assert one[3]["num_kd/mix"] == two[3]["num_kd/end"]


@pytest.mark.parametrize("loss", ["forward_kl", "jsd"])
def test_the_fused_flow_takes_the_mix(loss):
    hidden, weight, labels, mix, _, _ = _three_terms(4, loss, 2.0)
    plain, fused = _both(hidden, weight, labels, [mix])
    assert not fused[0].isnan()
    assert abs(fused[0].item() - plain[0].item()) <= 1e-13 * abs(plain[0].item())
    assert rel(fused[1], plain[1]) < 1e-13 and rel(fused[2], plain[2]) < 1e-13
    assert all(abs(fused[3][k] - plain[3][k]) < 1e-12 for k in plain[3])


def test_the_mix_is_neither_target_alone():
    hidden, weight, labels, mix, end, prefix_end = _three_terms(5, "forward_kl")
    got = run("chunked", hidden, weight, labels, [mix])[0].item()
    for alone in (end, prefix_end):
        alone.weight = 1.0
        other = run("chunked", hidden, weight, labels, [alone])[0].item()
        assert abs(got - other) > 1e-4 * abs(other), alone.name


def test_identical_tokenizers_give_the_ordinary_loss():
    """A teacher with the student's tokenizer reads one row per chunk (no lookahead rows), and
    its groups hold one token each: the mix flag changes nothing there, to the bit, and the loss
    is the first piece's (the identity)."""
    from tests.unit.test_prefix_target import make_term

    hidden, weight, labels, chunks, targets, _ = make_problem(8, v_s=16, v_t=16)
    plain = make_term("forward_kl", targets, VocabProjection.identity(16), chunks, labels)
    ident_g = VocabProjection.identity(16)
    ident_g.groups = PrefixGroups.from_first_pieces(torch.arange(16), torch.arange(16))
    groups = make_term("forward_kl", targets, ident_g, chunks, labels)
    mixed = copy.copy(groups)
    mixed.mix = True
    assert mixed.lookahead is None
    want = run("chunked", hidden, weight, labels, [groups])
    got = run("chunked", hidden, weight, labels, [mixed])
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3]))
    first = run("chunked", hidden, weight, labels, [plain])
    assert abs(got[0].item() - first[0].item()) <= 1e-12 * abs(first[0].item())
    assert rel(got[1], first[1]) < 1e-12 and rel(got[2], first[2]) < 1e-12


def test_a_term_refusing_its_loss_names_the_mix():
    term = plan_problem(0, "chunk_likelihood", past_end=True)[3]
    term.mix = True
    assert term.target == "lookahead_mix"
    with pytest.raises(UserError, match="the lookahead_mix target needs a projected loss"):
        term.check()


def test_the_mix_counts_the_same_positions_as_its_targets():
    hidden, weight, labels, mix, end, _ = _three_terms(7, "forward_kl")
    assert torch.equal(kd_count(mix, labels), kd_count(end, labels))
    assert mix.denominator.item() > 0

"""The lookahead target with byte-prefix groups for the other tokens (`teachers.N.target:
lookahead_prefix`): the observed path as the lookahead target has it, and each of the KD
position's other top-k entries compared with the group of student tokens whose first teacher
piece it is, without the row's single-token buckets. With `past_end` (`lookahead_prefix_end`)
the observed token's mass is also split past its end, as `lookahead_end` does. `lookahead_longer`
is that at chunks of several teacher tokens and the lookahead target at the others.

- the buckets against the plain reference of `test_lookahead_target` with those entries placed
  by hand: in their group, or in the tail where the group holds one of the row's single tokens;
  `lookahead_longer`'s, chunk by chunk, against the two targets it takes from;
- the loss of such buckets, chunked pass and full-logits reference, against a plain float64 loss
  that sums the student's probability over each group's tokens (the row's singles left out),
  value and gradients, for every projected loss at τ = 1 and 2;
- no bucket of the lookahead targets without groups is left without teacher mass;
- a `train()` run, and what the settings refuse.
"""

from __future__ import annotations

import math

import pytest
import torch

from crossdistill.config import DISTRIBUTION_LOSSES
from crossdistill.errors import UserError
from crossdistill.losses import (
    KDTerm,
    PrefixGroups,
    kd_count,
)
from crossdistill.losses.lookahead import project_lookahead
from crossdistill.losses.plan import build_plan
from crossdistill.losses.projection import Buckets
from tests.unit.test_lookahead_target import TAIL, Toy, reference, stacked, toy_chunks, toy_text
from tests.unit.test_losses_student import ce_count, plain_divergence, rel, run
from tests.unit.test_losses_targets import _from_buckets

F64 = torch.float64
NEG_INF = float("-inf")
TOP_K_END = 16384  # a third of the harness teacher's vocabulary (GPT-2 tokenizer, 50304)


def first_teacher_pieces(toy: Toy) -> torch.Tensor:
    """Each student token's first teacher piece: the longest teacher token its bytes start with."""
    return torch.tensor(
        [
            max(
                (t for t, w in enumerate(toy.teacher) if s.startswith(w)),
                key=lambda t: len(toy.teacher[t]),
            )
            for s in toy.student
        ]
    )


def toy_groups(toy: Toy) -> PrefixGroups:
    """The prefix groups of `toy`: each student token in the group of its first teacher piece."""
    return PrefixGroups.from_first_pieces(first_teacher_pieces(toy), toy.proj.first_piece)


def grouped_reference(toy, groups, logp, k, obs, label, depth, past_end=False):
    """The plain lookahead target (`past_end`: `lookahead_end`) with the KD position's other
    entries left out, then placed: in their group (key `("event", e)`), or in the tail where a
    single of the row is in it."""
    event_t = groups.teacher_event.first_piece.tolist()
    event_s = groups.student_event.tolist()
    top0 = sorted(range(len(logp[0])), key=lambda x: -logp[0][x])[:k]
    skip = frozenset(x for x in top0 if x != obs[0] and event_t[x] >= 0)
    out = reference(toy, logp, k, obs, label, depth, past_end, skip=skip)
    taken = {event_s[key] for key, v in out.items() if key != TAIL and v > 0}
    clashes = 0
    for x in skip:
        if event_t[x] in taken:
            out[TAIL] += math.exp(logp[0][x])
            clashes += 1
        else:
            out[("event", event_t[x])] += math.exp(logp[0][x])
    return out, clashes


def dense(out: dict, num_student: int, num_events: int) -> torch.Tensor:
    row = torch.zeros(num_student + num_events + 1, dtype=F64)
    for key, v in out.items():
        if key == TAIL:
            row[-1] += v
        elif isinstance(key, tuple):
            row[num_student + key[1]] += v
        else:
            row[key] += v
    return row


def dense_buckets(b: Buckets, num_student: int, num_events: int) -> torch.Tensor:
    """The buckets as `[M, V_s + E + 1]`, checking the slot rules on each side of `group_from`."""
    g = b.group_from
    out = torch.zeros(b.ids.shape[0], num_student + num_events + 1, dtype=F64)
    for m in range(b.ids.shape[0]):
        for cols, offset in ((range(g), 0), (range(g, b.ids.shape[1]), num_student)):
            seen = {int(b.ids[m, j]) for j in cols if b.valid[m, j]}
            assert len(seen) == sum(bool(b.valid[m, j]) for j in cols)  # distinct valid slots
            for j in cols:
                if b.valid[m, j]:
                    out[m, offset + int(b.ids[m, j])] = math.exp(float(b.logq[m, j]))
                else:
                    assert b.logq[m, j] == NEG_INF
                    assert int(b.ids[m, j]) in seen or not seen
        out[m, -1] = math.exp(float(b.logq_tail[m]))
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("past_end", [False, True])
def test_matches_plain_reference(seed, depth, past_end):
    toy, k = Toy(seed), 5
    groups = toy_groups(toy)
    rows = [r for r in toy_chunks(toy, seed, 120, depth) if len(r[1]) <= depth]
    ids, top, tail, obs, length, rest, cont = stacked(rows, depth, k)
    single = torch.ones(len(rows), dtype=torch.bool) if past_end else None
    b = project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single, groups)
    got = dense_buckets(b, len(toy.student), groups.num_events)
    if past_end:  # the step past the end changes the buckets
        plain = project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, None, groups)
        plain = dense_buckets(plain, len(toy.student), groups.num_events)
        assert int(((got - plain).abs().sum(-1) > 1e-12).sum()) > 3
    clashes = grouped = 0
    for c, (label, o, lp) in enumerate(rows):
        want, n = grouped_reference(toy, groups, lp.tolist(), k, o, label, depth, past_end)
        clashes += n
        grouped += sum(isinstance(key, tuple) for key in want)
        want = dense(want, len(toy.student), groups.num_events)
        torch.testing.assert_close(got[c], want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(rows), dtype=F64))
    assert not got.isnan().any() and (got >= 0).all()
    assert clashes > 3 and grouped > 3 * len(rows)  # the draw exercises both placements


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [2, 3])
def test_longer_only_takes_each_chunk_from_its_target(seed, depth):
    """`lookahead_longer`: `lookahead_prefix_end`'s buckets at a chunk of several teacher
    tokens, the lookahead target's (no groups, nothing past the end) at a chunk of one."""
    toy, k = Toy(seed), 5
    groups = toy_groups(toy)
    rows = [r for r in toy_chunks(toy, seed, 120, depth) if len(r[1]) <= depth]
    ids, top, tail, obs, length, rest, cont = stacked(rows, depth, k)
    args = (ids, top, tail, toy.proj, cont, obs, length, rest)
    single = torch.ones(len(rows), dtype=torch.bool)
    n_s, n_e = len(toy.student), groups.num_events
    longer = length > 1
    got = dense_buckets(project_lookahead(*args, single, groups, only=longer), n_s, n_e)
    both = dense_buckets(project_lookahead(*args, single, groups), n_s, n_e)
    plain = _from_buckets(project_lookahead(*args), n_s)
    plain = torch.cat([plain[:, :n_s], torch.zeros(len(rows), n_e, dtype=F64), plain[:, n_s:]], -1)
    assert 3 < int(longer.sum()) < len(rows) - 3
    torch.testing.assert_close(got[longer], both[longer], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got[~longer], plain[~longer], rtol=1e-12, atol=1e-14)
    # the two differ at chunks of one teacher token, so the comparison can tell them apart
    assert int(((both[~longer] - plain[~longer]).abs().sum(-1) > 1e-12).sum()) > 3
    assert not got.isnan().any()


def plan_problem(
    seed: int,
    loss: str,
    k: int = 5,
    depth: int = 3,
    tau: float = 1.0,
    past_end: bool = False,
    longer_only: bool = False,
):
    """A text as toy student tokens (one chunk each) over random teacher splits, the teacher's
    logits at random, and the lookahead term whose projection carries prefix groups
    (`past_end`: `lookahead_prefix_end`; with `longer_only`: `lookahead_longer`)."""
    toy = Toy(seed)
    toy.proj.groups = toy_groups(toy)
    gen = torch.Generator().manual_seed(50 + seed)
    t = toy_text(toy, gen, 30, depth, k, past_end, tau=tau)
    labels = t.labels
    params = {"jsd": {"beta": 0.3}, "skew_kl": {"alpha": 0.2}}.get(loss, {})
    term = KDTerm(t.targets, toy.proj, t.chunks, torch.tensor(1.0), loss, params=params)
    term.lookahead, term.past_end, term.longer_only = t.ahead, past_end, longer_only
    term.denominator = kd_count(term, labels).double()
    hidden = torch.randn(len(t.words), 6, generator=gen, dtype=F64)
    weight = torch.randn(len(toy.student), 6, generator=gen, dtype=F64)
    return hidden, weight, labels, term


def plain_loss(hidden, weight, labels, term, kd_ratio):
    """CE plus the KD term row by row: the student's mass of each group summed over its tokens
    other than the row's singles; the tail every other token."""
    plan = build_plan(labels, [term], kd_ratio, ce_count(labels), F64)
    tp = plan.terms[0]
    (part,) = tp.parts
    g, event_s = part.group_from, part.groups.tolist()
    z = hidden @ weight.t()
    logp = torch.log_softmax(z, -1)
    p = torch.softmax(z / term.temperature, -1)  # the KD term's softmax
    loss = sum(
        plan.ce_weight[r] * -logp[r, int(labels[r])] for r in range(len(labels)) if labels[r] >= 0
    )
    for r in range(len(labels)):
        if tp.row_weight[r] == 0:
            continue
        valid = part.valid[r].tolist()
        singles = [int(part.ids[r, j]) for j in range(g) if valid[j]]
        events = [int(part.ids[r, j]) for j in range(g, len(valid)) if valid[j]]
        q = [math.exp(float(part.logq[r, j])) for j in range(len(valid)) if valid[j]]
        p_b = [p[r, j] for j in singles]
        for e in events:
            p_b.append(
                sum(p[r, j] for j in range(p.shape[1]) if event_s[j] == e and j not in singles)
            )
        rest = [j for j in range(p.shape[1]) if j not in singles and event_s[j] not in events]
        q.append(math.exp(float(part.logq_tail[r])))
        p_b.append(sum(p[r, j] for j in rest))
        loss = loss + tp.row_weight[r] * plain_divergence(term.loss, q, p_b, term.params)
    return loss, part


@pytest.mark.parametrize(
    "past_end, longer_only",
    [(False, False), (True, False), (True, True)],
    ids=["lookahead_prefix", "lookahead_prefix_end", "lookahead_longer"],
)
@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("loss", DISTRIBUTION_LOSSES)
def test_loss_matches_plain_float64_reference(loss, tau, past_end, longer_only):
    hidden, weight, labels, term = plan_problem(
        1, loss, tau=tau, past_end=past_end, longer_only=longer_only
    )
    check_against_plain_loss(hidden, weight, labels, term)


def check_against_plain_loss(hidden, weight, labels, term) -> float:
    """The chunked pass and the full-logits reference against `plain_loss` at KD weight 0.6,
    value and gradients, on a problem with rows of both kinds of bucket; returns the value."""
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    want, part = plain_loss(h, w, labels, term, 0.6)
    want.backward()
    live = part.valid[:, part.group_from :].any(1) & part.valid[:, : part.group_from].any(1)
    assert int(live.sum()) > 10  # rows with both kinds of bucket
    for backend in ("chunked", "reference"):
        got, g_h, g_w, _ = run(backend, hidden, weight, labels, [term], kd_ratio=0.6, chunk_size=4)
        assert not got.isnan() and abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
        assert rel(g_h, h.grad) < 1e-10 and rel(g_w, w.grad) < 1e-10, backend
    return want.item()


def test_groups_change_the_loss_of_the_lookahead_target():
    """The same problem without the groups (the lookahead target): another value."""
    hidden, weight, labels, term = plan_problem(2, "forward_kl")
    grouped = run("chunked", hidden, weight, labels, [term])[0]
    term.projection.groups = None
    plain = run("chunked", hidden, weight, labels, [term])[0]
    assert abs(grouped.item() - plain.item()) > 1e-3 * abs(plain.item())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("past_end", [False, True])
def test_no_lookahead_bucket_is_left_without_teacher_mass(seed, past_end):
    """The observed token's entry at the KD position moves along the path; where every later
    alternative joins past its first piece, that piece has no mass left. It is no bucket then
    (it stays in the tail), so reverse KL, infinite at a bucket of zero teacher mass that the
    student gives any, stays finite: `lookahead` and `lookahead_end`, whose toy problems have
    such rows."""
    hidden, weight, labels, term = plan_problem(seed, "reverse_kl", past_end=past_end)
    term.projection.groups = None
    (part,) = build_plan(labels, [term], 0.6, ce_count(labels), torch.float64).terms[0].parts
    assert not (part.valid & (part.logq == float("-inf"))).any()
    loss, g_h, g_w, _ = run("chunked", hidden, weight, labels, [term])
    assert torch.isfinite(loss) and torch.isfinite(g_h).all() and torch.isfinite(g_w).all()


def test_longer_only_sits_between_lookahead_and_lookahead_prefix_end():
    """The same problem as `lookahead_prefix_end`, as `lookahead_longer` and as the lookahead
    target: three values, and the term's flag is what separates the first two."""
    hidden, weight, labels, term = plan_problem(2, "forward_kl", past_end=True)
    both = run("chunked", hidden, weight, labels, [term])[0].item()
    term.longer_only = True
    longer = run("chunked", hidden, weight, labels, [term])[0].item()
    term.projection.groups, term.past_end, term.longer_only = None, False, False
    plain = run("chunked", hidden, weight, labels, [term])[0].item()
    assert abs(longer - both) > 1e-3 * abs(both) and abs(longer - plain) > 1e-3 * abs(plain)


def test_a_term_refusing_its_loss_names_its_target():
    """Each lookahead variant, built without the config, is refused by its own name when its
    loss has no projected form."""
    term = plan_problem(0, "chunk_likelihood", past_end=True)[3]
    for longer_only, groups, past_end, name in (
        (True, True, True, "lookahead_longer"),
        (False, True, True, "lookahead_prefix_end"),
        (False, True, False, "lookahead_prefix"),
        (False, False, True, "lookahead_end"),
        (False, False, False, "lookahead"),
    ):
        term.longer_only, term.past_end = longer_only, past_end
        term.projection.groups = term.projection.groups if groups else None
        assert term.target == name
        with pytest.raises(UserError, match=f"the {name} target needs a projected loss"):
            term.check()
    term.lookahead, term.longer_only, term.past_end = None, False, False
    assert term.target == "first_piece"  # the groups are None after the last case
    term.projection.groups = plan_problem(0, "forward_kl")[3].projection.groups
    assert term.target == "prefix"


def test_a_run_with_the_target_trains_and_differs_from_lookahead(tmp_path, tokenizer_dir):
    """`train()` in one process on the harness's tokenizers (Llama-2 student, GPT-2 teacher):
    finite first KD values, `lookahead_prefix`'s not the lookahead target's, and at a top-k of
    a third of the vocabulary, `lookahead_prefix_end`'s (the rows past the ends read too) not
    `lookahead_prefix`'s. The untrained teacher is nearly uniform, so a top-k holds both the
    observed token where a path starts and a join where it ends at about the square of its
    share of the positions: at a twelfth a batch may have none, at a third any batch has some."""
    from tests.distributed import _harness as h

    kd = {}
    for target, top_k in (
        ("lookahead", 64),
        ("lookahead_prefix", 64),
        ("lookahead_prefix", TOP_K_END),
        ("lookahead_prefix_end", TOP_K_END),
        ("lookahead_longer", TOP_K_END),
        ("lookahead_mix", TOP_K_END),
    ):
        cfg = h.probe_config(tmp_path / f"{target}-{top_k}", tokenizer_dir)
        cfg.teachers[0].target, cfg.teachers[0].top_k = target, top_k
        kd[target, top_k] = h.first_kd(cfg)
    assert all(math.isfinite(v) for v in kd.values())
    grouped = kd["lookahead_prefix", 64]
    assert abs(grouped - kd["lookahead", 64]) > 1e-6 * grouped
    # past the end the moved mass is p(t_0)·p(joins) ~ 1/V² under a nearly uniform teacher:
    # tiny, but the run is deterministic and without the rows past the end it is the same run
    assert kd["lookahead_prefix_end", TOP_K_END] != kd["lookahead_prefix", TOP_K_END]
    # `lookahead_longer` leaves the groups and the end step out at one-to-one chunks
    assert kd["lookahead_longer", TOP_K_END] != kd["lookahead_prefix_end", TOP_K_END]
    # `lookahead_mix` is half of it and half of the same without the groups
    assert kd["lookahead_mix", TOP_K_END] != kd["lookahead_prefix_end", TOP_K_END]


def test_settings_refuse_a_tensor_parallel_student(tmp_path, tokenizer_dir):
    from crossdistill.train.validate import validate_config
    from tests.distributed import _harness as h

    cfg = h.trainer_config(tmp_path, tokenizer_dir, 2, eval_every=2)
    for target in ("lookahead_prefix", "lookahead_prefix_end", "lookahead_longer", "lookahead_mix"):
        cfg.teachers[0].target = target
        cfg.student.parallel.tp = 2
        with pytest.raises(UserError, match=f"target = {target} sums the student's"):
            validate_config(cfg)
        cfg.student.parallel.tp = 1
        validate_config(cfg)

"""The lookahead target with each of the KD position's other tokens split between its exact
student token and its group of longer ones (`teachers.N.target: lookahead_split`), at a share
counted on the training text.

- the groups leave every exact student token out, and nothing else;
- the buckets against the plain reference of `test_lookahead_target` with those entries placed
  by hand: the share on the exact token, the rest in the group (or the tail where the group
  holds one of the row's single tokens), with shares of 0 and 1 among the draws;
- the loss, chunked pass and full-logits reference, against the plain float64 loss of
  `test_lookahead_prefix`, value and gradients, for every projected loss at τ = 1 and 2;
- the counts on real tokenizers, read off by hand, and the shares drawn toward the overall one;
- `split_context: previous`: the pair's share after the student's previous token, against the
  same reference with the shares chosen per row, and the buckets bit for bit where no pair
  applies;
- `train()` runs, and what the settings refuse.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from crossdistill.config import DISTRIBUTION_LOSSES
from crossdistill.errors import UserError
from crossdistill.losses import PrefixGroups
from crossdistill.losses.lookahead import project_lookahead
from crossdistill.train.short_share import (
    PRIOR_COUNT,
    boundary_counts,
    describe_counts,
    short_shares,
)
from tests.unit.test_lookahead_prefix import (
    TOP_K_END,
    check_against_plain_loss,
    dense,
    dense_buckets,
    first_teacher_pieces,
    plan_problem,
)
from tests.unit.test_lookahead_target import TAIL, Toy, reference, stacked, toy_chunks
from tests.unit.test_losses_student import run

F64 = torch.float64


def split_groups(toy: Toy, seed: int) -> PrefixGroups:
    """The split groups of `toy` at random shares, one teacher token at 0 and one at 1."""
    gen = torch.Generator().manual_seed(100 + seed)
    share = torch.rand(len(toy.teacher), generator=gen, dtype=F64)
    share[seed % len(toy.teacher)] = 0.0
    share[(seed + 1) % len(toy.teacher)] = 1.0
    return PrefixGroups.split_from_first_pieces(
        first_teacher_pieces(toy), toy.proj.first_piece, toy.proj.exact, share
    )


def split_reference(toy, groups, logp, k, obs, label, depth, share=None):
    """`lookahead_end`'s plain target with the KD position's other entries that have a group
    left out, then placed: the share on the exact student token (`share [V_t]`, default the
    groups' own), the rest in the group (key `("event", e)`), or in the tail where a single of
    the row is in that group."""
    event_t = groups.teacher_event.first_piece.tolist()
    event_s = groups.student_event.tolist()
    share = groups.short_logshare.exp().tolist() if share is None else share
    exact, first = toy.proj.exact.tolist(), toy.proj.first_piece.tolist()
    top0 = sorted(range(len(logp[0])), key=lambda x: -logp[0][x])[:k]
    skip = frozenset(x for x in top0 if x != obs[0] and event_t[x] >= 0)
    out = reference(toy, logp, k, obs, label, depth, True, skip=skip)
    taken = {event_s[key] for key, v in out.items() if key != TAIL and v > 0}
    for x in skip:
        p = math.exp(logp[0][x])
        pi = share[x] if exact[x] else 0.0
        if pi > 0:
            out[first[x]] += p * pi
        if pi < 1:
            out[TAIL if event_t[x] in taken else ("event", event_t[x])] += p * (1 - pi)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_groups_leave_out_exactly_the_exact_tokens(seed):
    toy = Toy(seed)
    split, whole = (
        split_groups(toy, seed),
        PrefixGroups.from_first_pieces(first_teacher_pieces(toy), toy.proj.first_piece),
    )
    spelled = set(toy.proj.first_piece[toy.proj.exact].tolist())
    none = split.num_events
    for s in range(len(toy.student)):
        want = none if s in spelled else int(whole.student_event[s])
        assert int(split.student_event[s]) == want, toy.student[s]
    assert 0 < len(spelled) < len(toy.student)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [2, 3])
def test_matches_plain_reference(seed, depth):
    toy, k = Toy(seed), 5
    groups = split_groups(toy, seed)
    rows = [r for r in toy_chunks(toy, seed, 120, depth) if len(r[1]) <= depth]
    ids, top, tail, obs, length, rest, cont = stacked(rows, depth, k)
    single = torch.ones(len(rows), dtype=torch.bool)
    b = project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single, groups)
    got = dense_buckets(b, len(toy.student), groups.num_events)
    split = 0
    for c, (label, o, lp) in enumerate(rows):
        want = split_reference(toy, groups, lp.tolist(), k, o, label, depth)
        split += sum(isinstance(key, tuple) for key in want)
        want = dense(want, len(toy.student), groups.num_events)
        torch.testing.assert_close(got[c], want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(rows), dtype=F64))
    assert not got.isnan().any() and (got >= 0).all()
    assert split > len(rows)  # the draw puts mass in groups


@pytest.mark.parametrize("seed", range(4))
def test_pair_shares_replace_the_tokens_own_after_their_previous_token(seed):
    """`split_context: previous`: at each chunk, an alternative whose pair with the student's
    token before the chunk is in the table takes the pair's share, any other its own; without
    a previous token, or with no pair of the row in the table, the buckets are the ones
    without the table, bit for bit."""
    toy, k, depth = Toy(seed), 5, 2
    groups = split_groups(toy, seed)
    v_t, v_s = len(toy.teacher), len(toy.student)
    rows = [r for r in toy_chunks(toy, seed, 120, depth) if len(r[1]) <= depth]
    ids, top, tail, obs, length, rest, cont = stacked(rows, depth, k)
    single = torch.ones(len(rows), dtype=torch.bool)
    gen = torch.Generator().manual_seed(200 + seed)
    previous = torch.randint(-1, v_s, (len(rows),), generator=gen)
    # about half of all pairs, with shares of 0 and 1 among them
    pairs = {
        (u, x): float(torch.rand((), generator=gen, dtype=F64))
        for u in range(v_s)
        for x in range(v_t)
        if torch.rand((), generator=gen) < 0.5
    }
    first = next(iter(pairs))
    pairs[first], pairs[list(pairs)[1]] = 0.0, 1.0
    keys = sorted(u * v_t + x for u, x in pairs)
    table = groups.with_pairs(
        torch.tensor(keys),
        torch.tensor([pairs[(key // v_t, key % v_t)] for key in keys], dtype=F64),
    )
    b = project_lookahead(
        ids, top, tail, toy.proj, cont, obs, length, rest, single, table, previous=previous
    )
    got = dense_buckets(b, v_s, groups.num_events)
    own = groups.short_logshare.exp().tolist()
    moved = 0
    for c, (label, o, lp) in enumerate(rows):
        u = int(previous[c])
        share = [pairs.get((u, x), own[x]) if u >= 0 else own[x] for x in range(v_t)]
        moved += share != own
        want = split_reference(toy, groups, lp.tolist(), k, o, label, depth, share)
        want = dense(want, v_s, groups.num_events)
        torch.testing.assert_close(got[c], want, rtol=1e-12, atol=1e-14)
    assert moved > len(rows) // 4
    without = project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single, groups)
    for table_rows, prev in ((table, None), (table, torch.full_like(previous, -1)),
                             (groups.with_pairs(torch.zeros(0), torch.zeros(0)), previous)):  # fmt: skip
        same = project_lookahead(
            ids, top, tail, toy.proj, cont, obs, length, rest, single, table_rows, previous=prev
        )
        assert torch.equal(same.logq, without.logq) and torch.equal(same.ids, without.ids)


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("loss", DISTRIBUTION_LOSSES)
def test_loss_matches_plain_float64_reference(loss, tau):
    hidden, weight, labels, term = plan_problem(1, loss, tau=tau, past_end=True)
    whole = term.projection.groups
    term.projection.groups = split_groups(Toy(1), 1)
    assert term.target == "lookahead_split"
    want = check_against_plain_loss(hidden, weight, labels, term)
    # another target than lookahead_prefix_end on the same problem
    term.projection.groups = whole
    other = run("chunked", hidden, weight, labels, [term], kd_ratio=0.6, chunk_size=4)[0]
    assert abs(other.item() - want) > 1e-6 * abs(want)


def test_counts_on_real_tokenizers(tokenizer_dir):
    """Llama-2 writes `.` + `items` where Llama-3 writes `.items`: three boundaries of `.`
    where the student's token is a longer one; ` =` is one token on both sides twice."""
    from crossdistill.alignment.projection import build_projection
    from crossdistill.models import load_tokenizer

    tok_s = load_tokenizer(str(tokenizer_dir("llama3")))
    tok_t = load_tokenizer(str(tokenizer_dir("llama2")))
    proj = build_projection(tok_t, tok_s)
    spelled = np.where(proj.exact.numpy(), proj.first_piece.numpy(), -1)
    of_student = build_projection(tok_s, tok_t).first_piece.numpy()
    text = "self.items = items.copy()\nself.x = 1\n"
    short, longer = boundary_counts(tok_s, tok_t, [text], spelled, of_student)
    dot, eq = (tok_t.convert_tokens_to_ids(t) for t in (".", "▁="))
    assert (short[dot], longer[dot]) == (0, 3)
    assert (short[eq], longer[eq]) == (2, 0)
    assert short.sum() + longer.sum() <= len(tok_t(text, add_special_tokens=False)["input_ids"])


def test_shares_are_drawn_toward_the_overall_share():
    short = np.array([30, 0, 1, 0])
    longer = np.array([10, 20, 0, 0])
    overall = 31 / 61
    got = short_shares(short, longer)
    want = (short + PRIOR_COUNT * overall) / (short + longer + PRIOR_COUNT)
    np.testing.assert_allclose(got, want, rtol=1e-15)
    assert got[3] == pytest.approx(overall) and 0 < got[1] < overall < got[2] < 1
    assert (short_shares(np.zeros(3, int), np.zeros(3, int)) == 0.5).all()


def test_the_tokens_prior_weighs_each_seen_token_once():
    """`split_prior: tokens`: one frequent token that splits unlike the rest (a digit, nearly
    always a longer student token) no longer sets the share of the tokens never seen."""
    short = np.array([100, 0, 2, 0])
    longer = np.array([0, 900, 0, 0])
    boundaries = short_shares(short, longer)
    assert boundaries[3] == pytest.approx(102 / 1002)
    tokens = short_shares(short, longer, "tokens")
    overall = (1.0 + 0.0 + 1.0) / 3
    want = (short + PRIOR_COUNT * overall) / (short + longer + PRIOR_COUNT)
    np.testing.assert_allclose(tokens, want, rtol=1e-15)
    assert tokens[3] == pytest.approx(overall) and tokens[2] > boundaries[2]
    assert (short_shares(np.zeros(3, int), np.zeros(3, int), "tokens") == 0.5).all()


def test_the_log_line_says_what_was_counted():
    short, longer = np.array([30, 0, 1, 0]), np.array([10, 20, 0, 0])
    line = describe_counts("t", short, longer, 1000)
    assert line == (
        "teacher 't': lookahead_split shares counted on 61 chunks of 3 teacher tokens in a "
        "1,000-byte sample of the training text; the student's token is the exact one in 51% "
        "of them"
    )
    empty = describe_counts("t", np.zeros(4, int), np.zeros(4, int), 10)
    assert empty.startswith("warning: teacher 't'") and "0.5 / 0.5" in empty


def test_a_run_with_the_target_trains_and_differs_from_lookahead_prefix_end(
    tmp_path, tokenizer_dir, capsys
):
    """`train()` in one process on the harness's tokenizers (Llama-2 student, GPT-2 teacher):
    a finite first KD value, not `lookahead_prefix_end`'s (top-k of a third of the vocabulary,
    as in `test_lookahead_prefix`), and the log says what the shares were counted on."""
    from tests.distributed import _harness as h

    kd, logs = {}, {}
    for target in ("lookahead_prefix_end", "lookahead_split"):
        cfg = h.probe_config(tmp_path / target, tokenizer_dir)
        cfg.teachers[0].target, cfg.teachers[0].top_k = target, TOP_K_END
        kd[target] = h.first_kd(cfg)
        logs[target] = "".join(capsys.readouterr())
    assert all(math.isfinite(v) for v in kd.values())
    assert abs(kd["lookahead_split"] - kd["lookahead_prefix_end"]) > 1e-6 * kd["lookahead_split"]
    counted = re.search(
        r"lookahead_split shares counted on ([\d,]+) chunks", logs["lookahead_split"]
    )
    assert counted and int(counted[1].replace(",", "")) > 100
    assert "lookahead_split shares" not in logs["lookahead_prefix_end"]


def test_a_run_with_pair_shares_trains_and_differs_from_one_share_per_token(
    tmp_path, tokenizer_dir, capsys
):
    """`train()` in one process (Llama-2 student, GPT-2 teacher) under `lookahead_split` with
    `split_context: previous`: a finite first KD value, not the one with a share per token
    (under `boundary: ignore`, where the previous token is read for the pair table alone), a
    run under `condition` too, and the log says what the pairs were counted on."""
    from tests.distributed import _harness as h

    kd, logs = {}, {}
    for boundary, context in (
        ("ignore", "none"),
        ("ignore", "previous"),
        ("condition", "previous"),
    ):
        cfg = h.probe_config(tmp_path / boundary / context, tokenizer_dir)
        t = cfg.teachers[0]
        t.target, t.top_k, t.boundary, t.split_context = (
            "lookahead_split", TOP_K_END, boundary, context
        )  # fmt: skip
        kd[boundary, context] = h.first_kd(cfg)
        logs[boundary, context] = "".join(capsys.readouterr())
    assert all(math.isfinite(v) for v in kd.values())
    a, b = kd["ignore", "none"], kd["ignore", "previous"]
    assert abs(a - b) > 1e-6 * abs(a)
    for boundary in ("ignore", "condition"):
        pairs = re.search(r"per previous student token on ([\d,]+) chunks: ([\d,]+) pairs",
                          logs[boundary, "previous"])  # fmt: skip
        assert pairs and int(pairs[2].replace(",", "")) > 10
    assert "per previous student token" not in logs["ignore", "none"]


def test_wide_shares_are_previous_without_the_pairs(tmp_path, tokenizer_dir):
    """`split_context: wide` counts the per-token shares on the sample `previous` counts on,
    and has no pair table; `none` has none either; `previous` has one, keyed within the pairs
    of its teacher's rows and the student's vocabulary."""
    from crossdistill.models import load_tokenizer
    from crossdistill.train.build import build_projection_for
    from tests.distributed import _harness as h

    cfg = h.trainer_config(tmp_path, tokenizer_dir, 2, eval_every=2)
    tok_s, tok_t = load_tokenizer(cfg.student.tokenizer), load_tokenizer(cfg.teachers[0].tokenizer)
    groups = {}
    for context in ("none", "wide", "previous"):
        t = cfg.teachers[0]
        t.target, t.split_context = "lookahead_split", context
        proj = build_projection_for(
            t, tok_t, tok_s, len(tok_t), len(tok_s), "cpu", data=cfg.data
        )  # fmt: skip
        groups[context] = proj.groups
    assert groups["none"].pair_keys is None and groups["wide"].pair_keys is None
    torch.testing.assert_close(groups["wide"].short_logshare, groups["previous"].short_logshare)
    keys = groups["previous"].pair_keys
    assert keys.numel() > 10 and bool((keys[1:] > keys[:-1]).all())
    assert int(keys.max()) < len(tok_s) * len(tok_t)


def test_settings_and_projection_refuse_what_cannot_be_built(tmp_path, tokenizer_dir):
    from crossdistill.models import load_tokenizer
    from crossdistill.train.build import build_projection_for
    from crossdistill.train.validate import validate_config
    from tests.distributed import _harness as h

    cfg = h.trainer_config(tmp_path, tokenizer_dir, 2, eval_every=2)
    cfg.teachers[0].target = "lookahead_split"
    cfg.student.parallel.tp = 2
    with pytest.raises(UserError, match="target = lookahead_split sums the student's"):
        validate_config(cfg)
    cfg.student.parallel.tp = 1
    validate_config(cfg)
    tok_s, tok_t = load_tokenizer(cfg.student.tokenizer), load_tokenizer(cfg.teachers[0].tokenizer)
    with pytest.raises(UserError, match="lookahead_split counts its shares on the training text"):
        build_projection_for(cfg.teachers[0], tok_t, tok_s, len(tok_t), len(tok_s), "cpu")

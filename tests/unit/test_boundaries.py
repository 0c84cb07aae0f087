"""The KD position's top-k conditioned on what the student's last token rules out
(`teachers.N.boundary: condition`, `losses.boundaries`).

- `condition` against a plain float64 Bayes' rule on fresh random rows: the dropped entries out,
  the rest and the tail divided by what is left, the total kept; a row without a dropped entry
  comes back bit for bit, one with nearly nothing left as it was;
- `dropped`: the blocked first bytes after the student's token, not those the teacher's token
  blocks too, never the text's own token;
- the loss of a term that carries the table against the loss of the same term whose KD rows were
  conditioned by the plain reference beforehand, at depth 1 (every projected loss) and under the
  lookahead target (depth 3, rows past the KD position untouched), chunked and full-logits;
- the counts: a pair never seen where it was expected, not a rare token's or a rare byte's, and
  on real tokenizers Llama-3's line end that swallows the next one, which Mistral's does not;
- identical tokenizers: no table, the loss unchanged; a `train()` run whose log says what was
  counted, and the projection refused without the training text.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

from crossdistill.config import DISTRIBUTION_LOSSES
from crossdistill.errors import UserError
from crossdistill.losses.boundaries import MIN_KEPT, Boundaries, condition, tokens_before
from crossdistill.train.boundaries import EXPECTED_COUNT, MIN_COUNT, blocked_keys
from tests.unit.test_lookahead_prefix import plan_problem
from tests.unit.test_losses_student import rel, run, terms_for

F64 = torch.float64


def plain_condition(ids, lp, tail, dropped):
    """Bayes' rule row by row in Python floats: `(ids, log-probs, tail)` lists per row."""
    out = []
    for row_ids, row_lp, row_tail, row_drop in zip(
        ids.tolist(), lp.tolist(), tail.tolist(), dropped.tolist()
    ):
        gone = sum(math.exp(v) for v, d in zip(row_lp, row_drop) if d)
        left = 1.0 - gone
        if not any(row_drop) or all(row_drop) or left <= MIN_KEPT:
            out.append((row_ids, row_lp, row_tail))
            continue
        kept = [
            (i, v - math.log(left) if not d else -math.inf)
            for i, v, d in zip(row_ids, row_lp, row_drop)
        ]
        kept.sort(key=lambda e: -e[1])
        # a dropped entry: probability 0, under the id of the row's first entry
        ids_out = [i if v > -math.inf else kept[0][0] for i, v in kept]
        out.append((ids_out, [v for _, v in kept], row_tail - math.log(left)))
    return out


def random_rows(seed: int, rows: int = 40, k: int = 6, vocab: int = 30):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=F64) * 2
    logp = torch.log_softmax(logits, -1)
    lp, ids = logp.topk(k, -1)
    tail = torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-12))
    dropped = torch.rand(rows, k, generator=gen) < 0.3
    dropped[:5] = False  # rows with nothing dropped
    dropped[5, :] = True  # a row with no top-k entry left: as it was
    return ids, lp, tail, dropped


@pytest.mark.parametrize("seed", range(4))
def test_condition_matches_bayes_rule(seed):
    ids, lp, tail, dropped = random_rows(seed)
    got_ids, got_lp, got_tail = condition(ids, lp, tail, dropped)
    for r, (want_ids, want_lp, want_tail) in enumerate(plain_condition(ids, lp, tail, dropped)):
        finite = [j for j, v in enumerate(want_lp) if v > -math.inf]
        assert got_ids[r].tolist() == want_ids
        np.testing.assert_allclose(got_lp[r, finite].numpy(), [want_lp[j] for j in finite],
                                   rtol=0, atol=1e-13)  # fmt: skip
        assert (got_lp[r, len(finite) :] == -math.inf).all()
        assert abs(got_tail[r].item() - want_tail) < 1e-12
    # the total is kept: every row still sums to one
    total = got_lp.exp().sum(-1) + got_tail.exp()
    np.testing.assert_allclose(total.numpy(), 1.0, rtol=0, atol=1e-12)
    assert not torch.isnan(got_lp).any() and not torch.isnan(got_tail).any()


def test_a_row_without_a_dropped_entry_comes_back_bit_for_bit():
    ids, lp, tail, dropped = random_rows(7)
    lp[:, [1, 2]] = lp[:, [2, 1]]  # an order the sort would change, where nothing is dropped
    got_ids, got_lp, got_tail = condition(ids, lp, tail, torch.zeros_like(dropped))
    assert torch.equal(got_ids, ids) and torch.equal(got_lp, lp) and torch.equal(got_tail, tail)


def test_a_row_with_nearly_nothing_left_keeps_everything():
    lp = torch.log(torch.tensor([[1 - 1e-8, 5e-9, 5e-9]], dtype=F64))
    ids = torch.tensor([[3, 1, 2]])
    tail = torch.tensor([-math.inf], dtype=F64)
    got = condition(ids, lp, tail, torch.tensor([[True, False, False]]))
    assert torch.equal(got[0], ids) and torch.equal(got[1], lp) and torch.equal(got[2], tail)


def toy_boundaries() -> Boundaries:
    """Teacher ids 0..5 starting with bytes a, b, c, a, -, b (id 4 covers no text); the
    student's token 7 rules out b and c after it, its token 8 rules out a; the teacher's token 2
    rules out c."""
    first = torch.tensor([97, 98, 99, 97, -1, 98])
    blocked_s = torch.tensor(sorted([7 * 256 + 98, 7 * 256 + 99, 8 * 256 + 97]))
    blocked_t = torch.tensor([2 * 256 + 99])
    return Boundaries(first, blocked_s, blocked_t)


def test_dropped_reads_both_tables_and_spares_the_texts_token():
    b = toy_boundaries()
    ids = torch.tensor([[0, 1, 2, 3, 4, 5]] * 5)
    before_s = torch.tensor([7, 7, 8, 9, -1])
    before_t = torch.tensor([0, 2, 0, 0, 0])
    first_t = torch.tensor([5, 5, 3, 0, 0])
    got = b.dropped(before_s, before_t, first_t, ids).tolist()
    assert got[0] == [False, True, True, False, False, False]  # 5 is the text's own token
    assert got[1] == [False, True, False, False, False, False]  # c: the teacher's 2 blocks it too
    assert got[2] == [True, False, False, False, False, False]  # 3 is the text's own token
    assert got[3] == [False] * 6  # a student token that rules nothing out
    assert got[4] == [False] * 6  # the chunk starts its rows


def test_tokens_before_reads_both_sides_and_marks_a_first_chunk():
    chunks = torch.tensor([[0, 1, 0, 1], [1, 2, 1, 3], [2, 4, 3, 4]])
    ids_s, ids_t = torch.tensor([10, 11, 12, 13]), torch.tensor([20, 21, 22, 23])
    got = tokens_before(chunks, ids_s, ids_t).tolist()
    assert got == [[-1, -1, -1], [10, 20, 21], [11, 22, 23]]


def conditioned_by_hand(term, depth: int):
    """`term` without the table, its KD rows conditioned beforehand by `plain_condition`."""
    tg, c = term.targets, term.chunks.shape[0]
    ids = tg.topk_ids.view(c, depth, -1).clone()
    lp = tg.topk_logprobs.view(c, depth, -1).clone()
    tail = tg.tail_logprob.view(c, depth).clone()
    b, before = term.projection.boundaries, term.before
    dropped = b.dropped(before[:, 0], before[:, 1], before[:, 2], ids[:, 0])
    for r, (i, v, t) in enumerate(plain_condition(ids[:, 0], lp[:, 0], tail[:, 0], dropped)):
        ids[r, 0], lp[r, 0], tail[r, 0] = torch.tensor(i), torch.tensor(v, dtype=lp.dtype), t
    targets = dataclasses.replace(
        tg,
        topk_ids=ids.view(tg.topk_ids.shape).to(tg.topk_ids.dtype),
        topk_logprobs=lp.view(tg.topk_logprobs.shape),
        tail_logprob=tail.view(tg.tail_logprob.shape),
    )
    projection = dataclasses.replace(term.projection, boundaries=None)
    return dataclasses.replace(term, targets=targets, projection=projection, before=None)


def with_table(term, depth: int, seed: int):
    """`term` with a random table and random tokens before each chunk, such that some of its KD
    rows lose entries (the text's own first teacher token among the candidates)."""
    gen = torch.Generator().manual_seed(300 + seed)
    tg, c = term.targets, term.chunks.shape[0]
    v_t = int(tg.topk_ids.max()) + 1
    first = torch.randint(0, 3, (v_t,), generator=gen)
    first[0] = -1
    blocked_s = torch.tensor(
        sorted({u * 256 + b for u in range(4) for b in range(3) if (u + b) % 2})
    )
    blocked_t = torch.tensor([1 * 256 + 1])
    projection = dataclasses.replace(
        term.projection, boundaries=Boundaries(first, blocked_s, blocked_t)
    )
    before_s = torch.randint(0, 5, (c,), generator=gen)
    before_t = torch.randint(0, 3, (c,), generator=gen)
    first_t = tg.topk_ids.view(c, depth, -1)[:, 0, 0].long()  # the top entry: spared
    before = torch.stack([before_s, before_t, first_t], -1)
    before[0] = -1
    return dataclasses.replace(term, projection=projection, before=before)


@pytest.mark.parametrize("loss", DISTRIBUTION_LOSSES)
def test_the_loss_conditions_the_kd_rows_at_depth_one(loss):
    hidden, weight, labels, (term,) = terms_for(loss, seed=2)
    conditioned = with_table(term, 1, seed=2)
    want_term = conditioned_by_hand(conditioned, 1)
    plain = run("reference", hidden, weight, labels, [term])[0]
    want, want_h, want_w, _ = run("reference", hidden, weight, labels, [want_term])
    assert abs(want.item() - plain.item()) > 1e-6 * abs(plain.item())  # some rows lost mass
    for backend in ("chunked", "reference"):
        got, got_h, got_w, _ = run(backend, hidden, weight, labels, [conditioned])
        assert torch.isfinite(got)
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())
        assert rel(got_h, want_h) < 1e-10 and rel(got_w, want_w) < 1e-10


@pytest.mark.parametrize("past_end", [False, True])
def test_the_lookahead_target_conditions_its_kd_rows_only(past_end):
    hidden, weight, labels, term = plan_problem(3, "forward_kl", depth=3, past_end=past_end)
    conditioned = with_table(term, 3, seed=3)
    want_term = conditioned_by_hand(conditioned, 3)
    rows_after = term.targets.topk_logprobs.view(term.chunks.shape[0], 3, -1)[:, 1:]
    assert torch.equal(
        want_term.targets.topk_logprobs.view(term.chunks.shape[0], 3, -1)[:, 1:], rows_after
    )
    plain = run("reference", hidden, weight, labels, [term])[0]
    want = run("reference", hidden, weight, labels, [want_term])[0]
    assert abs(want.item() - plain.item()) > 1e-6 * abs(plain.item())
    for backend in ("chunked", "reference"):
        got = run(backend, hidden, weight, labels, [conditioned])[0]
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())


def test_blocked_keys_need_a_frequent_token_and_an_expected_byte():
    """Byte 0 starts most tokens; token 1 is followed by byte-1 tokens only, MIN_COUNT times;
    token 2 by byte-2 tokens only, too rarely to say; byte 2 is too rare to be expected after 1.
    Pairs count within a sequence only."""
    first = np.array([0, 1, 2, 3, 0, 0])
    seqs = [[4, 5] * 4 * MIN_COUNT, [1] * (MIN_COUNT + 1), [2] * (MIN_COUNT // 4 + 1), [5, 3]]
    got, seen = blocked_keys([np.array(x) for x in seqs], first)
    assert (seen[1], seen[2], seen[4], seen[5]) == (MIN_COUNT, MIN_COUNT // 4, *[4 * MIN_COUNT] * 2)
    rate = np.array([8 * MIN_COUNT - 1, MIN_COUNT, MIN_COUNT // 4, 1]) / sum(map(len, seqs))
    assert MIN_COUNT * rate[0] >= EXPECTED_COUNT > MIN_COUNT * rate[2]
    assert 1 * 256 + 0 in got  # expected about 85 times after token 1, never seen
    assert 1 * 256 + 1 not in got  # seen
    assert 1 * 256 + 2 not in got and 1 * 256 + 3 not in got  # bytes too rare to expect
    assert not any(k // 256 == 2 for k in got)  # token 2 is seen too rarely
    assert blocked_keys([np.array([1])], first)[0].size == 0


def test_llama3_rules_out_a_line_end_after_its_line_end_and_mistral_does_not(tokenizer_dir):
    from crossdistill.models import load_tokenizer
    from crossdistill.train.boundaries import build_boundaries

    tok_s = load_tokenizer(str(tokenizer_dir("llama3")))
    tok_t = load_tokenizer(str(tokenizer_dir("mistral")))
    # a line end after a word is a token of its own, `);` swallows the line ends after it
    lines = ["x = f(a);", "", "y = g(b);", "if (y) {", "  return y", "}", "let z = x", ""] * 40
    texts = ["\n".join(lines[i:] + lines[:i]) for i in range(0, 320, 8)]
    table, line = build_boundaries(tok_s, tok_t, texts, len(tok_s), len(tok_t))
    semi_nl = tok_s.convert_tokens_to_ids(");Ċ")
    nl_t = tok_t.convert_tokens_to_ids("<0x0A>")
    assert table.first_byte[nl_t] == 10
    assert semi_nl * 256 + 10 in table.blocked_s.tolist()
    assert nl_t * 256 + 10 not in table.blocked_t.tolist()
    dropped = table.dropped(
        torch.tensor([semi_nl]), torch.tensor([nl_t]), torch.tensor([-1]), torch.tensor([[nl_t]])
    )
    assert dropped.tolist() == [[True]]
    assert re.search(r"rules out [\d,]+ next first bytes after [\d,]+ of its tokens", line)
    assert "a line end never after ' =', 'y', ')', ..." in line  # the most frequent three


def test_identical_tokenizers_get_no_table(tokenizer_dir, tmp_path):
    from crossdistill.config import DataConfig, TeacherConfig
    from crossdistill.models import load_tokenizer
    from crossdistill.train.build import build_projection_for

    tok = load_tokenizer(str(tokenizer_dir("llama3")))
    tcfg = TeacherConfig(path="unused", target="first_piece", boundary="condition")
    proj = build_projection_for(tcfg, tok, tok, len(tok), len(tok), "cpu", data=DataConfig())
    assert proj.boundaries is None
    tok_t = load_tokenizer(str(tokenizer_dir("mistral")))
    with pytest.raises(UserError, match="boundary: condition counts what the student's tokens"):
        build_projection_for(tcfg, tok_t, tok, len(tok_t), len(tok), "cpu")


def test_a_run_conditions_and_says_what_it_counted(tmp_path, tokenizer_dir, capsys):
    """`train()` in one process on the harness's tokenizers (Llama-2 student, GPT-2 teacher),
    its texts 30 times over so that tokens are seen often enough to rule bytes out: a finite
    first KD value, not the one of the same run under `boundary: ignore`, and the log line of
    the counts."""
    import json

    from tests.distributed import _harness as h

    kd, logs = {}, {}
    for boundary in ("ignore", "condition"):
        cfg = h.probe_config(tmp_path / boundary, tokenizer_dir)
        with open(cfg.data.train[0], "w") as f:
            for i, text in enumerate(h.TEXTS * 30):
                f.write(json.dumps({"text": f"{i}: {text}"}) + "\n")
        for teacher in cfg.teachers:
            teacher.boundary = boundary
        kd[boundary] = h.first_kd(cfg)
        logs[boundary] = "".join(capsys.readouterr())
    assert all(math.isfinite(v) for v in kd.values())
    assert abs(kd["condition"] - kd["ignore"]) > 1e-6 * kd["ignore"]
    counted = re.search(r"rules out ([\d,]+) next first bytes", logs["condition"])
    assert counted and int(counted[1].replace(",", "")) > 0
    assert "next first bytes after" not in logs["ignore"]


def test_a_term_without_chunks_passes_through():
    """A micro-batch whose text gives a teacher no chunk (a padded validation batch) has nothing
    to condition."""
    from crossdistill.losses.plan import _conditioned

    hidden, weight, labels, (term,) = terms_for("forward_kl", seed=4)
    term = with_table(term, 1, seed=4)
    tg = term.targets
    empty = dataclasses.replace(
        term,
        chunks=term.chunks[:0],
        before=term.before[:0],
        targets=dataclasses.replace(
            tg,
            topk_ids=tg.topk_ids[:0],
            topk_logprobs=tg.topk_logprobs[:0],
            tail_logprob=tg.tail_logprob[:0],
        ),
    )
    assert _conditioned(empty) is empty

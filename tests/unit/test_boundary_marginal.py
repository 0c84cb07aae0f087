"""The KD position's top-k taking in the teacher's continuations past its own last token
(`teachers.N.boundary: marginal`, `losses.boundaries`).

- `marginalise` against a plain Python-float reference on fresh random rows: the KD row scaled by
  the token's share of the row before, each continuation added under the id that starts its
  rest (into the row's entry of that id, or a slot of its own), the `MAX_EXTENSIONS` largest
  only, the smallest entries past K and the continuations past the largest to the tail, the
  text's own token kept, each row's total one; a row without a continuation, or whose token's
  probability is unknown, bit for bit;
- the table: which ids spell another and more, and the id that starts the rest, on hand-made
  pieces and on Mistral's tokenizer; `extension_ids`; `dropped` no longer spares what the
  teacher's token rules out;
- the rows a target reads: one more per chunk, the row before the KD row;
- the loss of a term that reads those rows against the same term whose KD rows were
  marginalised and conditioned by the plain references beforehand, at depth 1 (every projected
  loss) and under the lookahead target (depth 3), chunked and full-logits; the row before read
  only where it is of the chunk's sequence;
- a `train()` run under `marginal` whose KD value is not the one under `condition`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from crossdistill.config import DISTRIBUTION_LOSSES
from crossdistill.losses.boundaries import MAX_EXTENSIONS, Boundaries, marginalise
from crossdistill.losses.targets import target_rows
from tests.unit.test_boundaries import plain_condition, with_table
from tests.unit.test_lookahead_prefix import plan_problem
from tests.unit.test_losses_student import rel, run, terms_for

F64 = torch.float64
NEG = -math.inf


def plain_marginalise(ids, lp, tail, ext, prior_lp, before_lp, first_t, m=MAX_EXTENSIONS):
    """Row by row in Python floats: `(ids, log-probs, tail)` lists per row."""
    out = []
    k = ids.shape[1]
    for r in range(ids.shape[0]):
        row_ids, row_lp, row_tail = ids[r].tolist(), lp[r].tolist(), tail[r].item()
        a = before_lp[r].item()
        conts = [(e, v) for e, v in zip(ext[r].tolist(), prior_lp[r].tolist()) if e >= 0]
        conts = [(e, v) for e, v in conts if v > NEG]
        if not conts or a == NEG:
            out.append((row_ids, row_lp, row_tail))
            continue
        z = math.log(math.exp(a) + sum(math.exp(v) for _, v in conts))
        conts.sort(key=lambda c: -c[1])
        probs: dict[int, float] = {}
        for i, v in zip(row_ids, row_lp):
            probs[i] = probs.get(i, 0.0) + math.exp(v + a - z)
        for e, v in conts[: min(m, k)]:
            probs[e] = probs.get(e, 0.0) + math.exp(v - z)
        rest = math.exp(row_tail + a - z) + sum(math.exp(v - z) for _, v in conts[min(m, k) :])
        own = int(first_t[r])
        ranked = sorted(probs.items(), key=lambda kv: (kv[0] != own, -kv[1]))
        kept, gone = ranked[:k], ranked[k:]
        rest += sum(p for _, p in gone)
        kept.sort(key=lambda kv: -kv[1])
        out.append(([i for i, _ in kept], [math.log(p) for _, p in kept], math.log(rest)))
    return out


def random_marginal_rows(seed: int, rows: int = 60, k: int = 12, vocab: int = 40):
    """KD rows, the rows before them with their continuations (some ids the KD row has, some
    repeated, rows with more than `MAX_EXTENSIONS`), the token's log-prob and the text's own
    first token."""
    gen = torch.Generator().manual_seed(seed)

    def top(n):
        logp = torch.log_softmax(torch.randn(n, vocab, generator=gen, dtype=F64) * 2, -1)
        lp, ids = logp.topk(k, -1)
        return ids, lp, torch.log1p(-lp.exp().sum(-1).clamp(max=1 - 1e-12))

    ids, lp, tail = top(rows)
    _, prior_lp, _ = top(rows)
    ext = torch.randint(0, vocab, (rows, k), generator=gen)
    ext[torch.rand(rows, k, generator=gen) < 0.5] = -1
    ext[:10, :] = torch.randint(0, vocab, (10, k), generator=gen)  # more than MAX_EXTENSIONS
    ext[10:20, :3] = ids[10:20, :3]  # ids the KD row has
    ext[20:25, :] = -1  # rows with no continuation
    before_lp = torch.log(torch.rand(rows, generator=gen, dtype=F64))
    before_lp[25:28] = NEG  # the token's probability unknown
    first_t = ids[torch.arange(rows), torch.randint(0, k, (rows,), generator=gen)]
    return ids, lp, tail, ext, prior_lp, before_lp, first_t


@pytest.mark.parametrize("seed", range(4))
def test_marginalise_matches_the_reference(seed):
    rows = random_marginal_rows(seed)
    got_ids, got_lp, got_tail = marginalise(*rows)
    want = plain_marginalise(*rows)
    for r, (w_ids, w_lp, w_tail) in enumerate(want):
        assert got_ids[r].tolist() == w_ids, r
        np.testing.assert_allclose(got_lp[r].numpy(), w_lp, rtol=0, atol=1e-13)
        assert abs(got_tail[r].item() - w_tail) < 1e-12
        assert int(rows[6][r]) in got_ids[r].tolist()  # the text's own token stays
    total = got_lp.exp().sum(-1) + got_tail.exp()
    np.testing.assert_allclose(total.numpy(), 1.0, rtol=0, atol=1e-12)
    assert not torch.isnan(got_lp).any() and not torch.isnan(got_tail).any()
    # rows 0-9 hold more continuations than MAX_EXTENSIONS (the rest to the tail); some rows
    # gained an id
    assert ((rows[3][:10] >= 0).sum(-1) > MAX_EXTENSIONS).all()
    assert any(
        set(got_ids[r].tolist()) != set(rows[0][r].tolist()) for r in range(rows[0].shape[0])
    )


def test_a_row_without_a_continuation_comes_back_bit_for_bit():
    ids, lp, tail, ext, prior_lp, before_lp, first_t = random_marginal_rows(9)
    got = marginalise(ids, lp, tail, torch.full_like(ext, -1), prior_lp, before_lp, first_t)
    assert torch.equal(got[0], ids) and torch.equal(got[1], lp) and torch.equal(got[2], tail)
    unknown = torch.full_like(before_lp, NEG)
    got = marginalise(ids, lp, tail, ext, prior_lp, unknown, first_t)
    assert torch.equal(got[0], ids) and torch.equal(got[1], lp) and torch.equal(got[2], tail)


def test_the_table_pairs_a_token_with_its_longer_spellings(tokenizer_dir):
    from crossdistill.alignment.token_bytes import TokenBytes
    from crossdistill.models import load_tokenizer
    from crossdistill.train.boundaries import extension_table

    pieces = [b"E", b"EN", b"ENT", b"ENTRY", b"R", b"RY", b"X", b"", b"Y"]
    table = TokenBytes.from_pieces(pieces, special={7: "<s>"})
    keys, starts = extension_table(table, rows=10)
    got = {(int(key) // 10, int(key) % 10): int(r) for key, r in zip(keys, starts)}
    # ENTRY past ENT starts with RY (the longest id), RY past R with Y; EN past E and ENT past
    # E or EN have no id for the rest's start (N, T), so no pair
    assert got == {(2, 3): 5, (4, 5): 8}
    assert np.all(np.diff(keys) > 0)

    tb = TokenBytes.from_tokenizer(load_tokenizer(str(tokenizer_dir("mistral"))))
    keys, starts = extension_table(tb, tb.vocab_size)
    pieces = tb.pieces()
    ids = {p: i for i, p in reversed(list(enumerate(pieces))) if p}
    at = np.searchsorted(keys, ids[b" the"] * tb.vocab_size + ids[b" there"])
    assert pieces[int(starts[at])] == b"re"
    t, v = keys // tb.vocab_size, keys % tb.vocab_size
    assert all(pieces[int(b)].startswith(pieces[int(a)]) for a, b in zip(t[::997], v[::997]))
    # a byte-fallback piece starts a rest only where no other id spells that byte
    plain = {p for i, p in enumerate(pieces) if p and not tb.byte_piece[i]}
    assert not any(pieces[int(r)] in plain for r in starts[tb.byte_piece[starts]])


def test_extension_ids_read_the_table():
    first = torch.tensor([97, 98, 99, 97, -1, 98])
    keys = torch.tensor(sorted([1 * 6 + 3, 1 * 6 + 5, 2 * 6 + 0]))
    starts = torch.tensor([0, 1, 2])  # in key order: (1,3) -> 0, (1,5) -> 1, (2,0) -> 2
    b = Boundaries(first, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long),
                   keys, starts)  # fmt: skip
    ids = torch.tensor([[3, 5, 0], [0, 3, 5], [3, 5, 0]])
    got = b.extension_ids(torch.tensor([1, 2, -1]), ids).tolist()
    assert got == [[0, 1, -1], [2, -1, -1], [-1, -1, -1]]


def test_target_rows_add_the_row_before_the_kd_row():
    chunks = torch.tensor([[0, 1, 0, 1], [1, 2, 1, 3], [2, 4, 3, 4], [4, 5, 4, 6]])
    assert target_rows(chunks, prior=True).view(-1, 2).tolist() == [
        [-1, -1], [0, -1], [2, 1], [3, 2]
    ]  # fmt: skip
    got = target_rows(chunks, 2, prior=True).view(-1, 3).tolist()
    assert got == [[-1, -1, -1], [0, 1, -1], [2, -1, 1], [3, 4, 2]]


def with_marginal_table(term, depth: int, seed: int):
    """`term` (D rows per chunk) with `test_boundaries.with_table`'s table and tokens before
    each chunk, plus a table of continuations, student joins, and one more row per chunk last:
    the row before its KD row, at random, holding the teacher token before in some rows."""
    from crossdistill.losses.projection import Joins

    term = with_table(term, depth, seed)
    gen = torch.Generator().manual_seed(700 + seed)
    tg, c = term.targets, term.chunks.shape[0]
    k = tg.topk_ids.shape[-1]
    bounds = term.projection.boundaries
    v_t = bounds.first_byte.shape[0]
    pairs = {}
    for t in range(3):
        for v in torch.randperm(v_t, generator=gen)[: v_t // 2].tolist():
            pairs[t * v_t + v] = int(torch.randint(0, v_t, (1,), generator=gen))
    keys = torch.tensor(sorted(pairs))
    bounds = dataclasses.replace(
        bounds, extend_keys=keys, extend_ids=torch.tensor([pairs[int(x)] for x in keys])
    )
    v_s = 5
    joins = Joins.from_rows(
        torch.tensor([[u, x, 0] for u in range(v_s) for x in range(v_t) if (u * 3 + x) % 4 == 0]),
        v_t,
        v_s,
    )
    projection = dataclasses.replace(term.projection, boundaries=bounds, joins=joins)
    logp = torch.log_softmax(torch.randn(c, v_t, generator=gen, dtype=F64) * 2, -1)
    before = term.before.clone()
    # the teacher token before in the row's top-k in about half of the rows
    top_lp, top_ids = logp.topk(k, -1)
    half = torch.rand(c, generator=gen) < 0.5
    before[:, 1] = torch.where(half, top_ids[:, k // 2], before[:, 1]).clamp(max=2)
    before[0] = -1
    prior_tail = torch.log1p(-top_lp.exp().sum(-1).clamp(max=1 - 1e-12))

    def add(x, last):
        return torch.cat([x.view(c, depth, *x.shape[1:]), last.unsqueeze(1).to(x.dtype)], 1)

    targets = dataclasses.replace(
        tg,
        topk_ids=add(tg.topk_ids, top_ids).flatten(0, 1),
        topk_logprobs=add(tg.topk_logprobs, top_lp).flatten(0, 1),
        tail_logprob=add(tg.tail_logprob, prior_tail).flatten(),
        depth=depth + 1,
    )
    return dataclasses.replace(
        term, projection=projection, before=before, targets=targets, prior=True
    )


def marginalised_by_hand(term, depth: int):
    """`term` without the table or the extra row, its KD rows marginalised and conditioned
    beforehand by the plain references, its inputs read in Python."""
    tg, c = term.targets, term.chunks.shape[0]
    b, before, joins = term.projection.boundaries, term.before, term.projection.joins
    ids = tg.topk_ids.view(c, depth + 1, -1).clone()
    lp = tg.topk_logprobs.view(c, depth + 1, -1).clone()
    tail = tg.tail_logprob.view(c, depth + 1).clone()
    n = b.first_byte.shape[0]
    table = dict(zip(b.extend_keys.tolist(), b.extend_ids.tolist()))
    blocked = set(b.blocked_s.tolist())
    joined = {(int(a), int(x)) for a, x in zip(joins.keys // joins.num_teacher,
                                               joins.keys % joins.num_teacher)}  # fmt: skip
    ext = torch.full(ids[:, -1].shape, -1, dtype=torch.long)
    before_lp = torch.full((c,), NEG, dtype=F64)
    for r in range(c):
        u, t, _ = before[r].tolist()
        row = int(term.chunks[r, 2]) - 2
        if row < 0 or t < 0 or not bool(tg.next_valid[row]):
            continue
        prior = ids[r, -1].tolist()
        before_lp[r] = (lp[r, -1, prior.index(t)] if t in prior else tg.next_logprobs[row]).item()
        for j, v in enumerate(prior):
            x = table.get(t * n + v, -1)
            first = int(b.first_byte[x]) if x >= 0 else -1
            if x >= 0 and u >= 0 and (u * 256 + first) not in blocked and (u, x) not in joined:
                ext[r, j] = x
    merged = plain_marginalise(ids[:, 0], lp[:, 0], tail[:, 0], ext, lp[:, -1], before_lp,
                               before[:, 2])  # fmt: skip
    kd_ids = torch.tensor([m[0] for m in merged])
    kd_lp = torch.tensor([m[1] for m in merged], dtype=F64)
    kd_tail = torch.tensor([m[2] for m in merged], dtype=F64)
    dropped = b.dropped(before[:, 0], before[:, 1], before[:, 2], kd_ids)
    for r, (i, v, t) in enumerate(plain_condition(kd_ids, kd_lp, kd_tail, dropped)):
        ids[r, 0], lp[r, 0], tail[r, 0] = torch.tensor(i), torch.tensor(v, dtype=F64), t
    targets = dataclasses.replace(
        tg,
        topk_ids=ids[:, :depth].flatten(0, 1).to(tg.topk_ids.dtype),
        topk_logprobs=lp[:, :depth].flatten(0, 1),
        tail_logprob=tail[:, :depth].flatten(),
        depth=depth,
    )
    projection = dataclasses.replace(term.projection, boundaries=None)
    changed = int((ext >= 0).any(-1).sum())
    return dataclasses.replace(
        term, targets=targets, projection=projection, before=None, prior=False
    ), changed


def _without_prior(term, depth: int):
    """`term` read under `condition`: no table of continuations, no extra row."""
    tg, c = term.targets, term.chunks.shape[0]
    bounds = dataclasses.replace(term.projection.boundaries, extend_keys=None, extend_ids=None)
    targets = dataclasses.replace(
        tg,
        topk_ids=tg.topk_ids.view(c, depth + 1, -1)[:, :depth].flatten(0, 1),
        topk_logprobs=tg.topk_logprobs.view(c, depth + 1, -1)[:, :depth].flatten(0, 1),
        tail_logprob=tg.tail_logprob.view(c, depth + 1)[:, :depth].flatten(),
        depth=depth,
    )
    projection = dataclasses.replace(term.projection, boundaries=bounds)
    return dataclasses.replace(term, targets=targets, projection=projection, prior=False)


@pytest.mark.parametrize("loss", DISTRIBUTION_LOSSES)
def test_the_loss_marginalises_the_kd_rows_at_depth_one(loss):
    hidden, weight, labels, (term,) = terms_for(loss, seed=5)
    marginal = with_marginal_table(term, 1, seed=5)
    want_term, changed = marginalised_by_hand(marginal, 1)
    assert changed >= 3  # rows that took continuations in
    want, want_h, want_w, _ = run("reference", hidden, weight, labels, [want_term])
    under_condition = run("reference", hidden, weight, labels, [_without_prior(marginal, 1)])[0]
    assert abs(want.item() - under_condition.item()) > 1e-6 * abs(want.item())
    for backend in ("chunked", "reference"):
        got, got_h, got_w, _ = run(backend, hidden, weight, labels, [marginal])
        assert torch.isfinite(got)
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())
        assert rel(got_h, want_h) < 1e-10 and rel(got_w, want_w) < 1e-10


@pytest.mark.parametrize("past_end", [False, True])
def test_the_lookahead_target_marginalises_its_kd_rows_only(past_end):
    hidden, weight, labels, term = plan_problem(4, "forward_kl", depth=3, past_end=past_end)
    marginal = with_marginal_table(term, 3, seed=4)
    want_term, changed = marginalised_by_hand(marginal, 3)
    assert changed >= 3
    c = term.chunks.shape[0]
    assert torch.equal(
        want_term.targets.topk_logprobs.view(c, 3, -1)[:, 1:],
        term.targets.topk_logprobs.view(c, 3, -1)[:, 1:],
    )
    want = run("reference", hidden, weight, labels, [want_term])[0]
    under_condition = run("reference", hidden, weight, labels, [_without_prior(marginal, 3)])[0]
    assert abs(want.item() - under_condition.item()) > 1e-6 * abs(want.item())
    for backend in ("chunked", "reference"):
        got = run(backend, hidden, weight, labels, [marginal])[0]
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item())


def test_a_term_reads_the_row_before_exactly_under_marginal():
    hidden, weight, labels, (term,) = terms_for("forward_kl", seed=6)
    marginal = with_marginal_table(term, 1, seed=6)
    with pytest.raises(ValueError, match="reads the row before each chunk"):
        dataclasses.replace(marginal, prior=False).check()
    with pytest.raises(ValueError, match="reads the row before each chunk"):
        dataclasses.replace(_without_prior(marginal, 1), prior=True).check()

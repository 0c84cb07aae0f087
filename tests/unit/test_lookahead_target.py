"""The lookahead target (`teachers.N.target: lookahead`): at a chunk of one student token over
several teacher tokens, the teacher's top-k at its later positions along the observed path
give each alternative continuation to the student token that spells it.

- `project_lookahead` against a reference written out plainly here on toy byte vocabularies
  (per chunk, a walk down the observed path with dictionaries of bytes, in float64), at depth
  limits that cut paths short and that do not, with observed tokens outside the top-k;
- the plan end to end: targets from `teacher_targets` at `target_rows`, the chunk's teacher
  tokens from `chunk_tokens`, the buckets per student row against the same reference;
- what it reduces to: the first-piece target where every chunk has one teacher token, the
  context target at depth 1; nothing is lost (buckets and tail sum to 1);
- the join table on real tokenizers (Llama-3 student, Llama-2 teacher);
- a `train()` run, and the refusal of a loss without a projected target.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from crossdistill.alignment.projection import joins_of, own_joins_of
from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.losses import (
    Joins,
    KDTerm,
    VocabProjection,
    chunk_tokens,
    kd_count,
    project_topk,
    target_rows,
    teacher_targets,
)
from crossdistill.losses.lookahead import project_lookahead
from crossdistill.losses.plan import build_plan
from crossdistill.losses.projection import Buckets, Continuation
from tests.unit.test_losses_targets import _from_buckets

F64 = torch.float64
NEG_INF = float("-inf")
TAIL = "tail"


class Toy:
    """Toy byte vocabularies over `abc`: the student has every string of 1–3 letters but a
    random fifth of those of 2–3 (so some joins are missing), the teacher the letters and a
    few pairs. The projection is the first piece (the longest student token the teacher
    token's bytes start with) with exact matches flagged."""

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        words = [bytes(w) for n in (1, 2, 3) for w in itertools.product(b"abc", repeat=n)]
        drop = torch.rand(len(words), generator=gen) < 0.2
        self.student = [w for w, d in zip(words, drop.tolist()) if len(w) == 1 or not d]
        pairs = [bytes(w) for w in itertools.product(b"abc", repeat=2)]
        pick = torch.randperm(len(pairs), generator=gen)[:4].tolist()
        self.teacher = [b"a", b"b", b"c"] + [pairs[i] for i in pick]
        self.s_id = {w: i for i, w in enumerate(self.student)}
        first = []
        for w in self.teacher:
            cut = max(n for n in range(1, len(w) + 1) if w[:n] in self.s_id)
            first.append(self.s_id[w[:cut]])
        exact = torch.tensor([w in self.s_id for w in self.teacher])
        self.proj = VocabProjection.from_first_piece(
            torch.tensor(first), len(self.student), exact=exact
        )
        rows = joins_of(TokenBytes.from_pieces(self.teacher), TokenBytes.from_pieces(self.student))
        self.proj.joins = Joins.from_rows(
            torch.from_numpy(rows), len(self.teacher), len(self.student)
        )

    def split(self, word: bytes, gen) -> list[int]:
        """A random teacher tokenisation of `word`."""
        out, at = [], 0
        while at < len(word):
            fits = [t for t, w in enumerate(self.teacher) if word.startswith(w, at)]
            t = fits[int(torch.randint(len(fits), (1,), generator=gen))]
            out.append(t)
            at += len(self.teacher[t])
        return out


def reference(
    toy: Toy,
    logp: list[list[float]],
    k: int,
    obs: list[int],
    label: int,
    depth: int,
    past_end: bool = False,
    skip: frozenset[int] = frozenset(),
    canonical: bool = False,
    longest: bool = False,
):
    """The target of one chunk, walked plainly: `logp[d]` the teacher's full log-probs at depth
    d (τ = 1), its top-k the k largest; `obs` the chunk's teacher tokens; `label` the student's
    token (−1: none); `past_end`: the `lookahead_end` target (`logp[len(obs)]`, where there is
    one, is the teacher's position after the chunk); `skip`: teacher ids other than `obs[0]`
    whose depth-0 mass is left out (the caller places it); `canonical`: past the end, a
    continuation whose bytes with the chunk's last teacher token's are a teacher token does not
    move (`past_end: canonical`); `longest`: an alternative past depth 0 goes to the longest
    student token spelling the prefix then the start of it (`deep_alternatives: longest`)."""
    out: dict = defaultdict(float)
    top = [sorted(range(len(row)), key=lambda x: -row[x])[:k] for row in logp]
    p = [[math.exp(v) for v in row] for row in logp]

    def piece(x: int, mass: float) -> None:
        out[int(toy.proj.first_piece[x])] += mass

    def rest(d: int) -> float:
        return math.exp(sum(logp[e][obs[e]] for e in range(d, len(obs))))

    t0, m = obs[0], len(obs)
    word0 = toy.teacher[t0]
    active = m > 1 and label >= 0
    expand = active and depth > 1 and word0 in toy.s_id and t0 in top[0]
    one = past_end and m == 1 and depth > 1 and toy.s_id.get(word0) == label and t0 in top[0]
    for x in top[0]:
        if (x == t0 and (expand or one)) or (x != t0 and x in skip):
            continue
        if x == t0 and active:  # the context target's split
            out[label] += p[0][x] * rest(1)
            piece(x, p[0][x] * (1 - rest(1)))
        else:
            piece(x, p[0][x])
    out[TAIL] += 1 - sum(p[0][x] for x in top[0])

    def end(d: int, mass: float) -> None:
        """The mass that reached the label; past the end, the continuations it joins."""
        if not past_end or d >= depth:
            out[label] += mass
            return
        moved = 0.0
        for x in top[d]:
            longer = toy.s_id.get(toy.student[label] + toy.teacher[x])
            if canonical and toy.teacher[obs[-1]] + toy.teacher[x] in toy.teacher:
                continue  # a split the teacher's tokenizer never writes
            if longer is not None:
                out[longer] += mass * p[d][x]
                moved += p[d][x]
        out[label] += mass * (1 - moved)

    def walk(d: int, mass: float, prefix: bytes) -> None:
        a = toy.s_id[prefix]
        for x in top[d]:
            if x != obs[d]:
                word = toy.teacher[x]
                cuts = range(len(word), 0, -1) if longest else [len(word)]
                to = next(
                    (toy.s_id[w] for w in (prefix + word[:n] for n in cuts) if w in toy.s_id), a
                )
                out[to] += mass * p[d][x]
        out[TAIL] += mass * (1 - sum(p[d][x] for x in top[d]))
        if obs[d] not in top[d]:
            return
        mass *= p[d][obs[d]]
        if d + 1 == m:
            end(d + 1, mass)
            return
        nxt = prefix + toy.teacher[obs[d]]
        if d + 1 < depth and nxt in toy.s_id:
            walk(d + 1, mass, nxt)
            return
        out[label] += mass * rest(d + 1)
        out[toy.s_id.get(nxt, a)] += mass * (1 - rest(d + 1))

    if expand:
        walk(1, p[0][t0], word0)
    if one:
        end(1, p[0][t0])
    return out


def dense(out: dict, num_student: int) -> torch.Tensor:
    row = torch.zeros(num_student + 1, dtype=F64)
    for key, v in out.items():
        row[num_student if key == TAIL else key] += v
    return row


def toy_chunks(toy: Toy, seed: int, count: int, depth: int):
    """`count` chunks of one student token each, with random teacher log-probs at `depth`
    positions; about one in five a single teacher token."""
    gen = torch.Generator().manual_seed(1000 + seed)
    rows = []
    for _ in range(count):
        word = toy.student[int(torch.randint(len(toy.student), (1,), generator=gen))]
        obs = toy.split(word, gen)
        logp = torch.randn(depth, len(toy.teacher), generator=gen, dtype=F64) * 2
        rows.append((toy.s_id[word], obs, logp.log_softmax(-1)))
    return rows


def stacked(rows, depth: int, k: int):
    """The per-chunk inputs `project_lookahead` takes, from `toy_chunks` rows."""
    logp = torch.stack([lp for _, _, lp in rows])  # [C, D, V_t]
    top, ids = logp.topk(k, -1)
    tail = logp.scatter(-1, ids, NEG_INF).logsumexp(-1)
    obs = torch.tensor([(o + [-1] * depth)[:depth] for _, o, _ in rows])
    length = torch.tensor([len(o) for _, o, _ in rows])
    rest = torch.zeros(len(rows), depth + 1, dtype=F64)
    for c, (_, o, lp) in enumerate(rows):
        for d in range(depth + 1):
            rest[c, d] = sum(float(lp[e, o[e]]) for e in range(d, min(len(o), depth)))
    label = torch.tensor([w for w, _, _ in rows])
    cont = Continuation(obs[:, 0], label, rest[:, 1], length > 1)
    return ids, top, tail, obs, length, rest, cont


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("past_end", [False, True])
def test_matches_plain_reference(seed, depth, past_end):
    toy, k = Toy(seed), 4
    rows = [r for r in toy_chunks(toy, seed, 120, depth) if len(r[1]) <= depth]
    ids, top, tail, obs, length, rest, cont = stacked(rows, depth, k)
    single = torch.ones(len(rows), dtype=torch.bool) if past_end else None
    got = _from_buckets(
        project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single),
        len(toy.student),
    )
    for c, (label, o, lp) in enumerate(rows):
        want = reference(toy, lp.tolist(), k, o, label, depth, past_end)
        torch.testing.assert_close(got[c], dense(want, len(toy.student)), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(rows), dtype=F64))
    assert not got.isnan().any() and (got >= -1e-15).all()
    first = _from_buckets(
        project_topk(ids[:, 0], top[:, 0], tail[:, 0], toy.proj, cont), len(toy.student)
    )
    changed = (got - first).abs().sum(-1) > 1e-12
    assert 8 < int(changed.sum()) < len(rows)  # the draw exercises both cases
    if past_end:  # chunks of one teacher token change too, where the label has joins
        one = length == 1
        assert 3 < int((changed & one).sum()) < int(one.sum())
        plain = _from_buckets(
            project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest), len(toy.student)
        )
        assert ((got - plain).abs().sum(-1) > 1e-12).any()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [2, 3])
def test_canonical_end_step_matches_plain_reference(seed, depth):
    """`past_end: canonical`: past the end, a continuation x that the teacher's tokenizer
    joins with the chunk's last teacher token into one of its tokens stays with the label."""
    toy, k = Toy(seed), 4
    rows = [r for r in toy_chunks(toy, seed, 120, depth) if len(r[1]) <= depth]
    ids, top, tail, obs, length, rest, cont = stacked(rows, depth, k)
    single = torch.ones(len(rows), dtype=torch.bool)
    every = _from_buckets(
        project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single),
        len(toy.student),
    )
    own = torch.from_numpy(own_joins_of(TokenBytes.from_pieces(toy.teacher)))
    toy.proj.teacher_joins = Joins.from_rows(own, len(toy.teacher), len(toy.teacher))
    got = _from_buckets(
        project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single),
        len(toy.student),
    )
    for c, (label, o, lp) in enumerate(rows):
        want = reference(toy, lp.tolist(), k, o, label, depth, True, canonical=True)
        torch.testing.assert_close(got[c], dense(want, len(toy.student)), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(rows), dtype=F64))
    changed = (got - every).abs().sum(-1) > 1e-12
    assert 0 < int(changed.sum()) < len(rows)  # the draw has splits of both kinds


def test_canonical_end_step_moves_nothing_with_one_vocabulary():
    """With the student's vocabulary on both sides every longer token that spells the label
    then x is a token of the teacher's too, so `past_end: canonical` moves nothing: the end
    step gives the target without it."""
    toy, k, depth = Toy(0), 8, 2
    toy.teacher = list(toy.student)
    n = len(toy.student)
    toy.proj = VocabProjection.from_first_piece(
        torch.arange(n), n, exact=torch.ones(n, dtype=torch.bool)
    )
    table = TokenBytes.from_pieces(toy.student)
    toy.proj.joins = Joins.from_rows(torch.from_numpy(joins_of(table, table)), n, n)
    rows = [r for r in toy_chunks(toy, 0, 400, depth) if len(r[1]) == 1]
    ids, top, tail, obs, length, rest, cont = stacked(rows, depth, k)
    single = torch.ones(len(rows), dtype=torch.bool)
    every = project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single)
    assert (
        _from_buckets(every, n)
        - _from_buckets(project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest), n)
    ).abs().sum() > 1e-6  # every split moves: a teacher that splits what it never writes
    toy.proj.teacher_joins = Joins.from_rows(torch.from_numpy(own_joins_of(table)), n, n)
    got = project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single)
    plain = project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest)
    torch.testing.assert_close(_from_buckets(got, n), _from_buckets(plain, n), rtol=0, atol=0)


def test_depth_limit_and_missing_prefixes_split_like_the_context_target():
    """Paths longer than the depth limit: the rest of the chunk's mass splits at the limit."""
    toy, k, depth = Toy(7), 5, 2
    rows = [r for r in toy_chunks(toy, 7, 80, 3) if len(r[1]) == 3]
    assert len(rows) > 5
    cut = [(w, o, lp[:depth]) for w, o, lp in rows]
    ids, top, tail, obs, length, _, cont = stacked(cut, depth, k)
    rest = torch.zeros(len(rows), depth + 1, dtype=F64)
    for c, (_, o, lp) in enumerate(rows):
        for d in range(depth + 1):
            rest[c, d] = sum(float(lp[e, o[e]]) for e in range(d, len(o)))
    cont.log_rest = rest[:, 1]
    got = _from_buckets(
        project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest), len(toy.student)
    )
    for c, (label, o, lp) in enumerate(rows):
        want = dense(reference(toy, lp.tolist(), k, o, label, depth), len(toy.student))
        torch.testing.assert_close(got[c], want, rtol=1e-12, atol=1e-14)


def test_reduces_to_the_first_piece_and_context_targets():
    toy, k = Toy(3), 4
    rows = toy_chunks(toy, 3, 50, 3)
    ids, top, tail, obs, length, rest, cont = stacked([r for r in rows if len(r[1]) <= 3], 3, k)
    # depth 1: the context target exactly
    one = project_lookahead(
        ids[:, :1], top[:, :1], tail[:, :1], toy.proj, cont, obs[:, :1], length, rest[:, :2]
    )
    ctx = project_topk(ids[:, 0], top[:, 0], tail[:, 0], toy.proj, cont)
    assert torch.equal(_from_buckets(one, len(toy.student)), _from_buckets(ctx, len(toy.student)))
    # chunks of one teacher token: the first-piece target exactly
    single = length == 1
    assert int(single.sum()) > 3
    sel = [x[single] for x in (ids, top, tail, obs, length, rest)]
    cont1 = Continuation(
        *(x[single] for x in (cont.first_t, cont.label, cont.log_rest, cont.active))
    )
    got = project_lookahead(sel[0], sel[1], sel[2], toy.proj, cont1, sel[3], sel[4], sel[5])
    plain = project_topk(sel[0][:, 0], sel[1][:, 0], sel[2][:, 0], toy.proj)
    assert torch.equal(_from_buckets(got, len(toy.student)), _from_buckets(plain, len(toy.student)))


def toy_text(
    toy: Toy, gen, count: int, depth: int, k: int, past_end: bool = False, tau: float = 1.0
):
    """`count` random student tokens as one text, one chunk each over a random teacher split;
    the teacher's logits at random and its targets at `target_rows`; the student's labels and
    the chunks' first `depth` teacher tokens."""
    words = [toy.student[int(i)] for i in torch.randint(len(toy.student), (count,), generator=gen)]
    pieces = [toy.split(w, gen) for w in words]
    ids_s = torch.tensor([toy.s_id[w] for w in words])
    ids_t = torch.tensor([t for p in pieces for t in p])
    starts = [0] + list(itertools.accumulate(len(p) for p in pieces))
    chunks = torch.tensor([[i, i + 1, starts[i], starts[i + 1]] for i in range(len(words))])
    logits = torch.randn(len(ids_t), len(toy.teacher), generator=gen, dtype=F64) * 2
    next_t = torch.cat([ids_t[1:], torch.tensor([-1])])
    rows = target_rows(chunks, depth, past_end)
    eye = torch.eye(len(toy.teacher), dtype=F64)
    targets = teacher_targets(logits, eye, rows, next_t, k, temperature=tau)
    targets.depth = depth
    labels = torch.cat([ids_s[1:], torch.tensor([-100])])
    ahead = chunk_tokens(ids_t, chunks, depth)
    return SimpleNamespace(
        words=words,
        pieces=pieces,
        starts=starts,
        ids_s=ids_s,
        chunks=chunks,
        logits=logits,
        targets=targets,
        labels=labels,
        ahead=ahead,
    )


@pytest.mark.parametrize("past_end", [False, True])
def test_plan_reads_targets_at_the_rows_after_the_kd_position(past_end):
    """One text as student tokens (one chunk each) and teacher tokens; the teacher's logits at
    random; `teacher_targets` at `target_rows`, the term's tokens from `chunk_tokens`, and the
    buckets `build_plan` lays out per student row against the plain reference (with
    `past_end`, the row after a chunk is the next chunk's KD row)."""
    toy, k, depth = Toy(11), 4, 3
    t = toy_text(toy, torch.Generator().manual_seed(5), 40, depth, k, past_end)
    words, pieces, starts, ids_s, chunks, logits, labels = (
        t.words,
        t.pieces,
        t.starts,
        t.ids_s,
        t.chunks,
        t.logits,
        t.labels,
    )
    term = KDTerm(
        t.targets, toy.proj, chunks, torch.tensor(1.0), lookahead=t.ahead, past_end=past_end
    )
    term.denominator = kd_count(term, labels).double()
    part = build_plan(labels, [term], 0.5, 1.0, F64).terms[0].parts[0]
    got = _from_buckets(Buckets(part.ids, part.logq, part.valid, part.logq_tail), len(toy.student))
    logp = logits.log_softmax(-1)
    checked = 0
    for c in range(1, len(words)):
        o = pieces[c]
        if len(o) > depth:
            continue
        row = starts[c] - 1
        lp = [logp[row + d].tolist() for d in range(depth)]
        want = reference(toy, lp, k, o, int(ids_s[c]), depth, past_end)
        want = dense(want, len(toy.student))
        torch.testing.assert_close(got[c - 1], want, rtol=1e-10, atol=1e-12)
        checked += 1
    assert checked > 20


def test_real_joins_spell_their_student_token(real_tokenizer):
    from crossdistill.alignment.projection import build_joins

    tok_s, tok_t = real_tokenizer("llama3"), real_tokenizer("llama2")
    rows = build_joins(tok_t, tok_s)
    pieces_s = TokenBytes.from_tokenizer(tok_s).pieces()
    pieces_t = TokenBytes.from_tokenizer(tok_t).pieces()
    assert len(rows) > 100_000
    for a, x, v in rows[:: max(1, len(rows) // 3000)].tolist():
        assert pieces_s[v] == pieces_s[a] + pieces_t[x]
    joins = Joins.from_rows(torch.from_numpy(rows), len(pieces_t), len(pieces_s))
    for word, head, tail in ((".append", ".", "append"), (" getattr", " get", "attr")):
        (v,) = tok_s.encode(word, add_special_tokens=False)
        (a,) = tok_s.encode(head, add_special_tokens=False)
        x = next(i for i, p in enumerate(pieces_t) if p == tail.encode())
        assert int(joins.lookup(torch.tensor([a]), torch.tensor([x]))) == v


def test_own_joins_of_a_real_tokenizer_and_the_projection_that_takes_them(real_tokenizer):
    """`own_joins` on Qwen3's tokenizer: every row spells its token; ` get` then `attr` is
    ` getattr`, one token Qwen3 writes, while two digits are two tokens it never joins. The
    projection carries the table for a target past the end under `past_end: canonical` only."""
    from dataclasses import replace

    from crossdistill.alignment.projection import own_joins
    from crossdistill.config import TeacherConfig
    from crossdistill.train.build import build_projection_for

    tok_t, tok_s = real_tokenizer("qwen3"), real_tokenizer("llama3")
    rows = own_joins(tok_t)
    pieces = TokenBytes.from_tokenizer(tok_t).pieces()
    assert len(rows) > 100_000
    for a, x, v in rows[:: max(1, len(rows) // 3000)].tolist():
        assert pieces[v] == pieces[a] + pieces[x]
    own = Joins.from_rows(torch.from_numpy(rows), len(pieces), len(pieces))

    def one(text: str) -> int:
        (i,) = tok_t.encode(text, add_special_tokens=False)
        return i

    assert int(own.lookup(torch.tensor([one(" get")]), torch.tensor([one("attr")]))) == one(
        " getattr"
    )
    assert int(own.lookup(torch.tensor([one("1")]), torch.tensor([one("2")]))) == -1
    base = TeacherConfig(path="unused", target="lookahead_end", boundary="ignore")
    n_t, n_s = len(tok_t), len(tok_s)
    for tcfg, has in (
        (base, False),
        (replace(base, past_end="canonical"), True),
        (replace(base, target="lookahead", past_end="canonical"), False),
    ):
        proj = build_projection_for(tcfg, tok_t, tok_s, n_t, n_s, torch.device("cpu"))
        assert (proj.teacher_joins is not None) == has


def test_a_run_with_the_lookahead_target_trains_and_differs_from_context(tmp_path, tokenizer_dir):
    """`train()` in one process on the harness's tokenizers (Llama-2 student, GPT-2 teacher):
    finite losses, and a first KD value that is not the context target's (the later positions
    are read), nor, with `lookahead_end`, the lookahead target's. The untrained teacher is nearly uniform: a top-k of its whole vocabulary holds
    the observed token wherever a path starts."""
    from tests.distributed import _harness as h

    kd = {}
    for target in ("context", "lookahead", "lookahead_end"):
        cfg = h.probe_config(tmp_path / target, tokenizer_dir)
        cfg.teachers[0].target, cfg.teachers[0].top_k = target, 50304
        kd[target] = h.first_kd(cfg)
    assert abs(kd["lookahead"] - kd["context"]) > 1e-6 * kd["context"]
    # past the end, the moved mass is p(t_0)·p(joins) ~ 1/V² under a nearly uniform teacher:
    # tiny, but the run is deterministic and without the rows past the end it is the same run
    assert kd["lookahead_end"] != kd["lookahead"]


def test_a_loss_without_a_projected_target_is_refused(tmp_path, tokenizer_dir):
    from crossdistill.errors import UserError
    from crossdistill.train.validate import validate_config
    from tests.distributed import _harness as h

    cfg = h.trainer_config(tmp_path, tokenizer_dir, 2, eval_every=2)
    cfg.teachers[0].target, cfg.teachers[0].loss = "lookahead", "chunk_likelihood"
    with pytest.raises(UserError, match="target = lookahead needs a projected loss"):
        validate_config(cfg)

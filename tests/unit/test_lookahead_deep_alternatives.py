"""Where the lookahead targets send an alternative past the first teacher token
(`teachers.N.deep_alternatives`).

- `Extensions.lookup` on real tokenizers (Llama-3 student, Mistral teacher) against a plain walk
  over the byte strings: the longest student token spelling a then a prefix of x, and where the
  student has a token for a then the whole of x, the join table's token;
- `project_lookahead` under `longest` against the plain walk of `test_lookahead_target`
  (float64), with and without the step past the end: only the alternatives past depth 0 move,
  and the draw has some that do;
- the projection carries the table only for a lookahead target under `longest`, and the
  setting is refused with its choices where it is not one.
"""

from __future__ import annotations

import pytest
import torch

from crossdistill.alignment.projection import (
    _student_lookup,
    build_extensions,
    build_joins,
    extensions_of,
)
from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.config import Config, TeacherConfig, from_dict
from crossdistill.errors import UserError
from crossdistill.losses import Extensions, Joins
from crossdistill.losses.lookahead import project_lookahead
from crossdistill.models import load_tokenizer
from crossdistill.train.build import build_projection_for
from tests.unit.test_lookahead_target import Toy, dense, reference, stacked, toy_chunks
from tests.unit.test_losses_targets import _from_buckets

F64 = torch.float64


def _toy_extensions(toy: Toy) -> Extensions:
    rows, prefixes = extensions_of(
        TokenBytes.from_pieces(toy.teacher), TokenBytes.from_pieces(toy.student)
    )
    return Extensions.from_rows(
        torch.from_numpy(rows), torch.from_numpy(prefixes), len(toy.teacher), len(toy.student)
    )


def test_real_extensions_are_the_longest_student_token(tokenizer_dir):
    tok_s = load_tokenizer(str(tokenizer_dir("llama3")))
    tok_t = load_tokenizer(str(tokenizer_dir("mistral")))
    rows, prefixes = build_extensions(tok_t, tok_s)
    ext = Extensions.from_rows(
        torch.from_numpy(rows), torch.from_numpy(prefixes), len(tok_t), len(tok_s)
    )
    join_rows = torch.from_numpy(build_joins(tok_t, tok_s))
    joins = Joins.from_rows(join_rows, len(tok_t), len(tok_s))
    bytes_s, bytes_t = TokenBytes.from_tokenizer(tok_s), TokenBytes.from_tokenizer(tok_t)
    pieces_s, pieces_t, ids_s = bytes_s.pieces(), bytes_t.pieces(), _student_lookup(bytes_s)
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    # random pairs, and pairs of a student token with a rest that starts some other one
    pairs = join_rows[torch.randint(len(join_rows), (1500,), generator=gen), :2]
    a = torch.cat([torch.randint(len(tok_s), (1500,), generator=gen), pairs[:, 0]])
    x = torch.cat([torch.randint(len(tok_t), (1500,), generator=gen), pairs[:, 1]])
    near = torch.from_numpy(rows[torch.randint(len(rows), (1500,), generator=gen).numpy()])
    starts = {}
    for t, w in enumerate(pieces_t):
        if w and not bytes_t.special[t]:
            starts.setdefault(w[:2], t)
    rests = {}
    for a_id, _, v in near.tolist():
        rest = pieces_s[v][len(pieces_s[a_id]) :]
        if rest[:2] in starts:
            rests[a_id] = starts[rest[:2]]
    a = torch.cat([a, torch.tensor(list(rests))])
    x = torch.cat([x, torch.tensor(list(rests.values()))])
    got, joined = ext.lookup(a, x), joins.lookup(a, x)
    longer = 0
    for i, (ai, xi) in enumerate(zip(a.tolist(), x.tolist())):
        word_a, word_x = pieces_s[ai], pieces_t[xi]
        want = -1
        if word_a and word_x and ids_s.get(word_a) == ai and not bytes_t.special[xi]:
            for n in range(1, len(word_x) + 1):
                want = ids_s.get(word_a + word_x[:n], want)
        assert int(got[i]) == want, (word_a, word_x)
        if joined[i] >= 0:
            assert got[i] == joined[i]
        longer += want >= 0 and joined[i] < 0
    assert longer > 20  # the draw has tokens the join table does not give
    assert (ext.lookup(torch.tensor([-1, 5]), torch.tensor([7, -1])) == -1).all()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [2, 3])
@pytest.mark.parametrize("past_end", [False, True])
def test_longest_matches_the_plain_walk(seed, depth, past_end):
    toy, k = Toy(seed), 4
    rows = [r for r in toy_chunks(toy, seed, 150, depth) if len(r[1]) <= depth]
    ids, top, tail, obs, length, rest, cont = stacked(rows, depth, k)
    single = torch.ones(len(rows), dtype=torch.bool) if past_end else None
    join = _from_buckets(
        project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single),
        len(toy.student),
    )
    toy.proj.extensions = _toy_extensions(toy)
    got = _from_buckets(
        project_lookahead(ids, top, tail, toy.proj, cont, obs, length, rest, single),
        len(toy.student),
    )
    for c, (label, o, lp) in enumerate(rows):
        want = reference(toy, lp.tolist(), k, o, label, depth, past_end, longest=True)
        torch.testing.assert_close(got[c], dense(want, len(toy.student)), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got.sum(-1), torch.ones(len(rows), dtype=F64))
    assert not got.isnan().any() and (got >= -1e-15).all()
    changed = (got - join).abs().sum(-1) > 1e-12
    assert 0 < int(changed.sum()) < int((length > 1).sum())  # some alternatives move
    assert not changed[length == 1].any()  # the end step and depth 0 are untouched


def test_the_projection_carries_extensions_under_longest_only(tokenizer_dir):
    tok_s = load_tokenizer(str(tokenizer_dir("llama3")))
    tok_t = load_tokenizer(str(tokenizer_dir("mistral")))

    def build(**kw):
        tcfg = TeacherConfig(path="unused", boundary="ignore", **kw)
        rows_t, rows_s = len(tok_t), len(tok_s)
        return build_projection_for(tcfg, tok_t, tok_s, rows_t, rows_s, torch.device("cpu"))

    assert build(target="lookahead", deep_alternatives="longest").extensions is not None
    assert build(target="lookahead").extensions is None
    assert build(target="first_piece", deep_alternatives="longest").extensions is None
    same = build_projection_for(
        TeacherConfig(
            path="unused", target="lookahead", deep_alternatives="longest", boundary="ignore"
        ),
        tok_s, tok_s, len(tok_s), len(tok_s), torch.device("cpu"),
    )  # fmt: skip
    assert same.extensions is None and same.joins is None


def test_an_unknown_setting_names_its_choices():
    with pytest.raises(UserError, match="deep_alternatives.*join.*longest"):
        from_dict(
            Config,
            {"teachers": [{"path": "t", "deep_alternatives": "widest"}], "data": {"path": "x"}},
        )

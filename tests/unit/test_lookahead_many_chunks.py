"""The lookahead targets at chunks of several tokens on both sides (`teachers.N.many_chunks`).

- the plan end to end on toy byte vocabularies, where one random text is cut into student and
  teacher tokens independently, so that every kind of chunk occurs: under `path` a chunk of
  several tokens on both sides is read as one student token over the teacher tokens up to the
  one that crosses its first token's end, against the plain walk of `test_lookahead_target`
  (float64), with and without the step past the end, and where the student's first token is
  the shorter one the teacher's first token's mass goes to it; without byte lengths such a
  chunk keeps the first piece's buckets, and the other chunks are the same either way;
- `first_token_ends` on real tokenizers (Llama-3 student, Mistral teacher) and real text: the
  teacher tokens it stops at spell the student's first token's bytes and cross its end;
- the projection carries byte lengths for a lookahead target under `path` only.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.losses import (
    ByteLengths,
    KDTerm,
    chunk_tokens,
    kd_count,
    target_rows,
    teacher_targets,
)
from crossdistill.losses.plan import build_plan, first_token_ends
from crossdistill.losses.projection import Buckets
from tests.unit.test_lookahead_target import Toy, dense, reference
from tests.unit.test_losses_targets import _from_buckets

F64 = torch.float64


def _cut(vocab: list[bytes], text: bytes, gen) -> list[int]:
    """A random tokenisation of `text` with `vocab` (every single letter is in it)."""
    out, at = [], 0
    while at < len(text):
        fits = [i for i, w in enumerate(vocab) if text.startswith(w, at)]
        i = fits[int(torch.randint(len(fits), (1,), generator=gen))]
        out.append(i)
        at += len(vocab[i])
    return out


def _chunks(vocab_s, vocab_t, ids_s, ids_t) -> torch.Tensor:
    """`[C, 4]` rows `(s0, s1, t0, t1)` at the byte offsets where both tokenisations end a
    token."""
    ends_s, ends_t, at = {}, {}, 0
    for i, w in enumerate(ids_s):
        at += len(vocab_s[w])
        ends_s[at] = i + 1
    at = 0
    for i, w in enumerate(ids_t):
        at += len(vocab_t[w])
        ends_t[at] = i + 1
    rows, s0, t0 = [], 0, 0
    for byte in sorted(set(ends_s) & set(ends_t)):
        rows.append([s0, ends_s[byte], t0, ends_t[byte]])
        s0, t0 = ends_s[byte], ends_t[byte]
    return torch.tensor(rows)


def _lengths(toy: Toy) -> ByteLengths:
    return ByteLengths(
        torch.tensor([len(w) for w in toy.teacher]), torch.tensor([len(w) for w in toy.student])
    )


def _plan_rows(toy, chunks, ids_t, logits, labels, depth, k, past_end) -> torch.Tensor:
    next_t = torch.cat([ids_t[1:], torch.tensor([-1])])
    eye = torch.eye(len(toy.teacher), dtype=F64)
    targets = teacher_targets(logits, eye, target_rows(chunks, depth, past_end), next_t, k)
    targets.depth = depth
    term = KDTerm(
        targets,
        toy.proj,
        chunks,
        torch.tensor(1.0),
        lookahead=chunk_tokens(ids_t, chunks, depth),
        past_end=past_end,
    )
    term.denominator = kd_count(term, labels).double()
    part = build_plan(labels, [term], 0.5, 1.0, F64).terms[0].parts[0]
    return _from_buckets(Buckets(part.ids, part.logq, part.valid, part.logq_tail), len(toy.student))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("past_end", [False, True])
def test_path_at_many_chunks_matches_the_plain_walk(seed, past_end):
    toy, k, depth = Toy(seed), 4, 3
    gen = torch.Generator().manual_seed(50 + seed)
    text = bytes(b"abc"[int(i)] for i in torch.randint(3, (400,), generator=gen))
    ids_s = _cut(toy.student, text, gen)
    ids_t = _cut(toy.teacher, text, gen)
    chunks = _chunks(toy.student, toy.teacher, ids_s, ids_t)
    ids_s, ids_t = torch.tensor(ids_s), torch.tensor(ids_t)
    logits = torch.randn(len(ids_t), len(toy.teacher), generator=gen, dtype=F64) * 2
    labels = torch.cat([ids_s[1:], torch.tensor([-100])])
    first = _plan_rows(toy, chunks, ids_t, logits, labels, depth, k, past_end)
    toy.proj.byte_lengths = _lengths(toy)
    got = _plan_rows(toy, chunks, ids_t, logits, labels, depth, k, past_end)
    logp = logits.log_softmax(-1)
    kinds = {"path": 0, "shorter": 0, "first": 0, "other": 0}
    for s0, s1, t0, t1 in chunks[1:].tolist():
        o, label, row = ids_t[t0:t1].tolist(), int(ids_s[s0]), s0 - 1
        lp = [
            logp[r].tolist() for r in range(t0 - 1, min(len(ids_t), t0 - 1 + max(depth, t1 - t0)))
        ]
        if s1 - s0 == 1:
            want, kind = reference(toy, lp, k, o, label, depth, past_end), "other"
            torch.testing.assert_close(got[row], first[row], rtol=0, atol=0)
        else:
            spelled = toy.student[label]
            inside = sum(
                1
                for j in range(len(o))
                if len(b"".join(toy.teacher[x] for x in o[: j + 1])) <= len(spelled)
            )
            if t1 - t0 > 1 and 1 <= inside < depth:
                assert b"".join(toy.teacher[x] for x in o[: inside + 1]).startswith(spelled)
                want, kind = reference(toy, lp, k, o[: inside + 1], label, depth), "path"
            elif t1 - t0 > 1 and inside == 0:  # shorter than the teacher's first token
                assert toy.teacher[o[0]].startswith(spelled)
                want, kind = reference(toy, lp, k, o[:1], label, depth), "shorter"
                if o[0] in sorted(range(len(lp[0])), key=lambda x: -lp[0][x])[:k]:
                    p0 = math.exp(lp[0][o[0]])  # the teacher's first token's mass: to the label
                    want[int(toy.proj.first_piece[o[0]])] -= p0
                    want[label] += p0
            else:  # one teacher token, or a crossing past the depth limit: the first piece
                want, kind = reference(toy, lp, k, o[:1], label, depth), "first"
                torch.testing.assert_close(got[row], first[row], rtol=0, atol=0)
        kinds[kind] += 1
        torch.testing.assert_close(got[row], dense(want, len(toy.student)), rtol=1e-10, atol=1e-12)
    assert not got.isnan().any()
    torch.testing.assert_close(got.sum(-1), torch.ones(got.shape[0], dtype=F64))
    assert kinds["path"] > 10 and kinds["shorter"] > 5 and kinds["other"] > 50, kinds
    moved = (got - first).abs().sum(-1) > 1e-9
    assert int(moved.sum()) >= 5  # the path changes those chunks' targets where it starts


def test_first_token_ends_on_real_tokenizers(real_tokenizer):
    """On C-like text, Llama-3 under Mistral: at each chunk of several tokens on both sides that
    `first_token_ends` reads to a crossing, the teacher tokens up to its end start with the
    student's first token's bytes and the ones before it are shorter; the other chunks keep
    their end."""
    from crossdistill.alignment.align import align

    tok_s, tok_t = real_tokenizer("llama3"), real_tokenizer("mistral")
    table_s, table_t = TokenBytes.from_tokenizer(tok_s), TokenBytes.from_tokenizer(tok_t)
    text = (
        "#ifndef _STDIO_H\n#define FILENAME_MAX 4096\n#define _IO_FSIZ 8 /* REDIRECT */\n"
        "extern int __uflow (FILE *) __THROW; /* _HOLE, _NORE: FILENAME too long */\n"
        "#define __need_FILE_REDIRECT(STDIO, FSIZ) _NORE_HOLE\n"
    ) * 2
    ids_s = torch.tensor(tok_s.encode(text, add_special_tokens=False))
    ids_t = torch.tensor(tok_t.encode(text, add_special_tokens=False))
    chunks = torch.from_numpy(align(ids_s.numpy(), ids_t.numpy(), table_s, table_t).chunks)
    lengths = ByteLengths(
        torch.from_numpy(table_t.lengths.astype("int64")),
        torch.from_numpy(table_s.lengths.astype("int64")),
    )
    from crossdistill.losses import VocabProjection

    proj = VocabProjection.identity(1)
    proj.byte_lengths = lengths
    labels = torch.cat([ids_s[1:], torch.tensor([-100])])
    depth = 4
    term = KDTerm(
        None, proj, chunks, torch.tensor(1.0), lookahead=chunk_tokens(ids_t, chunks, depth)
    )
    ends, crossing = first_token_ends(term, labels)
    pieces_s, pieces_t = table_s.pieces(), table_t.pieces()
    moved = shorter = 0
    for (s0, s1, t0, t1), end, read in zip(chunks.tolist(), ends.tolist(), crossing.tolist()):
        if not read:
            assert end == t1
            continue
        moved += 1
        assert s1 - s0 > 1 and t1 - t0 > 1 and t0 + 1 <= end <= t1
        spelled = pieces_s[int(ids_s[s0])]
        upto = b"".join(pieces_t[x] for x in ids_t[t0:end].tolist())
        before = b"".join(pieces_t[x] for x in ids_t[t0 : end - 1].tolist())
        assert upto.startswith(spelled) and len(upto) > len(spelled) > len(before)
        shorter += end == t0 + 1
    assert moved >= 6 and 0 < shorter < moved
    proj.byte_lengths = None
    ends, crossing = first_token_ends(term, labels)
    assert torch.equal(ends, chunks[:, 3]) and not crossing.any()


def test_the_projection_has_byte_lengths_for_a_lookahead_target_under_path_only(real_tokenizer):
    from crossdistill.config import TeacherConfig
    from crossdistill.train.build import build_projection_for

    tok_t, tok_s = real_tokenizer("mistral"), real_tokenizer("llama3")
    n_t, n_s = len(tok_t) + 3, len(tok_s) + 5  # padded embedding rows
    base = TeacherConfig(path="unused", target="lookahead_end", boundary="ignore")
    for tcfg, has in (
        (base, True),  # path is the default
        (replace(base, many_chunks="first_piece"), False),
        (replace(base, target="first_piece"), False),
    ):
        proj = build_projection_for(tcfg, tok_t, tok_s, n_t, n_s, torch.device("cpu"))
        assert (proj.byte_lengths is not None) == has
        if has:
            lengths = proj.byte_lengths
            assert lengths.teacher.shape == (n_t,) and lengths.student.shape == (n_s,)
            (x,) = tok_s.encode(" getattr", add_special_tokens=False)
            assert int(lengths.student[x]) == 8 and int(lengths.student[-1]) == 0

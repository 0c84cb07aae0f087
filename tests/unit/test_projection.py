"""Vocabulary projection: first piece against the tokenizers' own BPE, multi-piece weights,
the identity, the sparse product against a float64 reference, storage and refusal."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from crossdistill.alignment import TokenBytes
from crossdistill.alignment.projection import (
    Projection,
    build_projection,
    exact_match_mask,
    relaxed_matches,
)
from crossdistill.errors import UserError


@pytest.fixture(scope="module")
def small(real_tokenizer):
    """The three small vocabularies (gpt2 50k byte-level, llama2 and mistral 32k SentencePiece)."""
    return {name: real_tokenizer(name) for name in ("gpt2", "llama2", "mistral")}


@pytest.fixture(scope="module")
def gpt2_to_llama2(small):
    return build_projection(small["gpt2"], small["llama2"])


@pytest.fixture(scope="module")
def llama2_to_gpt2_multi(small):
    return build_projection(small["llama2"], small["gpt2"], mode="multi_piece")


def test_first_piece_is_the_students_own_first_token(small, gpt2_to_llama2):
    """Independent path: SentencePiece's BPE model on the teacher token's text with '▁' for
    spaces and no dummy prefix, as the student would read it inside running text."""
    tok_t, tok_s = small["gpt2"], small["llama2"]
    table_t, table_s = TokenBytes.from_tokenizer(tok_t), TokenBytes.from_tokenizer(tok_s)
    first = gpt2_to_llama2.first_piece.numpy()
    assert first.shape == (table_t.vocab_size,) and gpt2_to_llama2.shape == (50257, 32000)
    rng = np.random.default_rng(2024)
    checked = 0
    for t in rng.choice(table_t.vocab_size, size=400, replace=False).tolist():
        data = table_t.token_bytes(t)
        if not data:
            assert first[t] == -1 or table_t.special_text[t] in table_s.special_text.values()
            continue
        got = table_s.token_bytes(int(first[t]))
        assert got and data.startswith(got), (t, data, got)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if gpt2_to_llama2.exact[t]:
            assert got == data
            continue
        model_ids = [p.id for p in tok_s.backend_tokenizer.model.tokenize(text.replace(" ", "▁"))]
        assert first[t] == model_ids[0], (t, text)
        checked += 1
    assert checked > 50


def test_exact_matches_and_coverage(small, gpt2_to_llama2):
    table_t = TokenBytes.from_tokenizer(small["gpt2"])
    table_s = TokenBytes.from_tokenizer(small["llama2"])
    student_bytes = {table_s.token_bytes(i) for i in range(table_s.vocab_size)} - {b""}
    expected = np.asarray([table_t.token_bytes(t) in student_bytes for t in range(50257)])
    expected[50256] = False  # <|endoftext|> has no namesake in Llama-2
    assert np.array_equal(gpt2_to_llama2.exact.numpy(), expected)
    assert np.array_equal(exact_match_mask(table_t, table_s), expected)
    first = gpt2_to_llama2.first_piece.numpy()
    assert first[50256] == -1 and (first[:50256] >= 0).all()
    rows = gpt2_to_llama2.rows.numpy()
    assert np.array_equal(rows, np.flatnonzero(first >= 0))  # one entry per covered row
    assert torch.equal(gpt2_to_llama2.cols, gpt2_to_llama2.first_piece[gpt2_to_llama2.rows])
    stats = gpt2_to_llama2.stats()
    assert stats["coverage"] == pytest.approx(50256 / 50257)
    assert stats["exact_share"] == pytest.approx(expected.mean())


def test_multi_piece_weights_follow_byte_lengths(small, llama2_to_gpt2_multi):
    proj = llama2_to_gpt2_multi
    tok_s = small["gpt2"]
    table_t = TokenBytes.from_tokenizer(small["llama2"])
    table_s = TokenBytes.from_tokenizer(tok_s)
    crow, cols, weights = proj.csr()
    assert crow.shape == (32001,) and int(crow[-1]) == cols.shape[0]
    sums = torch.zeros(32000, dtype=torch.float64).index_add_(0, proj.rows, proj.weights.double())
    covered = proj.first_piece >= 0
    assert torch.allclose(sums[covered], torch.ones(int(covered.sum()), dtype=torch.float64))
    assert (sums[~covered] == 0).all()
    rng = np.random.default_rng(9)
    for t in rng.choice(32000, size=200, replace=False).tolist():
        data = table_t.token_bytes(t)
        if not data or proj.exact[t]:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        ids = tok_s.backend_tokenizer.encode(text, add_special_tokens=False).ids
        expected: dict[int, float] = {}
        for i in ids:
            expected[i] = expected.get(i, 0.0) + len(table_s.token_bytes(i)) / len(data)
        lo, hi = int(crow[t]), int(crow[t + 1])
        got = dict(zip(cols[lo:hi].tolist(), weights[lo:hi].double().tolist()))
        assert got.keys() == expected.keys()
        assert all(abs(got[k] - expected[k]) < 1e-6 for k in got)
        assert int(proj.first_piece[t]) == ids[0]


def test_sparse_product_matches_float64_reference(gpt2_to_llama2, llama2_to_gpt2_multi):
    rng = np.random.default_rng(0)
    for proj in (gpt2_to_llama2, llama2_to_gpt2_multi):
        v_t, v_s = proj.shape
        p_t = rng.dirichlet(np.full(v_t, 0.05))  # [V_t] float64
        q_ref = np.zeros(v_s)
        for r, c, w in zip(proj.rows.tolist(), proj.cols.tolist(), proj.weights.tolist()):
            q_ref[c] += p_t[r] * w
        matrix = proj.to_sparse().double()  # [V_t, V_s]
        q = torch.sparse.mm(matrix.t(), torch.from_numpy(p_t)[:, None])[:, 0].numpy()
        assert np.isfinite(q).all()
        np.testing.assert_allclose(q, q_ref, rtol=1e-6, atol=1e-12)
        covered = proj.first_piece.numpy() >= 0
        assert q.sum() == pytest.approx(p_t[covered].sum(), rel=1e-6)


def test_identical_tokenizers_give_the_identity(small):
    proj = build_projection(small["mistral"], small["mistral"])
    assert torch.equal(proj.first_piece, torch.arange(32000))
    assert torch.equal(proj.rows, torch.arange(32000)) and torch.equal(proj.cols, proj.rows)
    assert bool((proj.weights == 1).all()) and bool(proj.exact.all())


def test_relaxed_matches_pair_each_teacher_token_with_its_best_student_token(small):
    """hkl's pairs, checked against a plain loop over the student tokens: the exact matches,
    then for every other teacher token the student token it starts that the teacher cuts into
    the fewest pieces (lowest id on a tie), each student token paired at most once."""
    tok_t, tok_s = small["llama2"], small["gpt2"]
    got = relaxed_matches(tok_t, tok_s)
    forward = build_projection(tok_t, tok_s)
    exact = forward.exact.numpy()
    assert np.array_equal(got[exact], forward.first_piece.numpy()[exact])
    backward = build_projection(tok_s, tok_t, mode="multi_piece")
    first_t = backward.first_piece.tolist()
    n_pieces = np.bincount(backward.rows.numpy(), minlength=len(first_t)).tolist()
    images = set(got[exact].tolist())
    best: dict[int, tuple[int, int]] = {}
    for s_id, t in enumerate(first_t):
        if t >= 0 and s_id not in images and not exact[t]:
            best[t] = min(best.get(t, (n_pieces[s_id], s_id)), (n_pieces[s_id], s_id))
    want = np.where(exact, got, -1)
    for t, (_, s_id) in best.items():
        want[t] = s_id
    assert np.array_equal(got, want)
    relaxed = got[(got >= 0) & ~exact]
    assert len(relaxed) > 100 and len(set(relaxed.tolist())) == len(relaxed)
    pieces_t, pieces_s = (
        TokenBytes.from_tokenizer(tok_t).pieces(),
        TokenBytes.from_tokenizer(tok_s).pieces(),
    )
    for t in np.flatnonzero((got >= 0) & ~exact):
        assert pieces_s[got[t]].startswith(pieces_t[t]) and pieces_s[got[t]] != pieces_t[t]
    assert np.array_equal(relaxed_matches(tok_t, tok_t), np.arange(32000))


def test_save_load_and_refuse_other_tokenizers(small, gpt2_to_llama2, tmp_path):
    from crossdistill.models import tokenizer_fingerprint

    path = tmp_path / "p.safetensors"
    gpt2_to_llama2.save(path)
    loaded = Projection.load(path, tok_t=small["gpt2"], tok_s=small["llama2"])
    for name in ("first_piece", "exact", "rows", "cols", "weights"):
        assert torch.equal(getattr(loaded, name), getattr(gpt2_to_llama2, name)), name
    assert loaded.mode == "first_piece" and loaded.vocab_size_s == 32000
    with pytest.raises(UserError) as err:
        Projection.load(path, tok_t=small["gpt2"], tok_s=small["mistral"])
    message = str(err.value)
    assert tokenizer_fingerprint(small["llama2"]) in message
    assert tokenizer_fingerprint(small["mistral"]) in message and "student" in message
    with pytest.raises(UserError, match="teacher tokenizer"):
        Projection.load(path, tok_t=small["mistral"])
    with pytest.raises(UserError, match="does not exist"):
        Projection.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UserError, match="not a readable safetensors"):
        Projection.load(tmp_path / "junk.safetensors")
    with pytest.raises(UserError, match="unknown projection mode"):
        build_projection(small["gpt2"], small["llama2"], mode="dense")


def test_projection_commands(tokenizer_dir, tmp_path, capsys):
    from crossdistill.cli import main

    out = tmp_path / "p.safetensors"
    build = ["projection", "build", "--student-tokenizer", str(tokenizer_dir("gpt2"))]
    build += ["--teacher-tokenizer", str(tokenizer_dir("mistral")), "--out", str(out)]
    assert main(build) == 0
    assert "exact matches" in capsys.readouterr().out and out.is_file()
    assert main(["projection", "inspect", str(out), "--json", "--examples", "6"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["vocab_t"] == 32000 and report["vocab_s"] == 50257
    assert 0.5 < report["coverage"] <= 1.0 and len(report["examples"]) == 6
    inspect = [
        "projection",
        "inspect",
        str(out),
        "--student-tokenizer",
        str(tokenizer_dir("llama2")),
    ]
    assert main(inspect) == 2
    assert "fingerprint" in capsys.readouterr().err

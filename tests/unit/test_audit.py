"""`crossdistill audit`: the numbers of a tokenizer pair on real tokenizers and text (CPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from crossdistill.cli import main
from crossdistill.errors import UserError
from crossdistill.train.audit import audit_pair, read_texts

TEXTS = [
    "def area(r):\n    return 3.14159 * r ** 2\n\n\nfor i in range(10):\n        print(i, 12345)\n",
    "The quick brown fox jumps over the lazy dog; numbers 2024, 1e-9 and 65536.\n",
    "naïve café — 東京タワー and Ωμέγα, with emoji 🙂 and tabs\t\there.\n",
] * 4


def test_a_tokenizer_with_itself_aligns_one_to_one_everywhere(tokenizer_dir):
    tok = str(tokenizer_dir("llama3"))
    r = audit_pair(tok, tok, TEXTS)
    assert r["one_to_one_share"] == 1.0 and r["chunk_start_share"] == 1.0
    assert r["fallback_share"] == 0.0 and r["inexact_chunk_share"] == 0.0
    assert r["first_piece"]["right"] == 1.0
    assert r["recommendation"]["target"] == "first_piece" and not r["warnings"]
    assert (
        r["classes"]["digits"]["chunk_share"] > 0 and r["classes"]["non_latin"]["chunk_share"] > 0
    )


def test_near_and_far_pairs_get_what_the_quality_benchmark_measured(tokenizer_dir):
    student = str(tokenizer_dir("llama3"))
    near = audit_pair(student, str(tokenizer_dir("qwen3")), TEXTS)
    far = audit_pair(student, str(tokenizer_dir("llama2")), TEXTS)
    # Qwen3 writes numbers digit by digit, Llama-3 in groups of three
    assert near["classes"]["digits"]["one_to_one_share"] < 1.0
    assert near["classes"]["digits"]["mean_chunk_tokens_teacher"] > 1.0
    assert far["first_piece"]["right"] < near["first_piece"]["right"]
    assert far["recommendation"]["target"] == "lookahead_split"
    assert any("far pair" in w for w in far["warnings"])
    # and names the alternative measured beside it, and the weights, with the comparisons to run
    assert any(
        "--target lookahead_prefix_end --target lookahead_split" in w
        and "--kd-ratio 0.5 --kd-ratio 0.7" in w
        for w in far["warnings"]
    )
    for r in (near, far):
        assert 0 < r["one_to_one_share"] < 1
        assert abs(sum(r["first_piece"].values()) - 1) < 1e-9
        assert sum(r["histogram"]["student"]) == r["chunks"]


def test_the_teacher_mass_is_the_models_probability_on_unplaced_ids(tokenizer_dir, tmp_path):
    from crossdistill.alignment.projection import build_projection
    from crossdistill.models import build_causal_lm, load_tokenizer

    student, teacher = str(tokenizer_dir("llama3")), str(tokenizer_dir("llama2"))
    model = build_causal_lm(
        arch="tiny-llama",
        overrides={"vocab_size": 32000, "hidden_size": 32, "intermediate_size": 64},
        seed=0,
    )
    model.save_pretrained(tmp_path / "t", safe_serialization=True)
    r = audit_pair(student, teacher, TEXTS[:1], str(tmp_path / "t"), model_tokens=10_000)
    first = build_projection(load_tokenizer(teacher), load_tokenizer(student)).first_piece
    ids = torch.tensor(load_tokenizer(teacher)(TEXTS[0])["input_ids"])
    ids = torch.cat([ids, ids.new_tensor([load_tokenizer(teacher).eos_token_id])])
    with torch.no_grad():
        p = torch.softmax(model(ids.view(1, -1)).logits[0].float(), -1)
    want = float(p[:, first < 0].sum(1).mean())
    assert r["teacher_mass"]["positions"] == ids.numel()
    assert r["teacher_mass"]["unplaced_mass"] == pytest.approx(want, rel=1e-4)


def test_the_command_writes_json_and_a_histogram(tokenizer_dir, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    png = tmp_path / "h.png"
    args = [str(tokenizer_dir("llama3")), str(tokenizer_dir("phi-4-mini")), "--corpus", str(corpus)]
    assert main(["audit", *args, "--json", "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("one_to_one_share", "chunk_start_share", "fallback_share", "recommendation"):
        assert key in out
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["audit", *args]) == 0
    assert "recommendation" in capsys.readouterr().out


def test_rows_that_are_not_text_are_counted_and_the_corpus_may_be_compressed(tmp_path, capsys):
    import gzip

    rows = [{"text": f"document {i}\n" * 50} for i in range(40)]
    rows[1] = {"body": "another field"}
    rows[3] = {"text": 7}
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    texts = read_texts([str(path)], 2_000)
    assert texts == [r["text"] for i, r in enumerate(rows[:6]) if i not in (1, 3)]
    err = capsys.readouterr().err
    assert "[audit] skipped 2 of 6 corpus rows read" in err and "c.jsonl.gz:2" in err


def test_bad_input_is_one_line(tokenizer_dir, tmp_path, capsys):
    tok = str(tokenizer_dir("llama3"))
    with pytest.raises(UserError, match="data path not found"):
        read_texts([str(tmp_path / "missing.jsonl")], 1000)
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"text": "   "}) + "\n")
    with pytest.raises(UserError, match="no text documents"):
        read_texts([str(empty)], 1000)
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    code = main(["audit", tok, tok, "--corpus", str(tmp_path / "missing.jsonl")])
    assert code == 2 and "data path not found" in capsys.readouterr().err
    with pytest.raises(UserError, match="no \\*.safetensors"):
        audit_pair(tok, tok, TEXTS[:1], str(tmp_path / "noweights"))
    assert np.isfinite(audit_pair(tok, tok, TEXTS[:1])["one_to_one_share"])


def test_a_pair_between_near_and_far_gets_the_split_and_says_to_compare():
    from crossdistill.train.audit import recommend

    def report(right):
        return {
            "first_piece": {"right": right},
            "projection": {"teacher_tokens_unplaced_share": 0.0},
            "fallback_share": 0.0,
            "one_to_one_share": 0.8,
        }

    middle, warnings = recommend(report(0.88))
    assert middle["target"] == "lookahead_split" and "88.0%" in middle["why"]
    assert middle["why"].startswith("between near and far")
    assert "--target first_piece --target lookahead_split" in middle["why"]
    assert not warnings
    for right in (0.80, 0.85, 0.8501, 0.853):
        assert recommend(report(right))[0]["target"] == "lookahead_split"
    assert recommend(report(0.85))[0]["why"].startswith("far pair")
    assert recommend(report(0.8501))[0]["why"].startswith("between near and far")
    # near the near bound the audit warns that other text may fall on its other side
    for right, target in ((0.94, "lookahead_split"), (0.96, "first_piece")):
        rec, near_warnings = recommend(report(right))
        assert rec["target"] == target
        assert any(f"{right:.1%}" in w and "--target first_piece --target lookahead_split" in w
                   for w in near_warnings)  # fmt: skip
    assert not any("95% bound" in w for w in recommend(report(0.84))[1])
    assert recommend(report(0.9499))[0]["target"] == "lookahead_split"
    assert recommend(report(0.95))[0]["target"] == "first_piece"

"""`crossdistill bench align`: its sections run end to end on small inputs and render."""

from __future__ import annotations

import json

import pytest

from crossdistill.bench import align as bench
from crossdistill.errors import UserError


def test_speed_timing_on_a_few_documents(real_tokenizer):
    from crossdistill.alignment import TokenBytes
    from crossdistill.alignment.sample_text import stdlib_sources

    tok_s, tok_t = real_tokenizer("gpt2"), real_tokenizer("mistral")
    text = "".join(stdlib_sources(limit_bytes=60_000))
    docs = bench._documents(tok_s, tok_t, text, num_docs=2, length=512)
    assert len(docs) == 2 and all(len(a) == 512 for a, _ in docs)
    timed = bench._time_alignment(
        docs, TokenBytes.from_tokenizer(tok_s), TokenBytes.from_tokenizer(tok_t), passes=1
    )
    assert timed["identical_to_dp"] and timed["batch_identical"]
    assert timed["best_cpu"] > 0 and timed["dp_cpu"] > 0


def test_jsonl_stage_timing(tokenizer_dir, tmp_path):
    from crossdistill.data.aligned import Pipeline, process_file

    pipeline = Pipeline.load(str(tokenizer_dir("gpt2")), str(tokenizer_dir("llama2")))
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps({"text": f"line {i} é 数"}) for i in range(70)))
    for stage in ("tokenize", "align", "full"):
        out = tmp_path / "out.jsonl" if stage == "full" else None
        result = process_file(pipeline, source, out, workers=1, stage=stage)
        assert result["lines"] == 70
        cpu = result["cpu_seconds"]
        assert cpu["tokenize"] > 0 and (cpu["align"] > 0) == (stage != "tokenize")
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 70


def test_render_and_bad_arguments(tmp_path):
    speed = {
        "student": "a", "teacher": "b", "docs": 1, "ms_per_doc": 1.0,
        "student_tokens_per_s": 1e7, "all_tokens_per_s": 2e7, "cpu_ms_per_doc": 1.0,
        "student_tokens_per_cpu_s": 1e7, "batch_cpu_ms_per_doc": 1.0,
        "batch_student_tokens_per_cpu_s": 1e7, "dp_ms_per_doc": 100.0, "speedup_vs_dp": 100.0,
        "speedup_vs_dp_cpu": 100.0, "identical_to_dp": True, "batch_identical": True,
    }  # fmt: skip
    assert "| a | b | 1 |" in bench.render("speed", [speed])
    with pytest.raises(UserError, match="no tokenizers at"):
        bench.tokenizers_dir(tmp_path)

"""`crossdistill bench loss` end to end on a small size: one JSON object with the agreed keys,
and ours agreeing with the naive full-logits version of the same loss."""

from __future__ import annotations

import json

from crossdistill.cli import main


def test_bench_loss_prints_one_json_object(capsys):
    argv = ["bench", "loss", "--device", "cpu", "--json", "--n", "48", "--hidden", "16"]
    argv += [
        "--vocab",
        "700",
        "--top-k",
        "8",
        "--chunk-size",
        "16",
        "--repeats",
        "1",
        "--warmup",
        "0",
    ]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("peak_mem_ratio", "time_ratio", "max_rel_err", "matmul_ms", "naive_ms", "ours_ms"):
        assert key in result
    assert result["max_rel_err"] < 1e-5
    assert result["time_ratio"] > 0 and result["ours_ms"] > 0


def test_bench_loss_help_has_examples(capsys):
    try:
        main(["bench", "loss", "--help"])
    except SystemExit as e:
        assert e.code == 0
    assert "crossdistill bench loss --device cuda" in capsys.readouterr().out

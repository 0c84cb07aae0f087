"""`crossdistill bench step` runs end to end on the CPU (tiny layers, real vocabularies and
tokenizers): its own step, the phase split, the profile, an ablation and the naive baseline."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from crossdistill.bench.profile import kind_of, largest_gaps


def test_bench_step_smoke_on_cpu(tokenizer_dir):
    cmd = [
        sys.executable, "-m", "crossdistill", "bench", "step", "--tiny", "--device", "cpu",
        "--steps", "1", "--warmup", "1", "--seq-len", "64", "--micro-batch", "2", "--json",
        "--profile", "--ablate", "sdpa", "--ablate", "fp32-queries", "--ablate", "full-topk",
        "--variant", "bitmask-stats",
        "--baseline", "naive",
        "--grad-accum", "2",
        "--student", "llama-3.2-1b", "--student-tokenizer", str(tokenizer_dir("llama2")),
        "--teacher", "qwen3-4b", "--teacher-tokenizer", str(tokenizer_dir("mistral")),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "tokens_per_s", "naive_tokens_per_s", "ablate/sdpa/tokens_per_s", "loss_fraction",
        "loader_fraction", "flops_per_token", "ablate/fp32-queries/tokens_per_s",
        "variant/bitmask-stats/tokens_per_s",
    ):  # fmt: skip
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["grad_accum"] == 2 and "ms/optimizer" in result
    # the teachers' tokens of the timed batches themselves (Mistral's tokenizer on Llama-2's)
    (ratio,) = result["teacher_tokens_per_student_token"]
    assert 0.8 < ratio < 1.25 and ratio != 1.0
    # an ablation is timed on later batches: its own ratio, its own MFU (none on a CPU)
    (own,) = result["ablate/sdpa/teacher_tokens_per_student_token"]
    assert 0.8 < own < 1.25 and "ablate/sdpa/mfu" in result
    prof = result["profile"]
    assert prof["top"] and prof["busy_ms"] > 0 and prof["step_ms"] > 0
    assert abs(sum(prof["ms_by_kind"].values()) - prof["busy_ms"]) < 1e-6 * prof["busy_ms"] + 1e-9


def test_kernel_kinds():
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kind_of("aten::mm") == "matmul"
    assert kind_of("flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kind_of("triton_poi_fused_add_mul_0") == "triton"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert kind_of("void multi_tensor_apply_kernel<...>") == "optimizer"


def test_bench_step_refuses_bad_accumulation(tokenizer_dir):
    cmd = [
        sys.executable, "-m", "crossdistill", "bench", "step", "--tiny", "--device", "cpu",
        "--grad-accum", "0", "--student-tokenizer", str(tokenizer_dir("llama2")),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "--grad-accum must be >= 1" in out.stderr and "Traceback" not in out.stderr


def test_largest_gaps_sum_idle_time_between_kernels():
    spans = [  # (start µs, end µs, name) on two streams, two steps
        (0, 100, "a"), (50, 120, "b"), (200, 300, "c"), (300, 400, "a"),
        (1000, 1100, "a"), (1150, 1200, "b"), (1300, 1400, "c"),
    ]  # fmt: skip
    gaps = largest_gaps(spans, steps=2)
    by_pair = {(g["after"], g["before"]): g for g in gaps}
    # b ends at 120 (a, overlapping, ended at 100): 80 µs idle before c; 600 after a at 400 ...
    assert by_pair[("b", "c")]["ms"] == round((80 + 100) / 1e3 / 2, 3)
    assert by_pair[("a", "a")]["ms"] == round(600 / 1e3 / 2, 3)
    assert by_pair[("a", "b")]["ms"] == round(50 / 1e3 / 2, 3)
    assert gaps[0]["after"] == "a" and gaps[0]["before"] == "a"
    assert sum(g["ms"] for g in gaps) == pytest.approx((80 + 600 + 50 + 100) / 1e3 / 2, abs=2e-3)


def test_optimised_vs_plain_script_on_cpu(tokenizer_dir):
    """`benchmarks/optimised_vs_plain.py` runs both paths on the same batches and reports their
    agreement (on the CPU in float32 they agree to float32 reordering)."""
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "optimised_vs_plain.py"
    cmd = [
        sys.executable, str(script), "--tiny", "--device", "cpu", "--seq-len", "32",
        "--micro-batch", "2", "--steps", "2",
        "--student-tokenizer", str(tokenizer_dir("llama2")),
        "--teacher", "qwen3-4b", "--teacher-tokenizer", str(tokenizer_dir("mistral")),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(result["optimised"]["loss"]) == len(result["plain"]["loss"]) == 2
    assert all(math.isfinite(x) for x in result["plain"]["loss"])
    assert result["max_rel_diff_loss"] < 1e-4 and result["max_rel_diff_grad_norm"] < 1e-3


def test_teacher_padding_is_chosen_per_run_and_put_back(tokenizer_dir, capsys, monkeypatch):
    """`--teacher-padding drop` runs the cross teacher on its non-pad tokens (on the CPU too,
    where `auto` keeps the rows); the process-wide setting is back to `auto` afterwards."""
    from crossdistill.cli import main
    from crossdistill.train import step as train_step

    rows_seen = []
    real = train_step.targets_from_hidden

    def spy(slot, tb, hidden, rows, *rest):
        rows_seen.append(rows is not None)
        return real(slot, tb, hidden, rows, *rest)

    monkeypatch.setattr(train_step, "targets_from_hidden", spy)
    for padding in ("drop", "keep"):
        rows_seen.clear()
        argv = [
            "bench", "step", "--tiny", "--device", "cpu", "--steps", "1", "--warmup", "0",
            "--seq-len", "64", "--micro-batch", "2", "--json", "--teacher-padding", padding,
            "--student", "llama-3.2-1b", "--student-tokenizer", str(tokenizer_dir("llama3")),
            "--teacher", "qwen3-4b", "--teacher-tokenizer", str(tokenizer_dir("qwen3")),
        ]  # fmt: skip
        assert main(argv) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["teacher_padding"] == padding
        assert result["graphs_compiled_in_timed_steps"] == 0
        assert rows_seen and set(rows_seen) == {padding == "drop"}
        assert train_step.DROP_TEACHER_PADDING == {"mode": "auto"}

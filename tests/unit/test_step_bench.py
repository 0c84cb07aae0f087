"""`crossdistill bench step` runs end to end on the CPU (tiny layers, real vocabularies and
tokenizers): its own step, the phase split, the profile and the naive baseline."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.profile_summary import kind_of, largest_gaps, phase_times

REPO = Path(__file__).resolve().parents[2]


def test_bench_step_smoke_on_cpu(tokenizer_dir):
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--tiny", "--device", "cpu",
        "--steps", "1", "--warmup", "1", "--seq-len", "64", "--micro-batch", "2", "--json",
        "--split", "--profile", "--baseline", "naive",
        "--grad-accum", "2",
        "--student", "llama-3.2-1b", "--student-tokenizer", str(tokenizer_dir("llama2")),
        "--teacher", "qwen3-4b", "--teacher-tokenizer", str(tokenizer_dir("mistral")),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "tokens_per_s", "naive_tokens_per_s", "student_loss_fraction", "teacher_fraction",
        "loader_fraction", "flops_per_token",
    ):  # fmt: skip
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["grad_accum"] == 2 and "ms/optimizer" in result
    # the teachers' tokens of the timed batches themselves (Mistral's tokenizer on Llama-2's)
    (ratio,) = result["teacher_tokens_per_student_token"]
    assert 0.8 < ratio < 1.25 and ratio != 1.0
    assert result["attention"] == "auto" and result["teacher_padding"] == "auto"
    # `--target auto` (the default), resolved at load: Mistral's pieces are Llama-2's
    assert result["targets"] == ["first_piece"]
    prof = result["profile"]
    assert prof["top"] and prof["busy_ms"] > 0 and prof["step_ms"] > 0
    assert abs(sum(prof["ms_by_kind"].values()) - prof["busy_ms"]) < 1e-6 * prof["busy_ms"] + 1e-9
    # the step's phases, read from its profiler ranges; none of them counted as an operator
    phases = prof["phases"]
    for name in ("teachers", "student_forward", "student_loss", "student_backward", "optimizer"):
        assert phases[name]["host_ms"] > 0, name
    assert not any(row["name"].startswith("crossdistill/") for row in prof["top"])


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


class _Event:
    def __init__(self, name, start, end, device=False, annotation=False, device_us=0.0):
        self.name, self.is_user_annotation = name, annotation
        self.device_type = "DeviceType.CUDA" if device else "DeviceType.CPU"
        self.time_range = type("Range", (), {"start": start, "end": end})()
        self.device_time_total = device_us


def test_phase_times_split_a_range_into_compute_communication_and_idle():
    events = [  # two steps; the phase's host range, its device range, kernels on two streams
        _Event("crossdistill/teachers", 0, 50, device_us=70.0),
        _Event("crossdistill/teachers", 10, 110, device=True, annotation=True),
        _Event("sm90_xmma_gemm", 10, 40, device=True),
        _Event("ncclDevKernel_AllGather", 30, 60, device=True),  # overlaps the matmul
        _Event("flash_fwd_kernel", 90, 110, device=True),  # idle 60 -> 90 before it
        _Event("sm90_xmma_gemm", 200, 300, device=True),  # outside the phase
        _Event("crossdistill/teachers", 1000, 1030, device_us=10.0),
        _Event("crossdistill/teachers", 1000, 1010, device=True, annotation=True),
        _Event("triton_poi_fused", 1000, 1010, device=True),
    ]
    row = phase_times(events, steps=2, cuda=True)["teachers"]
    assert row["host_ms"] == pytest.approx((50 + 30) / 1e3 / 2, abs=1e-3)
    assert row["kernel_ms"] == pytest.approx(80 / 1e3 / 2, abs=1e-3)
    assert row["span_ms"] == pytest.approx((100 + 10) / 1e3 / 2, abs=1e-3)
    assert row["communication_ms"] == pytest.approx(30 / 1e3 / 2, abs=1e-3)
    assert row["compute_ms"] == pytest.approx((30 + 20 + 10) / 1e3 / 2, abs=1e-3)
    assert row["idle_ms"] == pytest.approx(30 / 1e3 / 2, abs=1e-3)
    assert set(phase_times(events, steps=1, cuda=False)["teachers"]) == {"host_ms"}


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


def test_bench_step_options_are_the_trainers_config(tokenizer_dir):
    """The benchmark's options become the `crossdistill train` config it is built from: what a
    comparison of two runs changes is exactly one setting of the trainer."""
    import argparse

    from crossdistill.bench.step_setup import bench_config

    args = argparse.Namespace(
        device="cpu", tiny=True, attention="sdpa", compile=False, student="llama-3.2-1b",
        student_tokenizer=str(tokenizer_dir("llama3")), checkpoint_blocks=2,
        checkpoint_scope="mlp", teacher=["qwen3-4b"], teacher_tokenizer=[str(tokenizer_dir("qwen3"))],
        loss="reverse_kl", top_k=16, seq_len=64, micro_batch=2, warmup=1, steps=2, grad_accum=3,
        loss_chunk_size=128, teacher_padding="drop", loss_kernels="pytorch",
    )  # fmt: skip
    cfg = bench_config(args, "corpus.jsonl")
    assert cfg.student.attn_implementation == cfg.teachers[0].attn_implementation == "sdpa"
    assert cfg.student.activation_checkpointing and cfg.student.activation_checkpointing_blocks == 2
    assert cfg.student.activation_checkpointing_scope == "mlp"
    assert cfg.teachers[0].loss == "reverse_kl" and cfg.teachers[0].top_k == 16
    assert cfg.train.teacher_padding == "drop" and cfg.train.grad_accum == 3
    assert cfg.train.loss_kernels == "pytorch"
    assert cfg.train.steps == 3 and cfg.data.seq_len == 64 and cfg.data.train == ["corpus.jsonl"]


def test_bench_step_teacher_padding_option(tokenizer_dir, capsys):
    """`--teacher-padding` reaches the run: reported, and no graph is compiled while timing."""
    from crossdistill.cli import main

    for padding in ("drop", "keep"):
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


def test_data_pipeline_benchmark_script_on_cpu():
    """`benchmarks/bench_data.py` runs the real loader beside the plain-tokenizer baseline."""
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "bench_data.py"), "--batches", "2",
        "--workers", "0", "--seq-len", "128", "--json",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["batches"] == 2 and result["student_tokens"] > 0
    assert result["baseline"]["student_tokens_per_s"] > 0


def test_rates_of_a_job_are_per_gpu():
    """A two-GPU job's MFU is its rate over both GPUs' peak; the per-GPU and one-GPU rates are
    one GPU's against one peak, so all three agree when the job scales perfectly."""
    from crossdistill.bench.step import add_rates

    result = {"tokens_per_s": 200.0, "per_gpu_tokens_per_s": 100.0, "one_gpu_tokens_per_s": 100.0}
    result["gpus"] = 2
    add_rates(result, flops=1e12, peak=1000.0)
    assert result["mfu"] == result["per_gpu_mfu"] == result["one_gpu_mfu"] == 0.1
    assert result["tflops"] == 200.0 and result["per_gpu_tflops"] == 100.0
    assert "speedup_vs_per_gpu" not in result and "speedup_vs_one_gpu" not in result
    naive = {"tokens_per_s": 300.0, "naive_tokens_per_s": 100.0}
    add_rates(naive, flops=1e12, peak=None)
    assert naive["speedup_vs_naive"] == 3.0 and naive["mfu"] is None


def test_step_memory_replays_what_is_live_at_the_peak():
    """`benchmarks/step_memory.py`'s replay: the peak counts from the bytes held before the
    step, a completed free gives its bytes back, and the sites are the package's frames."""
    from benchmarks.step_memory import live_at_peak, where

    frame = {"filename": "/x/crossdistill/losses/a.py", "line": 7, "name": "f"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 10, "frames": [frame]},
        {"action": "alloc", "addr": 2, "size": 5, "frames": []},
        {"action": "free_requested", "addr": 1, "size": 10},  # not yet back: still counted
        {"action": "free_completed", "addr": 1, "size": 10},
        {"action": "alloc", "addr": 3, "size": 4, "frames": []},
    ]
    peak, live = live_at_peak(trace, base=100)
    assert peak == 115 and [e["addr"] for e in live] == [1, 2]
    assert where(live[0]) == "losses/a.py:7:f" and where(live[1]) == "(outside the package)"

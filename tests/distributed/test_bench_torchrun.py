"""`crossdistill bench step` under torchrun (gloo, CPU): the job's rate, its rate per process
and each rank's numbers in one report, beside the same command timed in one process first."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed._harness import free_port

pytestmark = pytest.mark.distributed


LAYOUTS = {
    "tp2": (["--set", "student.parallel.tp=2", "--set", "teachers.0.parallel.dp_shard=2"],
            ["tp=2", "dp_shard=2"]),
    # two pipeline stages over the two processes, each step 2 micro-batches
    "pp2": (["--set", "student.parallel.pp=2", "--grad-accum", "2"], ["pp=2", "dp_shard=2"]),
}  # fmt: skip


def _bench_job(tokenizer_dir, processes: int, options: list[str]) -> dict:
    """`crossdistill bench step` (tiny models, Qwen3 teacher -> Llama-3 student) under torchrun
    on `processes` gloo processes with `options`; the job's one report."""
    tok = {n: str(tokenizer_dir(n)) for n in ("llama3", "qwen3")}
    command = [
        "bench", "step", "--student-tokenizer", tok["llama3"], "--teacher", "qwen3-4b",
        "--teacher-tokenizer", tok["qwen3"], "--tiny", "--device", "cpu", "--seq-len", "128",
        "--micro-batch", "1", "--steps", "2", "--warmup", "1", "--json", *options,
    ]  # fmt: skip
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes)]
    launch += ["--master_port", str(free_port()), "-m", "crossdistill", *command]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 1  # one report for the job
    return json.loads(lines[0])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bench_step_reports_the_job_beside_one_process(tokenizer_dir, layout):
    settings, described = LAYOUTS[layout]
    result = _bench_job(tokenizer_dir, 2, [*settings, "--one-gpu-reference"])
    assert result["processes"] == 2 and len(result["peak_gib_per_rank"]) == 2
    assert all(x in result["layout"] for x in described)
    # one data rank (tp2, pp2): the job's rate is that rank's, per process half of it
    assert result["per_gpu_tokens_per_s"] == pytest.approx(result["tokens_per_s"] / 2)
    assert result["one_gpu_tokens_per_s"] > 0
    assert result["per_gpu_vs_one_gpu"] == pytest.approx(
        result["per_gpu_tokens_per_s"] / result["one_gpu_tokens_per_s"]
    )


def test_bench_step_times_a_separate_teacher_in_two_pipeline_stages(tokenizer_dir):
    """The student on one process, the teacher on two of its own as a two-stage pipeline
    (`--teacher-ranks 2`, `teachers.0.parallel.pp=2`): one report, from the student's."""
    separate = ["--teacher-placement", "separate", "--teacher-ranks", "2"]
    result = _bench_job(tokenizer_dir, 3, [*separate, "--set", "teachers.0.parallel.pp=2"])
    assert result["processes"] == 3 and result["tokens_per_s"] > 0
    assert 0 <= result["target_wait_fraction"] < 1


def test_bench_step_refuses_teacher_ranks_without_a_separate_teacher(tokenizer_dir):
    command = [
        sys.executable, "-m", "crossdistill", "bench", "step", "--tiny", "--device", "cpu",
        "--student-tokenizer", str(tokenizer_dir("llama3")), "--teacher-ranks", "2",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "--teacher-ranks 2" in done.stderr and "--teacher-placement separate" in done.stderr
    assert "Traceback" not in done.stderr

"""Pipelines on GPUs under NCCL: the paths the gloo tests (`test_teacher_pipeline.py`,
`test_pipeline.py`, `test_pipeline_cp.py`) cannot reach. Each run is `train()` started as
torchrun starts it (`_harness.spawn`, no process group of the test's), so the package itself
picks each process's GPU (`LOCAL_RANK`, modulo the GPU count where the processes outnumber the
GPUs) and inits NCCL; the workers see only the GPUs a case names (`CUDA_VISIBLE_DEVICES`).

The scenario of `_harness` on `train.device: cuda` (float32 weights, the student computing
under bf16 autocast), 12 steps of 4 micro-batches, validation every 4 and checkpoints every 6
steps. Every logged value must agree to 1e-5 relative (`test_streams._assert_same`):

- a separate teacher in two forward-only stages (`ranks: 2`, `parallel.pp: 2`) on three
  processes over two GPUs: the student on cuda:0, stage 0 on cuda:1, the last stage on cuda:0
  again; the stages' own group is NCCL (cuda:1 -> cuda:0), the last stage's targets reach the
  student as CUDA IPC handles. The Qwen3 teacher (tied embeddings) and the Phi-3 teacher (an
  lm_head of its own), each against the one-GPU run with every teacher colocated;
- a pp2 student (1F1B, four micro-batches a step) on two GPUs, the teachers colocated and their
  work shared by the stages, against the one-GPU run; its step-6 checkpoint is written;
- pp2 x cp2 on four GPUs against cp2 on two, the first step (losses, gradient norm, all
  logged values): from the second step on, the two runs' gradient norms drift apart by
  2e-5, then 6e-5 of their value (`gpu-tests-pipeline-pp2cp2-*-20261126-h100.txt`), growing
  with the updates; on CPU in float32 the two agree over 20 steps (`test_pipeline_cp.py`), so
  the drift is in the GPU's bf16 paths (suspected, not measured: FSDP's bf16 parameters give
  bf16 unsharded gradients, and the tied embedding's two uses add up in bf16 on one stage,
  in float32 after the reduction across two). A context-parallel student is sharded by FSDP,
  which on CUDA gathers its parameters in bf16 (`setup.parallel_models`), so it does not
  compute what one unsharded GPU does; cp2 computes as pp2 x cp2 does, whose stages pass
  bf16 hidden states, and differs from it in its stages and their sends alone.

The pipeline cases take `test_streams.PIPELINE_FLOOR` as the absolute floor of the near-zero
KD terms: a pipeline sums the tied embedding's gradients, and the stages' gradient norms, in
another order than one process, as on CPU. The student pipelines on GPUs allow 5e-5
relative (`GPU_PIPELINE_REL`): bf16 rounding (autocast matmuls, FSDP's bf16 gathers), summed in
that other order, moves the gradient norm by 1e-5 to 2.5e-5 of its value
(`benchmarks/results/gpu-tests-pipeline-*-20261126-*.txt`).
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path

import pytest
import torch

from crossdistill.config import ParallelConfig as P
from tests.distributed import _harness as h
from tests.distributed.test_streams import PIPELINE_FLOOR, _assert_same, _metrics, _run

GPU_PIPELINE_REL = 5e-5

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
STEPS = 12
PP2 = P(pp=2)
CP2 = P(cp=2, dp_shard=1)
PP2_CP2 = P(pp=2, cp=2, dp_shard=1)


def _gpus(n: int) -> str:
    """`CUDA_VISIBLE_DEVICES` for the first `n` GPUs this process sees; skips with fewer."""
    have = torch.cuda.device_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs, this machine has {have}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(have)]
    return ",".join(ids[:n])


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("pipeline_gpu")
    cfg = h.trainer_config(root, tokenizer_dir, STEPS, eval_every=4)
    cfg.train.device, cfg.train.grad_accum = "cuda", 4  # 1F1B's steady state on two stages
    cfg.train.checkpoint_every, cfg.train.teacher_timeout_s = 6, 120.0
    return root, cfg


def _train(
    base, name: str, processes: int, gpus: int, student: P | None = None, teacher: str | None = None
) -> dict[int, dict[str, float]]:
    """The base config's `train()` in run folder `name` on `processes` processes that see
    `gpus` GPUs: the student in layout `student`; `teacher` (by name) separate, in two
    pipeline stages on two processes of its own. Returns the run's logged values by step."""
    root, cfg = base
    visible = _gpus(gpus)
    c = copy.deepcopy(cfg)
    c.run.out_dir = str(root / name)
    c.student.parallel = student or P()
    for t in c.teachers:
        if t.name == teacher:
            t.placement, t.ranks, t.parallel = "separate", 2, PP2
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", visible)
        _run(c, processes, root / f"errors-{name}")
    return _metrics(Path(c.run.out_dir))


@pytest.fixture(scope="module")
def one_gpu(base):
    """The reference: one process on one GPU, every teacher colocated."""
    return _train(base, "one-gpu", 1, 1)


def test_the_reference_trains_and_validates(one_gpu):
    assert sorted(one_gpu) == list(range(1, STEPS + 1))
    assert "val/bpb/student" in one_gpu[4] and "val/loss/kd/phi" in one_gpu[STEPS]
    losses = [one_gpu[s]["loss"] for s in sorted(one_gpu)]
    assert all(abs(a - b) > 1e-5 for a, b in zip(losses, losses[1:]))


@pytest.mark.parametrize("teacher", ["qwen", "phi"])
def test_a_teacher_in_two_stages_on_two_gpus_gives_the_one_gpu_run(base, one_gpu, teacher, capfd):
    """Stage 0 (cuda:1) sends its hidden states over the teacher's NCCL group to the last stage
    (cuda:0), which runs the final norm, the lm_head and the top-k targets and hands them to
    the student on its GPU: every logged value of the one-GPU run, in training and
    validation."""
    capfd.readouterr()
    got = _train(base, f"{teacher}-pp2", 3, 2, teacher=teacher)
    said = capfd.readouterr().err  # the workers' log (stderr)
    assert f"teacher {teacher!r}: separate, targets from rank 2 of the job over CUDA IPC" in said
    _assert_same(got, one_gpu, f"{teacher} in two stages")
    assert "target_wait" in got[1]


def test_a_two_stage_student_on_two_gpus_gives_the_one_gpu_run(base, one_gpu):
    """The stages exchange hidden states and their gradients over NCCL (1F1B, four
    micro-batches), the tied embedding's two copies add their gradients across the GPUs, the
    last stage scores training and held-out batches: every logged value of the one-GPU run;
    the stages write one checkpoint."""
    got = _train(base, "student-pp2", 2, 2, student=PP2)
    _assert_same(got, one_gpu, "pp2 student", floor=PIPELINE_FLOOR, rel=GPU_PIPELINE_REL)
    assert (base[0] / "student-pp2/checkpoints/step_000006/dcp/.metadata").is_file()


def test_a_two_stage_context_parallel_student_on_four_gpus_gives_cp2(base):
    """Each stage's two GPUs a context-parallel group that hands its rows to the next stage's:
    the cp2 run on two GPUs (module doc: why not one GPU), every value of the first step."""
    _gpus(4)
    reference = _train(base, "student-cp2", 2, 2, student=CP2)
    got = _train(base, "student-pp2xcp2", 4, 4, student=PP2_CP2)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert sorted(got) == sorted(reference)
    assert all(math.isfinite(v) for values in got.values() for v in values.values())
    # the first step to 1e-5 (module doc: why the later ones drift apart on GPUs)
    _assert_same({1: got[1]}, {1: reference[1]}, "pp2 x cp2 student", floor=PIPELINE_FLOOR)

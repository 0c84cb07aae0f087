"""Pipeline stages with context parallelism on CPU (gloo) against one process: pp2 x cp2 on four
ranks, each stage's two ranks a context-parallel group that hands its own rows of every
micro-batch to the next stage, with the cross-tokenizer teachers of the other pipeline tests;
20 optimizer steps in float32 must give the single-process loss and gradient norm to 1e-5
relative. Also: the teachers laid out across the stages' ranks (tensor and context parallel)
with the student's blocks recomputed in the backward (a pipeline runs other micro-batches'
forwards in between, so a block's recompute must see its own micro-batch's sequence), and the
interleaved schedule (two stages on each rank, the deeper student of 4 blocks).

`train()` runs: a pp2 x cp2 run that validates, checkpoints and exports a loadable Hugging Face
folder; its checkpoint resumed in one process, and a one-process checkpoint resumed as
pp2 x cp2, each equal to the uninterrupted run; and a pipeline whose sequences context
parallelism cannot cut refused before loading.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from crossdistill.config import ParallelConfig as P
from crossdistill.errors import UserError
from tests.distributed import _harness as h
from tests.distributed.test_pipeline import (
    INTERLEAVED,
    STEPS,
    WINDOW,
    _assert_invariant,
    _close,
    _deep,
    _drop_after,
    _run,
    _train_cfg,
    assert_run_matches_one_process,
)

pytestmark = pytest.mark.distributed

PP_CP = P(pp=2, cp=2, dp_shard=1)
CASES = [
    h.Layouts("pp2xcp2", PP_CP, [P(), P()]),
    h.Layouts(
        "pp2xcp2_teachers_tp2_cp2_recomputed",
        PP_CP,
        [P(tp=2), P(cp=2)],
        activation_checkpointing=True,
    ),
]
DEEP = h.Layouts("pp2xcp2_interleaved", replace(INTERLEAVED, cp=2, dp_shard=1), [P(), P()])


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer_dir):
    """Config and micro-batches made once; the single-process references, and one-process
    `train()` runs: uninterrupted, and stopped at step 2."""
    from crossdistill.train.loop import train

    root = tmp_path_factory.mktemp("pipeline_cp")
    cfg = h.trainer_config(root, tokenizer_dir, 4, eval_every=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sc = h.prepare(cfg, STEPS * WINDOW, root / "scenario.pt")
        reference = h.run_steps(cfg, sc, STEPS, WINDOW)
        reference_deep = h.run_steps(_deep(cfg), sc, STEPS, WINDOW)
        train(_train_cfg(cfg, root / "one_full", P()))
        train(_train_cfg(cfg, root / "one_part", P()), stop_after=2)
    finally:
        torch.set_num_threads(threads)
    _drop_after(root / "one_part", 2)
    return root, cfg, reference, reference_deep


def four_rank_worker(rank: int, cfg, root: str, out: str) -> None:
    from crossdistill.train.loop import train

    sc = torch.load(Path(root) / "scenario.pt", weights_only=False)
    results = {c.name: h.run_steps(h.with_layouts(cfg, c), sc, STEPS, WINDOW) for c in CASES}
    results[DEEP.name] = h.run_steps(h.with_layouts(_deep(cfg), DEEP), sc, STEPS, WINDOW)
    train(_train_cfg(cfg, Path(root) / "ppcp_full", PP_CP))
    train(_train_cfg(cfg, Path(root) / "ppcp_part", PP_CP), stop_after=2)
    train(_train_cfg(cfg, Path(root) / "from_one", PP_CP), resume=True)
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def four(setup):
    root, cfg = setup[:2]
    shutil.copytree(root / "one_part", root / "from_one")  # resumed as pp2 x cp2 by the workers
    h.spawn(four_rank_worker, 4, cfg, str(root), str(root / "four.pt"), errors=root / "errors4")
    return torch.load(root / "four.pt", weights_only=False)


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_pipeline_with_context_parallel_matches_one_process(setup, four, case):
    _assert_invariant(setup[2], four[case], case)


def test_interleaved_pipeline_with_context_parallel_matches_one_process(setup, four):
    _assert_invariant(setup[3], four[DEEP.name], DEEP.name)


def test_pipeline_cp_train_run_validates_checkpoints_and_exports(setup, four):
    """pp2 x cp2 `train()`: the one-process run's losses, held-out bits per byte (the last
    stage's context-parallel ranks each score their rows) and a Hugging Face folder that
    loads and gives the one-process run's weights."""
    assert_run_matches_one_process(setup[0], "ppcp_full")


def test_one_process_checkpoint_resumes_as_pipeline_cp(setup, four):
    root = setup[0]
    resumed, one = _run(root / "from_one"), _run(root / "one_full")
    assert sorted(s for s in resumed if "loss" in resumed[s]) == [1, 2, 3, 4]
    _close(resumed, one, "loss")
    _close(resumed, one, "val/bpb/student")


def test_pipeline_cp_checkpoint_resumes_in_one_process(setup, four):
    from crossdistill.train.loop import train

    root, cfg = setup[:2]
    _drop_after(root / "ppcp_part", 2)
    train(_train_cfg(cfg, root / "ppcp_part", P()), resume=True)
    resumed, uninterrupted = _run(root / "ppcp_part"), _run(root / "one_full")
    assert sorted(s for s in resumed if "loss" in resumed[s]) == [1, 2, 3, 4]
    _close(resumed, uninterrupted, "loss")
    _close(resumed, uninterrupted, "val/bpb/student")


def test_pipeline_cp_layouts_are_planned_or_refused_before_loading(setup):
    """pp x cp (with tp too) is planned; sequences that 2 x cp pieces do not cut evenly are
    refused, naming the numbers."""
    from crossdistill.distributed.setup import plan_layouts
    from crossdistill.train.validate import validate_config

    cfg = setup[1]
    res_s, res_t = validate_config(cfg)
    hf_t = [r.hf_config for r in res_t]
    plan = plan_layouts(_train_cfg(cfg, setup[0] / "plan", PP_CP), 4, res_s.hf_config, hf_t)
    assert (plan.student.pp, plan.student.cp, plan.student.dp) == (2, 2, 1)
    wide = replace(PP_CP, tp=2)
    plan = plan_layouts(_train_cfg(cfg, setup[0] / "plan", wide), 8, res_s.hf_config, hf_t)
    assert (plan.student.pp, plan.student.cp, plan.student.tp) == (2, 2, 2)
    c = _train_cfg(cfg, setup[0] / "plan", replace(PP_CP, cp=3))
    c.data.seq_len = 64
    with pytest.raises(UserError) as e:
        plan_layouts(c, 6, res_s.hf_config, hf_t)
    assert "cp = 3: data.seq_len = 64 is not divisible by 2 x cp = 6" in str(e.value)

"""A separate teacher laid out as a forward-only pipeline (`teachers.N.parallel.pp`), on CPU:
gloo processes running `train()` as torchrun starts it, against the same run with the teacher
unsplit on a process of its own and with every teacher colocated in one process.

The scenario of `test_streams.py` (tiny Llama student, a Qwen3 teacher with tied embeddings on
forward-KL top-k targets, a Phi-3 teacher with its own lm_head on chunk likelihood), 20 steps of
2 micro-batches, validation and checkpoints every 5 steps. Every logged value must agree to 1e-5
(float32): the Qwen3 teacher in two stages on two processes against the same teacher on one
process of its own and against one process; the Phi-3 teacher in two stages against one
process; a student of two data ranks served by the two-stage teacher against the same two data
ranks with the teachers colocated; and the two-stage run stopped at step 10 and resumed against
the uninterrupted one. Layouts a teacher pipeline cannot take are refused before anything loads.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from crossdistill.config import ParallelConfig
from tests.distributed import _harness as h
from tests.distributed.test_streams import _assert_same, _metrics, _run

pytestmark = pytest.mark.distributed
STEPS = 20
PP2 = {"ranks": 2, "parallel": {"pp": 2}}  # the teacher's two stages on two processes


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("teacher_pipeline")
    cfg = h.trainer_config(root, tokenizer_dir, STEPS, eval_every=5)
    cfg.train.checkpoint_every = 5
    cfg.train.teacher_timeout_s = 120.0
    return root, cfg


def _variant(base, name: str, teacher: str | None = None, settings: dict | None = None):
    """The base config in run folder `name`; `teacher` (by name) on processes of its own, in
    `settings` (its `ranks` and `parallel`)."""
    root, cfg = base
    c = copy.deepcopy(cfg)
    c.run.out_dir = str(root / name)
    settings = settings or {}
    for t in c.teachers:
        if t.name == teacher:
            t.placement, t.ranks = "separate", settings.get("ranks", 1)
            t.parallel = ParallelConfig(**settings.get("parallel", {}))
    return c


@pytest.fixture(scope="module")
def runs(base):
    """Every run once (20 steps each, a process start per rank)."""
    root, _ = base
    cases = [  # (result, separate teacher, its settings, student, processes, stop after)
        ("colocated", None, {}, {}, 1, None),
        ("qwen-separate", "qwen", {}, {}, 2, None),
        ("qwen-pp2", "qwen", PP2, {}, 3, None),
        ("phi-pp2", "phi", PP2, {}, 3, None),
        ("stopped", "qwen", PP2, {}, 3, 10),
        ("resumed", "qwen", PP2, {}, 3, None),  # the stopped run's folder, resumed
        ("dp2-colocated", None, {}, {"dp_shard": 2}, 2, None),
        ("dp2-qwen-pp2", "qwen", PP2, {"dp_shard": 2}, 4, None),
    ]
    out = {}
    for i, (key, teacher, settings, student, processes, stop) in enumerate(cases):
        cfg = _variant(base, key.replace("resumed", "stopped"), teacher, settings)
        cfg.student.parallel = ParallelConfig(**student)
        _run(cfg, processes, root / f"errors{i}", stop_after=stop)
        out[key] = _metrics(Path(cfg.run.out_dir))
    return out


def test_the_reference_runs_train_and_validate(runs):
    ref = runs["colocated"]
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert "val/loss/kd/qwen" in ref[5] and "val/loss/kd/phi" in ref[STEPS]
    assert abs(ref[STEPS]["loss"] - ref[1]["loss"]) > 1e-2
    assert sorted(runs["stopped"]) == list(range(1, 11))


@pytest.mark.parametrize(
    "name, reference",
    [
        ("qwen-pp2", "qwen-separate"),
        ("qwen-pp2", "colocated"),
        ("phi-pp2", "colocated"),
        ("resumed", "colocated"),
        ("dp2-qwen-pp2", "dp2-colocated"),
    ],
)
def test_a_teacher_in_two_stages_gives_the_unsplit_teacher(runs, name, reference):
    """Stage 0 embeds and runs its block, the last stage its block, the final norm, the lm_head
    (the tied embedding's copy for Qwen3, a head of its own for Phi-3) and the top-k targets,
    which its process streams to the student: every logged value of the unsplit teacher's run,
    in training and validation, also after a stop at step 10 and a resume, and with one
    teacher group serving both data ranks of a dp2 student."""
    _assert_same(runs[name], runs[reference], name)
    assert "target_wait" in runs[name][1]


def test_bad_teacher_pipelines_are_refused_before_loading(base):
    from crossdistill.distributed.setup import plan_layouts
    from crossdistill.distributed.streams import teacher_source
    from crossdistill.errors import UserError
    from crossdistill.train.validate import validate_config

    cfg = _variant(base, "refused", "qwen", PP2)
    res_s, res_t = validate_config(cfg)
    hf = (res_s.hf_config, [r.hf_config for r in res_t])
    blocks = hf[1][0].num_hidden_layers

    def refused(world: int, ranks: int, placement: str = "separate", **parallel) -> str:
        c = copy.deepcopy(cfg)
        t = c.teachers[0]
        t.placement, t.ranks, t.parallel = placement, ranks, ParallelConfig(**parallel)
        with pytest.raises(UserError) as e:
            plan_layouts(c, world, *hf)
        return str(e.value)

    big = blocks + 1
    assert f"teachers.0.parallel.pp = {big} is larger than the model's {blocks} blocks" in (
        refused(1 + big, big, pp=big)
    )
    wrong = refused(4, 3, pp=2)
    assert "pp x dp_replicate = 2 x 1 = 2 does not divide teachers.0.ranks = 3" in wrong
    wrong = refused(3, 2, pp=2, dp_shard=2)
    assert "pp x dp_replicate x dp_shard = 2 x 1 x 2 = 4, but teachers.0.ranks = 2" in wrong
    colocated = refused(2, 1, "colocated", pp=2, dp_shard=1)
    assert "teachers.0.parallel.pp = 2: a colocated teacher" in colocated
    assert "teachers.0.placement: separate" in colocated
    assert "with tp = 2 and cp = 1" in refused(5, 4, pp=2, tp=2)
    assert "pp_stages_per_rank = 2 with pp_schedule = Interleaved1F1B" in refused(
        3, 2, pp=2, pp_stages_per_rank=2, pp_schedule="Interleaved1F1B"
    )
    # accepted: two stages, the targets sent from the last one's process
    layouts = plan_layouts(cfg, 3, *hf)
    teacher = layouts.teachers[0]
    assert (teacher.pp, teacher.dp, layouts.separate) == (2, 1, [True, False])
    assert teacher_source(0, teacher, start=1) == 2
    wide = plan_layouts(_variant(base, "wide", "qwen", {"ranks": 4, "parallel": {"pp": 2}}), 6, *hf)
    assert wide.teachers[0].dp_shard == 2  # dp_shard -1: what the stages leave
    assert [teacher_source(d, wide.teachers[0], start=2) for d in (0, 1)] == [4, 5]

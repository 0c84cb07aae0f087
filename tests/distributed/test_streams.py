"""Separate teachers on CPU: gloo processes running `train()` as torchrun starts it, against the
same run with every teacher colocated.

The scenario of `_harness` (tiny Llama student, a Qwen3 teacher on forward-KL top-k targets
and a Phi-3 teacher on chunk likelihood, three real tokenizers), 4 steps of 2 micro-batches,
validation and checkpoints every 2 steps. A separate teacher's run must give the colocated
run's per-step loss and held-out metrics to 1e-5 (float32): with one student process, with a
student of two data ranks served by one teacher process or by a teacher tensor-parallel over two
processes of its own, with both teachers separate, and after the run is stopped at step 2 and
resumed. A student in two pipeline stages takes a separate teacher's targets on its last stage
alone: pp2 with the teacher on a third process (uninterrupted, and stopped at step 2 and
resumed) gives the one-process run, as pp2 x cp2 does, and pp2 x dp2 with a teacher of two
data-parallel ranks on two processes of its own the dp2 run. The lookahead targets' several
top-k rows per chunk travel the same way (`lookahead_prefix`'s as a separate teacher's stream
alone: its groups are made on the student's side). A teacher that dies ends the student with
one line naming it.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from crossdistill.config import ParallelConfig
from tests.distributed import _harness as h

pytestmark = pytest.mark.distributed
REL = 1e-5
STEPS = 4
PP2 = {"pp": 2}
PP2_DP2 = {"pp": 2, "dp_shard": 2}
PP2_CP2 = {"pp": 2, "cp": 2, "dp_shard": 1}
TEACHER_DP2 = {"ranks": 2, "parallel": {"dp_shard": 2}}  # a group per data rank


def _train_worker(rank: int, cfg, stop_after) -> None:
    from crossdistill.train.loop import train

    train(cfg, resume=stop_after is None and _has_checkpoints(cfg), stop_after=stop_after)


def _has_checkpoints(cfg) -> bool:
    return any(Path(cfg.run.out_dir, "checkpoints").glob("step_*"))


def _run(cfg, processes: int, errors: Path, stop_after=None) -> None:
    h.spawn(_train_worker, processes, cfg, stop_after, errors=errors, group=False)


def _metrics(run: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["step"], {}).update(
            {k: v for k, v in record.items() if isinstance(v, float) and "per_s" not in k}
        )
    return out


def _assert_same(got: dict, ref: dict, where: str, floor: float = 1e-8, rel: float = REL) -> None:
    assert sorted(got) == sorted(ref), where
    for step, values in ref.items():
        for key, value in values.items():
            if key in ("lr", "target_wait") or key.startswith("time"):
                continue
            assert key in got[step], (where, step, key)
            # relative, with a floor for the near-zero KD terms of untrained models (a teacher
            # tensor-parallel over its ranks sums its vocabulary in another order)
            assert abs(got[step][key] - value) <= rel * abs(value) + floor, (
                where,
                step,
                key,
                got[step][key],
                value,
            )


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("streams")
    cfg = h.trainer_config(root, tokenizer_dir, STEPS, eval_every=2)
    cfg.train.teacher_timeout_s = 120.0
    return root, cfg


def _variant(base, name: str, separate: tuple[str, ...] = (), payload: str = "none"):
    """The base config in run folder `name`, the teachers named in `separate` on processes of
    their own."""
    root, cfg = base
    c = copy.deepcopy(cfg)
    c.run.out_dir = str(root / name)
    for t in c.teachers:
        if t.name in separate:
            t.placement, t.payload = "separate", payload
    return c


# The lookahead targets' runs take the qwen teacher's top 1024 of its 50304 tokens: the untrained
# teacher's top 16 seldom hold the observed token, so its rows after the KD position would
# hardly move the values. At 1024, the rows `lookahead_end` reads past the chunks' ends move
# the KD values by about 1e-4 of their size (ten times `REL`; at 16, not at all).
LOOKAHEAD_TOP_K = 1024
# The groups take up part of what those rows move, so at 1024 `lookahead_prefix_end`'s move its
# KD values against `lookahead_prefix` by about the check's bar below; a wider top-k gives the
# step past the end more entries to move. Its runs, and a `lookahead_prefix` run to compare them
# with, take this top-k.
PREFIX_TOP_K = 4096
PREFIX = {"target": "lookahead_prefix", "top_k": LOOKAHEAD_TOP_K}


def _lookahead_cases(target: str, pipeline: bool, top_k: int = LOOKAHEAD_TOP_K) -> list[tuple]:
    """`runs` cases of a lookahead target: colocated, separate, a teacher tensor-parallel over
    two processes of its own serving two data ranks and its colocated reference, and with
    `pipeline` a student in two stages."""
    at = {"target": target, "top_k": top_k}
    tp2 = {**at, "ranks": 2, "parallel": {"tp": 2}}
    cases = [
        (f"{target}-colocated", (), 1, None, at),
        (f"{target}-separate", ("qwen",), 2, None, at),
        (f"{target}-dp2-separate-tp2", ("qwen",), 4, None, tp2),
        (f"{target}-dp2-colocated-tp2", (), 2, None, tp2),
    ]
    if pipeline:
        cases.append((f"{target}-pp2-separate", ("qwen",), 3, None, {**at, "student": PP2}))
    return cases


@pytest.fixture(scope="module")
def runs(base):
    """Every run once (each is a few seconds of training and a process start per rank)."""
    root, _ = base
    cases = [  # (result, separate teachers, processes, stop after, settings)
        ("colocated", (), 1, None, {}),
        ("qwen-separate", ("qwen",), 2, None, {}),
        ("both-separate", ("qwen", "phi"), 3, None, {}),
        ("stopped", ("qwen",), 2, 2, {}),
        ("resumed", ("qwen",), 2, None, {}),  # the stopped run's folder, resumed
        ("int8", ("qwen",), 2, None, {"payload": "int8"}),
        ("dynamic-colocated", (), 1, None, {"mode": "dynamic"}),
        ("dynamic-separate", ("qwen", "phi"), 3, None, {"mode": "dynamic"}),
        ("dp2-colocated", (), 2, None, {}),
        ("dp2-separate", ("qwen",), 3, None, {}),
        ("dp2-separate-dp2", ("qwen",), 4, None, {"ranks": 2, "parallel": {"dp_shard": 2}}),
        ("dp2-colocated-tp2", (), 2, None, {"ranks": 2, "parallel": {"tp": 2}}),
        ("dp2-separate-tp2", ("qwen",), 4, None, {"ranks": 2, "parallel": {"tp": 2}}),
        # the student in two pipeline stages (pp2 x dp2: four student processes)
        ("pp2-separate", ("qwen",), 3, None, {"student": PP2}),
        ("pp2-stopped", ("qwen",), 3, 2, {"student": PP2}),
        ("pp2-resumed", ("qwen",), 3, None, {"student": PP2}),
        ("pp2xdp2-separate-dp2", ("qwen",), 6, None, {"student": PP2_DP2, **TEACHER_DP2}),
        # each stage context parallel over two ranks: both of the last stage's take the targets
        ("pp2xcp2-separate", ("qwen",), 5, None, {"student": PP2_CP2}),
        # the lookahead targets: D top-k rows per chunk travel (sized on both sides)
        *_lookahead_cases("lookahead", pipeline=True),
        *_lookahead_cases("lookahead_end", pipeline=False),
        # lookahead_prefix: the rows of lookahead, grouped on the student's side
        ("lookahead_prefix-colocated", (), 1, None, PREFIX),
        ("lookahead_prefix-separate", ("qwen",), 2, None, PREFIX),
        # lookahead_prefix_end (what lookahead_split refines): lookahead_end's rows, grouped
        *_lookahead_cases("lookahead_prefix_end", pipeline=True, top_k=PREFIX_TOP_K),
        ("lookahead_prefix-wide-colocated", (), 1, None, {**PREFIX, "top_k": PREFIX_TOP_K}),
    ]
    out = {}
    for i, (key, separate, processes, stop, settings) in enumerate(cases):
        folder = key.replace("resumed", "stopped")
        cfg = _variant(base, folder, separate, settings.get("payload", "none"))
        cfg.student.parallel = ParallelConfig(**settings.get("student", {}))
        cfg.train.teacher_mode = settings.get("mode", "weighted")
        # the qwen teacher on ranks of its own (or, colocated, over the student's) in a layout
        cfg.teachers[0].ranks = settings.get("ranks", 1)
        cfg.teachers[0].parallel = ParallelConfig(**settings.get("parallel", {}))
        cfg.teachers[0].target = settings.get("target", "first_piece")
        cfg.teachers[0].top_k = settings.get("top_k", cfg.teachers[0].top_k)
        _run(cfg, processes, root / f"errors{i}", stop_after=stop)
        out[key] = _metrics(Path(cfg.run.out_dir))
    return out


def test_the_colocated_run_trains_and_validates(runs):
    ref = runs["colocated"]
    assert sorted(ref) == [1, 2, 3, 4]
    assert "val/bpb/student" in ref[2] and "val/loss/kd/qwen" in ref[4]
    losses = [ref[s]["loss"] for s in (1, 2, 3, 4)]
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses, losses[1:]))


@pytest.mark.parametrize("name", ["qwen-separate", "both-separate"])
def test_separate_teachers_give_the_colocated_run(runs, name):
    _assert_same(runs[name], runs["colocated"], name)
    assert "target_wait" in runs[name][1]


@pytest.mark.parametrize(
    "name, reference",
    [("dp2-separate", "dp2-colocated"), ("dp2-separate-tp2", "dp2-colocated-tp2")],
)
def test_a_teacher_serving_two_data_ranks_gives_the_colocated_run(runs, name, reference):
    """One teacher group serves both student data ranks: on one process, or tensor-parallel
    over two of its own (its first rank sends), against the same teacher layout colocated
    (tensor parallelism sums the teacher's vocabulary in another order than one process)."""
    _assert_same(runs[name], runs[reference], name)


# the target each past-the-end target extends, at the same top-k: the rows past the ends must
# move its KD values
WITHOUT_END = {"lookahead_end": "lookahead", "lookahead_prefix_end": "lookahead_prefix-wide"}


@pytest.mark.parametrize("target", ["lookahead", "lookahead_end", "lookahead_prefix_end"])
def test_the_lookahead_targets_travel_like_the_others(runs, target):
    """Their targets hold several top-k rows per chunk: a separate teacher's stream and a
    tensor-parallel teacher serving two data ranks (which re-bases the rows to its joint batch)
    size and read them as the colocated runs do, and so does a pipeline's last stage for
    `lookahead` and `lookahead_prefix_end` (its groups built on that stage). `lookahead_end`
    reads as many rows, one of them past each chunk's end, chosen where the teacher runs: the
    separate and tensor-parallel runs check that choice. The past-the-end targets give other KD
    values than the targets they extend, so these runs exercise the rows past the ends."""
    ref = runs[f"{target}-colocated"]
    _assert_same(runs[f"{target}-separate"], ref, f"{target}-separate")
    tp2 = runs[f"{target}-dp2-separate-tp2"]
    _assert_same(tp2, runs[f"{target}-dp2-colocated-tp2"], f"{target}-tp2")
    if f"{target}-pp2-separate" in runs:
        _assert_same(runs[f"{target}-pp2-separate"], ref, f"{target}-pp2", floor=PIPELINE_FLOOR)
    if target in WITHOUT_END:
        # a run that dropped the rows past the ends would miss `_assert_same` by twice its REL
        # at some step (with the groups the untrained teacher's rows move the KD term less)
        without = runs[f"{WITHOUT_END[target]}-colocated"]
        moved = [abs(ref[s]["kd/qwen"] / without[s]["kd/qwen"] - 1) for s in ref]
        assert max(moved) > 2 * REL, moved


def test_the_lookahead_prefix_target_travels_like_lookahead(runs):
    """A separate teacher sends `lookahead_prefix` the rows it sends `lookahead`; the student
    puts the KD position's other tokens in their groups as the colocated run does, which moves
    the KD values away from `lookahead`'s."""
    ref = runs["lookahead_prefix-colocated"]
    _assert_same(runs["lookahead_prefix-separate"], ref, "lookahead_prefix-separate")
    kd, other = ref[1]["kd/qwen"], runs["lookahead-colocated"][1]["kd/qwen"]
    assert abs(kd - other) > 10 * REL * abs(other), (kd, other)


def test_a_stopped_and_resumed_run_gives_the_uninterrupted_one(runs):
    assert sorted(runs["stopped"]) == sorted(runs["pp2-stopped"]) == [1, 2]
    _assert_same(runs["resumed"], runs["colocated"], "resumed")


# float32 rounding inside a pipeline moves the near-zero KD terms of the untrained models by
# more than the floor above, whether its teachers are separate or colocated
PIPELINE_FLOOR = 1e-7


@pytest.mark.parametrize(
    "name, reference",
    [
        ("pp2-separate", "colocated"),
        ("pp2-resumed", "colocated"),
        ("pp2xdp2-separate-dp2", "dp2-colocated"),
        ("pp2xcp2-separate", "colocated"),
    ],
)
def test_a_pipeline_with_a_separate_teacher_gives_the_run_of_its_data_ranks(runs, name, reference):
    """The loss runs in the last stage, which alone receives the teacher's targets, in training
    and validation; the teacher's data-parallel groups each serve one data rank's last stage.
    pp2 gives the one-process run (also stopped at step 2 and resumed), pp2 x dp2 the run of
    the same two data ranks, pp2 x cp2 (the last stage's two context-parallel ranks each take
    the targets and score their rows) the one-process run; every logged value, `target_wait`
    the last stage's."""
    _assert_same(runs[name], runs[reference], name, floor=PIPELINE_FLOOR)
    assert "target_wait" in runs[name][1]


# ----------------------------------------------------------------------------- failures

JOB = textwrap.dedent(
    """
    import sys

    import torch

    from crossdistill.cli import run_reporting
    from crossdistill.config import load_config
    from crossdistill.train.loop import train

    torch.set_num_threads(1)
    cfg = load_config(sys.argv[1])
    sys.exit(run_reporting(lambda _: train(cfg), None))
    """
)


def test_a_teacher_that_dies_ends_the_student_with_one_line(base, tmp_path):
    """The teacher process is killed while the student trains: the student leaves within the
    timeout, saying which teacher it lost, instead of hanging."""
    import yaml

    from crossdistill.config import to_dict

    cfg = _variant(base, "dies", ("qwen",))
    cfg.run.out_dir = str(tmp_path / "dies")
    cfg.train.steps, cfg.train.eval_every, cfg.train.checkpoint_every = 1000, 1000, 1000
    cfg.train.teacher_timeout_s = 20.0
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(to_dict(cfg)))
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = str(h.free_port())
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(config)],
                env=env,
                stderr=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                text=True,
            )
        )
    metrics = Path(cfg.run.out_dir) / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert time.monotonic() < deadline and procs[0].poll() is None, "the run did not start"
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    started = time.monotonic()
    err = procs[0].communicate(timeout=120)[1]
    procs[1].wait(timeout=30)
    assert procs[0].returncode not in (0, None)
    assert time.monotonic() - started < 60
    assert "teacher 'qwen' (rank 1 of the job)" in err, err
    assert "train.teacher_timeout_s" in err
    assert "Traceback" not in err, err


def test_bad_splits_are_refused_before_loading(base):
    from crossdistill.distributed.streams import separate_ranks
    from crossdistill.errors import UserError

    cfg = _variant(base, "refused", ("qwen",))
    with pytest.raises(UserError, match="torchrun --nproc_per_node 2"):
        separate_ranks(cfg, 1)
    cfg.teachers[0].ranks = 3
    with pytest.raises(UserError, match="take 3 of the job's 3 processes"):
        separate_ranks(cfg, 3)
    assert separate_ranks(cfg, 4) == (3,)


def test_a_pipeline_takes_its_targets_on_its_last_stage(base):
    """A pipeline with a separate teacher is planned (no longer refused); the teacher sends a
    data rank's targets to that data rank's ranks in the last stage, the outermost axis."""
    from crossdistill.distributed.layout import ParallelLayout
    from crossdistill.distributed.setup import plan_layouts
    from crossdistill.distributed.streams import student_ranks_of
    from crossdistill.train.validate import validate_config

    cfg = _variant(base, "pipeline", ("qwen",))
    cfg.student.parallel = ParallelConfig(**PP2)
    res_s, res_t = validate_config(cfg)
    layouts = plan_layouts(cfg, 3, res_s.hf_config, [r.hf_config for r in res_t])
    assert layouts.student.pp == 2 and layouts.separate == [True, False]
    assert student_ranks_of(0, layouts.student) == [1]
    pp2_dp2 = ParallelLayout(dp_shard=2, pp=2)  # ranks [pp, dp]: [[0, 1], [2, 3]]
    assert [student_ranks_of(d, pp2_dp2) for d in (0, 1)] == [[2], [3]]
    assert student_ranks_of(1, ParallelLayout(dp_shard=2, tp=2)) == [2, 3]
    pp2_cp2 = ParallelLayout(dp_shard=1, cp=2, pp=2)  # ranks [pp, cp]: [[0, 1], [2, 3]]
    assert student_ranks_of(0, pp2_cp2) == [2, 3]


def test_teacher_layouts_that_do_not_fit_their_ranks_are_refused(base):
    from crossdistill.config import ParallelConfig
    from crossdistill.distributed.setup import plan_layouts
    from crossdistill.errors import UserError
    from crossdistill.train.validate import validate_config

    cfg = _variant(base, "layouts", ("qwen",))
    res_s, res_t = validate_config(cfg)
    hf = (res_s.hf_config, [r.hf_config for r in res_t])
    cfg.teachers[0].parallel = ParallelConfig(tp=2)
    with pytest.raises(UserError, match=r"teachers.0.parallel.*does not divide the world size 1"):
        plan_layouts(cfg, 3, *hf)
    cfg.teachers[0].ranks = 2
    cfg.teachers[0].parallel = ParallelConfig(dp_shard=2)
    with pytest.raises(UserError, match="its 2 data-parallel groups must divide the student's 1"):
        plan_layouts(cfg, 3, *hf)
    layouts = plan_layouts(cfg, 4, *hf)  # student dp2, teacher dp2
    assert layouts.separate == [True, False] and layouts.student.dp == 2


def test_separate_and_cache_or_offload_are_refused(base):
    from crossdistill.errors import UserError
    from crossdistill.train.validate import validate_config

    cfg = _variant(base, "cache", ("qwen",))
    cfg.teachers[0].offload = True
    with pytest.raises(UserError, match="drop teachers.0.offload"):
        validate_config(cfg)
    cfg.teachers[0].offload = False
    cfg.train.teacher_prefetch = 0
    with pytest.raises(UserError, match="train.teacher_prefetch must be >= 1"):
        validate_config(cfg)


def test_payload_size_within_a_kilobyte_per_token():
    from crossdistill.losses.payload import payload_nbytes

    tokens = 8 * 4096
    for q in ("none", "int8"):  # every student token a KD position, teacher 1.2x longer
        per_token = payload_nbytes(tokens, 64, int(tokens * 1.2), q) / tokens
        assert per_token <= 1024, (q, per_token)
    assert payload_nbytes(10, 64, 12, "int8") < payload_nbytes(10, 64, 12, "none")


def _mismatch_worker(rank: int, cfg, other_train: str) -> None:
    from crossdistill.train.loop import train

    if rank == 1:  # the teacher's process reads a corpus with one word changed
        cfg.data.train = [other_train]
    train(cfg)


def test_targets_of_another_batch_are_refused_before_the_update(base, tmp_path):
    root, _ = base
    cfg = _variant(base, "mismatch", ("qwen",))
    cfg.run.out_dir = str(tmp_path / "mismatch")
    text = Path(cfg.data.train[0]).read_text()
    assert "quick brown fox" in text
    other = tmp_path / "other.jsonl"
    other.write_text(text.replace("quick brown fox", "quick brown fix"))
    with pytest.raises(AssertionError) as failed:
        h.spawn(_mismatch_worker, 2, cfg, str(other), errors=tmp_path / "errors", group=False)
    assert "the teacher sent the targets of another batch" in str(failed.value)
    assert not list(Path(cfg.run.out_dir).glob("checkpoints/step_*"))


def test_bench_step_times_a_separate_teacher(tokenizer_dir, tmp_path):
    """`bench step --teacher-placement separate` under torchrun: the student's process reports
    its steps and the share of their time it waited for targets; without torchrun, one line
    says how to start it."""
    tok = {n: str(tokenizer_dir(n)) for n in ("llama3", "qwen3")}
    command = [
        "bench", "step", "--student-tokenizer", tok["llama3"], "--teacher", "qwen3-4b",
        "--teacher-tokenizer", tok["qwen3"], "--tiny", "--device", "cpu", "--seq-len", "128",
        "--micro-batch", "1", "--steps", "2", "--warmup", "1", "--json",
        "--teacher-placement", "separate",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launch += ["--master_port", str(h.free_port()), "-m", "crossdistill", *command]
    done = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["processes"] == 2 and result["tokens_per_s"] > 0
    assert 0 <= result["target_wait_fraction"] < 1
    alone = subprocess.run(
        [sys.executable, "-m", "crossdistill", *command], capture_output=True, text=True
    )
    assert alone.returncode == 2
    assert "torchrun --nproc_per_node 2" in alone.stderr


def test_the_link_names_how_buffers_travel():
    import torch

    from crossdistill.distributed.streams import Link

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert Link(None, None, cpu, staged=False).transport(1) == "gloo"
    assert Link(None, None, gpu, staged=False).transport(1) == "NCCL"
    shared = Link(None, None, gpu, staged=True, ipc=frozenset({2}))
    assert shared.transport(2) == "CUDA IPC (the same GPU)"
    assert shared.transport(1) == "gloo through host memory"

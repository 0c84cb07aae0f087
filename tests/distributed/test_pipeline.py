"""Pipeline-parallel students on CPU (gloo) against one process: the student's blocks split
into two stages (1F1B and GPipe schedules), with data parallelism (pp2 x dp2 on four ranks), and
with teachers laid out differently from the student (the stages share the teachers' work), and
with 3 micro-batches a step (each stage computes every target); the interleaved schedule, two
stages on each of two ranks (a student of 4 blocks), alone and with dp2; 20 optimizer steps in
float32 must give the single-process loss and gradient norm to 1e-5 relative. The student has
tied embeddings, so the first and last stage each hold the embedding and add their gradients
(and once untied: the embedding on the first stage, the lm_head on the last).

`train()` runs: a pp2 run that validates, checkpoints and exports a loadable Hugging Face
folder; a pp2 checkpoint resumed in one process and as pp2, and a one-process checkpoint
resumed as pp2, each equal to the uninterrupted run; an interleaved pp2 checkpoint resumed in
one process, equal to the uninterrupted interleaved run; and the layouts that cannot work
refused before loading.
"""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from crossdistill.config import ParallelConfig as P
from crossdistill.errors import UserError
from tests.distributed import _harness as h

pytestmark = pytest.mark.distributed
REL = 1e-5
STEPS = 20
WINDOW = 4  # micro-batches per step: two per data rank under pp2 x dp2

TWO = [
    h.Layouts("pp2", P(pp=2), [P(), P()]),
    h.Layouts("pp2_gpipe", P(pp=2, pp_schedule="GPipe"), [P(), P()]),
    # teachers laid out unlike the student: tensor parallel, and FSDP over both stages' ranks
    h.Layouts("pp2_teachers_tp2_fsdp2", P(pp=2), [P(tp=2, dp_shard=1), P(dp_shard=2)]),
]
# three micro-batches do not divide among two stages: every stage computes every target
ODD = [h.Layouts("pp2_odd_teacher_tp2", P(pp=2), [P(tp=2, dp_shard=1), P()])]
ODD_WINDOW = 3
FOUR = [
    h.Layouts("pp2xdp2", P(pp=2, dp_shard=2), [P(), P()]),
    h.Layouts("pp2xdp2_teacher_tp2", P(pp=2, dp_replicate=2, dp_shard=1), [P(tp=2), P()]),
    # each stage tensor parallel over two ranks (the tied embedding: a vocabulary shard on the
    # first and the last stage of each tensor-parallel rank)
    h.Layouts("pp2xtp2", P(pp=2, tp=2, dp_shard=1), [P(), P()]),
]
# two stages on each rank of two, interleaved: the deeper student's 4 blocks, one per stage
INTERLEAVED = P(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2)
DEEP = [
    h.Layouts("pp2_interleaved", INTERLEAVED, [P(), P()]),
    h.Layouts("pp2xdp2_interleaved", replace(INTERLEAVED, dp_shard=2), [P(), P()]),
]


def _train_cfg(cfg, out: Path, parallel: P):
    c = copy.deepcopy(cfg)
    c.student.parallel = parallel
    c.run.out_dir = str(out)
    return c


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer_dir):
    """Config, micro-batches and projections made once; the single-process reference of the
    layout cases, and one-process `train()` runs: uninterrupted, and stopped at step 2."""
    from crossdistill.train.loop import train

    root = tmp_path_factory.mktemp("pipeline")
    cfg = h.trainer_config(root, tokenizer_dir, 4, eval_every=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sc = h.prepare(cfg, STEPS * WINDOW, root / "scenario.pt")
        reference = h.run_steps(cfg, sc, STEPS, WINDOW)
        reference_odd = h.run_steps(cfg, sc, STEPS, ODD_WINDOW)
        reference_untied = h.run_steps(_untied(cfg), sc, STEPS, WINDOW)
        reference_deep = h.run_steps(_deep(cfg), sc, STEPS, WINDOW)
        train(_train_cfg(cfg, root / "one_full", P()))
        train(_train_cfg(cfg, root / "one_part", P()), stop_after=2)
    finally:
        torch.set_num_threads(threads)
    _drop_after(root / "one_part", 2)
    return root, cfg, reference, reference_odd, reference_untied, reference_deep


def _untied(cfg):
    """The student with an lm_head of its own (the last stage holds it, the first the embedding)."""
    c = copy.deepcopy(cfg)
    c.student.overrides["tie_word_embeddings"] = False
    return c


def _deep(cfg):
    """The student with 4 blocks: one for each of the interleaved pipeline's 2 x 2 stages."""
    c = copy.deepcopy(cfg)
    c.student.overrides["num_hidden_layers"] = 4
    return c


def _drop_after(run: Path, step: int) -> None:
    """Leave a run as a job killed right after its step-`step` checkpoint leaves it."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    kept = [x for x in lines if json.loads(x).get("step", 0) <= step]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")


def two_rank_worker(rank: int, cfg, root: str, out: str) -> None:
    from crossdistill.train.loop import train

    sc = torch.load(Path(root) / "scenario.pt", weights_only=False)
    results = {c.name: h.run_steps(h.with_layouts(cfg, c), sc, STEPS, WINDOW) for c in TWO}
    for c in ODD:
        results[c.name] = h.run_steps(h.with_layouts(cfg, c), sc, STEPS, ODD_WINDOW)
    results["pp2_untied"] = h.run_steps(h.with_layouts(_untied(cfg), TWO[0]), sc, STEPS, WINDOW)
    results[DEEP[0].name] = h.run_steps(h.with_layouts(_deep(cfg), DEEP[0]), sc, STEPS, WINDOW)
    pp2 = P(pp=2)
    train(_train_cfg(cfg, Path(root) / "pp_full", pp2))
    train(_train_cfg(cfg, Path(root) / "pp_part", pp2), stop_after=2)
    train(_train_cfg(cfg, Path(root) / "from_one", pp2), resume=True)
    train(_train_cfg(cfg, Path(root) / "pp_again", pp2), stop_after=2)
    train(_train_cfg(cfg, Path(root) / "pp_again", pp2), resume=True)
    train(_train_cfg(_deep(cfg), Path(root) / "interleaved_full", INTERLEAVED))
    train(_train_cfg(_deep(cfg), Path(root) / "interleaved_part", INTERLEAVED), stop_after=2)
    if rank == 0:
        torch.save(results, out)


def four_rank_worker(rank: int, cfg, root: str, out: str) -> None:
    sc = torch.load(Path(root) / "scenario.pt", weights_only=False)
    results = {c.name: h.run_steps(h.with_layouts(cfg, c), sc, STEPS, WINDOW) for c in FOUR}
    deep = DEEP[1]
    results[deep.name] = h.run_steps(h.with_layouts(_deep(cfg), deep), sc, STEPS, WINDOW)
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def two(setup):
    root, cfg = setup[:2]
    shutil.copytree(root / "one_part", root / "from_one")  # resumed as pp2 by the workers
    h.spawn(two_rank_worker, 2, cfg, str(root), str(root / "two.pt"), errors=root / "errors2")
    return torch.load(root / "two.pt", weights_only=False)


@pytest.fixture(scope="module")
def four(setup):
    root, cfg = setup[:2]
    h.spawn(four_rank_worker, 4, cfg, str(root), str(root / "four.pt"), errors=root / "errors4")
    return torch.load(root / "four.pt", weights_only=False)


def _assert_invariant(reference, got, case):
    assert len(got) == len(reference) == STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, reference), start=1):
        assert abs(loss - ref_loss) <= REL * abs(ref_loss), (case, step, loss, ref_loss)
        assert abs(norm - ref_norm) <= REL * abs(ref_norm), (case, step, norm, ref_norm)


@pytest.mark.parametrize("case", [c.name for c in TWO])
def test_two_stage_pipelines_match_one_process(setup, two, case):
    _assert_invariant(setup[2], two[case], case)


def test_uneven_micro_batches_match_one_process(setup, two):
    _assert_invariant(setup[3], two[ODD[0].name], ODD[0].name)


def test_untied_student_pipeline_matches_one_process(setup, two):
    _assert_invariant(setup[4], two["pp2_untied"], "pp2_untied")


@pytest.mark.parametrize("case", [c.name for c in FOUR])
def test_pipeline_with_data_parallel_matches_one_process(setup, four, case):
    _assert_invariant(setup[2], four[case], case)


@pytest.mark.parametrize("case", [c.name for c in DEEP])
def test_interleaved_pipelines_match_one_process(setup, two, four, case):
    _assert_invariant(setup[5], {**two, **four}[case], case)


def test_reference_moves(setup):
    """The comparison is of real training: the loss changes every step."""
    losses = [loss for loss, _ in setup[2]]
    assert all(abs(a - b) > 1e-5 for a, b in zip(losses, losses[1:]))


def _run(run: Path) -> dict[int, dict]:
    """Each step's logged values (its training and validation lines merged)."""
    steps: dict[int, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "step" in record:
            steps.setdefault(record["step"], {}).update(record)
    return steps


def _close(a: dict, b: dict, key: str) -> None:
    for step in sorted(b):
        if key in b[step]:
            assert abs(a[step][key] - b[step][key]) <= REL * abs(b[step][key]), (step, key)


def test_pipeline_train_run_validates_checkpoints_and_exports(setup, two):
    """pp2 `train()`: the one-process run's losses, held-out bits per byte and a Hugging Face
    folder that loads and gives the one-process run's weights."""
    assert_run_matches_one_process(setup[0], "pp_full")


def assert_run_matches_one_process(root: Path, name: str) -> None:
    """The `train()` run in `root / name` against the one-process run `root / "one_full"`:
    losses and held-out bits per byte step by step, a step-2 checkpoint, and an exported folder
    that loads and holds the same weights."""
    from transformers import AutoModelForCausalLM

    got, one = _run(root / name), _run(root / "one_full")
    assert sorted(s for s in got if "loss" in got[s]) == [1, 2, 3, 4]
    _close(got, one, "loss")
    _close(got, one, "val/bpb/student")
    assert (root / name / "checkpoints" / "step_000002" / "dcp" / ".metadata").is_file()
    a = AutoModelForCausalLM.from_pretrained(root / name / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(root / "one_full" / "final").state_dict()
    assert a.keys() == b.keys()
    for key in b:
        # four AdamW steps apart from float32 rounding: within 1e-4 of the tensor's scale
        assert (a[key] - b[key]).abs().max() <= 1e-4 * b[key].abs().max(), key


def test_one_process_checkpoint_resumes_as_pipeline(setup, two):
    root = setup[0]
    resumed, one = _run(root / "from_one"), _run(root / "one_full")
    assert sorted(s for s in resumed if "loss" in resumed[s]) == [1, 2, 3, 4]
    _close(resumed, one, "loss")


def test_pipeline_checkpoint_resumes_as_pipeline(setup, two):
    """Each stage's optimizer groups come back (a checkpoint's groups name every stage's
    parameters): the resumed pp2 run gives the uninterrupted one."""
    root = setup[0]
    resumed, uninterrupted = _run(root / "pp_again"), _run(root / "pp_full")
    assert sorted(s for s in resumed if "loss" in resumed[s]) == [1, 2, 3, 4]
    _close(resumed, uninterrupted, "loss")
    _close(resumed, uninterrupted, "val/bpb/student")


@pytest.mark.parametrize(
    ("part", "full"), [("pp_part", "one_full"), ("interleaved_part", "interleaved_full")]
)
def test_pipeline_checkpoint_resumes_in_one_process(setup, two, part, full):
    """A pp2 checkpoint against the one-process run; an interleaved one (the deeper student)
    against the interleaved run, itself equal to one process (the cases above)."""
    from crossdistill.train.loop import train

    root, cfg = setup[:2]
    _drop_after(root / part, 2)
    student = _deep(cfg) if part.startswith("interleaved") else cfg
    train(_train_cfg(student, root / part, P()), resume=True)
    resumed, uninterrupted = _run(root / part), _run(root / full)
    assert sorted(s for s in resumed if "loss" in resumed[s]) == [1, 2, 3, 4]
    _close(resumed, uninterrupted, "loss")
    _close(resumed, uninterrupted, "val/bpb/student")


def test_stages_balance_blocks_against_the_lm_head():
    from crossdistill.distributed.stages import stage_blocks

    def sizes(*args):
        split = stage_blocks(*args)
        assert [i for r in split for i in r] == list(range(args[0]))  # contiguous, all blocks
        return [len(r) for r in split]

    assert sizes(16, 2, 0.0) == [8, 8]
    assert sizes(7, 3, 0.0) == [3, 2, 2]
    # a Llama-3.2-1B: the lm_head weighs 4.3 blocks, so the last stage takes 6 of the 16
    assert sizes(16, 2, 4.3) == [10, 6]
    assert sizes(16, 4, 4.3) == [5, 5, 5, 1]
    assert sizes(2, 2, 50.0) == [1, 1]  # every stage keeps a block
    # pp2 with 2 stages per rank: 4 stages, rank 0 runs the first and third, rank 1 the
    # second and the last (with the lm_head)
    assert sizes(16, 4, 4.3) == [5, 5, 5, 1]
    assert sizes(9, 6, 0.0) == [2, 2, 2, 1, 1, 1]


def test_a_rank_holds_its_stages_and_runs_one_at_a_time():
    """pp2 with 2 stages per rank, one process: each rank's cut keeps the blocks of stages r and
    r + 2 under their names; running the four stages in order, each on its rank's cut, gives
    the whole model's final hidden states (the embedding in stage 0 only, the final norm in
    stage 3 only)."""
    from crossdistill.distributed.pipeline import StudentStage
    from crossdistill.distributed.stages import keep_stages, rank_stages
    from crossdistill.models.forward import HeldElsewhere, decoder_of, final_hidden
    from crossdistill.models.loading import build_causal_lm

    def model():
        return build_causal_lm(None, "tiny-llama", overrides={"num_hidden_layers": 4}, seed=0)

    whole, cuts = model(), [model(), model()]
    for rank, cut in enumerate(cuts):
        keep_stages(cut, rank, 2, 2)
    assert [rank_stages(r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    kept = [[not isinstance(b, HeldElsewhere) for b in decoder_of(c).layers] for c in cuts]
    assert kept == [[True, False, True, False], [False, True, False, True]]
    names = set(whole.state_dict())
    assert all(set(c.state_dict()) <= names for c in cuts)
    assert "model.norm.weight" not in cuts[0].state_dict()
    assert "model.norm.weight" in cuts[1].state_dict()

    ids = torch.randint(0, 512, (2, 16))
    pos = torch.arange(16).repeat(2, 1)
    x = ids
    for stage in range(4):
        x = StudentStage(cuts[stage % 2], stage, [(pos, None)], torch.float32)(x, torch.zeros(1))
    with torch.no_grad():
        assert torch.allclose(x, final_hidden(whole, ids, pos), atol=1e-5)


def test_bad_pipeline_layouts_are_refused_before_loading(setup):
    from crossdistill.distributed.setup import plan_layouts
    from crossdistill.train.validate import validate_config

    cfg = setup[1]
    res_s, res_t = validate_config(cfg)
    hf_t = [r.hf_config for r in res_t]
    blocks = res_s.hf_config.num_hidden_layers

    def refused(
        world: int, parallel: P, grad_accum: int = 4, teacher: P | None = None, hf_s=None
    ) -> str:
        c = copy.deepcopy(cfg)
        c.student.parallel, c.train.grad_accum = parallel, grad_accum
        if teacher is not None:
            c.teachers[0].parallel = teacher
        with pytest.raises(UserError) as e:
            plan_layouts(c, world, hf_s or res_s.hf_config, hf_t)
        return str(e.value)

    big = blocks + 1
    assert f"pp = {big} is larger than the model's {blocks} blocks" in refused(big, P(pp=big))
    assert "need at least 2 micro-batches" in refused(2, P(pp=2), grad_accum=1)
    assert "train.grad_accum = 1" in refused(2, P(pp=2), grad_accum=1)
    assert "= 6, but the job has 4 processes" in refused(4, P(pp=2, dp_shard=3))
    assert "does not divide the world size 3" in refused(3, P(pp=2))
    assert "teachers.0.parallel.pp = 2" in refused(2, P(pp=2), teacher=P(pp=2, dp_shard=1))
    # interleaved: 2 x 2 stages, more than the student's blocks; a deeper student takes them
    assert blocks < 4
    stages = f"pp x pp_stages_per_rank = 2 x 2 = 4 is larger than the model's {blocks} blocks"
    assert stages in refused(2, INTERLEAVED)
    deep = copy.deepcopy(res_s.hf_config)
    deep.num_hidden_layers = 4
    rounds = "in train.grad_accum // pp = 5 // 2 = 2 rounds of equal size"
    assert rounds in refused(2, INTERLEAVED, 5, hf_s=deep)
    assert "need at least 2 micro-batches" in refused(2, INTERLEAVED, 1, hf_s=deep)
    one = replace(INTERLEAVED, pp_stages_per_rank=1)
    assert "pp_stages_per_rank = 1; set pp_stages_per_rank >= 2" in refused(2, one)
    several = P(pp=2, pp_stages_per_rank=2)
    assert "with pp_schedule = 1F1B, which runs one stage per rank" in refused(2, several)
    # on GPUs the default teacher layout is decided by its size (tests/unit/test_teacher_layout)
    on_gpus = plan_layouts(cfg, 2, res_s.hf_config, hf_t, device_bytes=80 * 2**30)
    assert [t.dp_replicate for t in on_gpus.teachers] == [2, 2]  # tiny teachers: replicated
    assert [t.dp_shard for t in plan_layouts(cfg, 2, res_s.hf_config, hf_t).teachers] == [2, 2]
    kept = refused(2, P(), teacher=P(reshard_after_forward=False))
    assert "teachers.0.parallel.reshard_after_forward = false" in kept

"""The lookahead targets with a student split over two gloo ranks, against one process.

The scenario of `test_parallel.py` (tiny Llama student, Qwen3 and Phi-3 teachers, real
tokenizers, float32), its Qwen3 teacher on `target: lookahead_end` at top 1024: the untrained
teacher's top 16 seldom hold the observed token, so the rows past each chunk's end would hardly
move the loss (as in `test_streams.py`). Even at 1024 whether they move the KD term at all
depends on the batch (a window of micro-batches in which no chunk reaches a top-k entry past
its end leaves it unchanged), so the layouts train from the window, of the first `SCAN`, where
they move it most; there by more than twice `KD_REL` of its size (checked below) but the whole
loss by less than `REL`, so the KD term is compared on its own as well.
A tensor-parallel student scores the lookahead buckets vocabulary-sharded, a context-parallel
one its own rows; with the teachers tensor- or context-parallel as the student, and whole on
each rank (the two ranks share the teachers' work), each must give the one-process loss and
gradient norm to 1e-5 relative for 3 optimizer steps, and the KD term to `KD_REL_FIRST` at
the first step (the same weights) and to `KD_REL` after it.
`lookahead_prefix` and `lookahead_prefix_end` (the KD position's other tokens in byte-prefix
groups, scored on the unfused path) run on the context-parallel layout alone: a tensor-parallel
student is refused with them (`tests/unit/test_lookahead_prefix.py`).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.distributed import _harness as h
from tests.distributed import _workers as w

pytestmark = pytest.mark.distributed
REL = 1e-5
# After the first step the float32 rounding of a split student's update moves the small KD
# term of the untrained models by more than REL of its size, on any target (the first piece's
# too); the rows past the chunks' ends move it by more than twice this.
KD_REL = 1e-4
# The KD term of the untrained models is a small difference of log-probabilities, far smaller
# than the loss, so float32 rounding is a larger share of it than of the loss even at the first
# step; this is still a quarter of the smallest past-end effect accepted (2 × KD_REL).
KD_REL_FIRST = 5e-5
TOP_K = 1024
SCAN = 4  # windows of the scenario searched for the one where the past-end rows move KD most
KD = ("kd/qwen",)
NAMES = ("tp2", "cp2", "tp2_teachers_whole", "cp2_teachers_whole")
CASES = [c for c in w.TWO_RANKS if c.name in NAMES]
PREFIX_CASES = [c for c in w.TWO_RANKS if c.name == "cp2"]


def _config(root, tokenizer_dir, target: str):
    """The scenario's config under `root`, its Qwen3 teacher on `target` at `TOP_K`, with its
    projections built."""
    from crossdistill.alignment.projection import build_projection
    from crossdistill.models import load_tokenizer

    toks = {n: str(tokenizer_dir(n)) for n in ("llama2", "gpt2", "mistral")}
    cfg = h.scenario_config(toks, h.write_corpus(root / "data"), root / "run")
    cfg.teachers[0].target, cfg.teachers[0].top_k = target, TOP_K
    tok_s = load_tokenizer(cfg.student.tokenizer)
    for t in cfg.teachers:
        t.projection = str(root / f"{t.name}.projection.safetensors")
        build_projection(load_tokenizer(t.tokenizer), tok_s).save(t.projection)
    return cfg


def _one_process(cfg, sc, steps: int = h.STEPS):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return h.run_steps(cfg, sc, steps=steps, extra=KD)
    finally:
        torch.set_num_threads(threads)


def _two_ranks(cfg, root, cases):
    out = root / "two.pt"
    args = (cfg, str(root / "scenario.pt"), cases, str(out), KD)
    h.spawn(h.layouts_worker, 2, *args, errors=root / "errors")
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    """The one-process references of `lookahead_end` and `lookahead`, and every case's run of
    `lookahead_end` on two ranks."""
    root = tmp_path_factory.mktemp("lookahead_layouts")
    cfg = _config(root, tokenizer_dir, "lookahead_end")
    lookahead = copy.deepcopy(cfg)
    lookahead.teachers[0].target = "lookahead"
    path = root / "scenario.pt"
    sc, other = _from_the_window_moved_most(
        cfg, lookahead, h.prepare(cfg, SCAN * h.WINDOW, path), path
    )
    reference = _one_process(cfg, sc)
    return reference, other, _two_ranks(cfg, root, CASES)


def _from_the_window_moved_most(cfg, other, sc: h.Scenario, path) -> tuple[h.Scenario, list]:
    """`sc` with its windows rotated so that it starts from the one where the first step's KD
    term under `cfg` differs most from that under `other`, saved to `path` for the ranks; and
    `other`'s first step on it."""
    tries = []
    for start in range(0, len(sc.batches), h.WINDOW):
        one = h.Scenario(sc.batches[start:] + sc.batches[:start], sc.projections)
        kd = _one_process(cfg, one, steps=1)[0][2]
        first_other = _one_process(other, one, steps=1)
        kd_other = first_other[0][2]
        tries.append((abs(kd - kd_other) / abs(kd_other), one, first_other))
    _, best, first_other = max(tries, key=lambda t: t[0])
    torch.save(best, path)
    return best, first_other


@pytest.fixture(
    scope="module", params=["lookahead_prefix", "lookahead_prefix_end", "lookahead_mix"]
)
def prefix_runs(request, tmp_path_factory, tokenizer_dir):
    """The one-process references of a prefix-group target and of `lookahead` (the same
    projection without its groups), and the target's cp2 run."""
    root = tmp_path_factory.mktemp(f"{request.param}_layouts")
    cfg = _config(root, tokenizer_dir, request.param)
    sc = h.prepare(cfg, h.STEPS * h.WINDOW, root / "scenario.pt")
    assert sc.projections["qwen"].groups is not None
    lookahead = copy.deepcopy(cfg)
    lookahead.teachers[0].target = "lookahead"
    plain = dataclasses.replace(sc.projections["qwen"], groups=None)
    plain_sc = h.Scenario(sc.batches, {**sc.projections, "qwen": plain})
    reference = _one_process(cfg, sc)
    other = _one_process(lookahead, plain_sc, steps=1)
    return reference, other, _two_ranks(cfg, root, PREFIX_CASES)


def _assert_matches(got: list, reference: list, case: str) -> None:
    """`got` gives `reference`'s loss and norm to `REL` at every step, its KD term to
    `KD_REL_FIRST` at the first step and to `KD_REL` after it."""
    assert len(got) == len(reference) == h.STEPS
    for step, (values, ref) in enumerate(zip(got, reference), start=1):
        for name, value, ref_value in zip(("loss", "norm", *KD), values, ref):
            rel = (KD_REL if step > 1 else KD_REL_FIRST) if name in KD else REL
            assert abs(value - ref_value) <= rel * abs(ref_value), (
                case,
                step,
                name,
                value,
                ref_value,
            )


def test_the_rows_past_the_chunks_end_move_the_kd_term(runs):
    reference, other, _ = runs
    kd, kd_other = reference[0][2], other[0][2]
    assert abs(kd - kd_other) > 2 * KD_REL * abs(kd_other), (kd, kd_other)


@pytest.mark.parametrize("case", NAMES)
def test_a_split_student_on_lookahead_end_matches_one_process(runs, case):
    reference, _, got = runs
    _assert_matches(got[case], reference, case)


def test_a_context_parallel_student_on_the_prefix_targets_matches_one_process(prefix_runs):
    """Each of the two ranks scores its own rows' grouped buckets (the groups span the whole
    vocabulary, which every rank holds): the one-process loss, norm and KD term. The groups
    move the first step's KD term from `lookahead`'s by more than twice `KD_REL` of its size,
    so a run that lost them would not match."""
    reference, other, got = prefix_runs
    kd, kd_other = reference[0][2], other[0][2]
    assert abs(kd - kd_other) > 2 * KD_REL * abs(kd_other), (kd, kd_other)
    _assert_matches(got["cp2"], reference, "cp2")

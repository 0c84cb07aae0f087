"""The `lookahead_end` target with a student split over two gloo ranks, against one process.

The scenario of `test_parallel.py` (tiny Llama student, Qwen3 and Phi-3 teachers, real
tokenizers, float32), its Qwen3 teacher on `target: lookahead_end` at top 1024: the untrained
teacher's top 16 seldom hold the observed token, so the rows past each chunk's end would hardly
move the loss (as in `test_streams.py`). At 1024 they move the Qwen3 KD term by more than twice
`KD_REL` of its size (checked below) but the whole loss by less than `REL`, so the KD term is
compared on its own as well.
A tensor-parallel student scores the lookahead buckets vocabulary-sharded, a context-parallel
one its own rows; with the teachers tensor- or context-parallel as the student, and whole on
each rank (the two ranks share the teachers' work), each must give the one-process loss and
gradient norm to 1e-5 relative for 3 optimizer steps, and the KD term to 1e-5 at the first
step (the same weights) and to `KD_REL` after it.
"""

from __future__ import annotations

import copy

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
TOP_K = 1024
KD = ("kd/qwen",)
NAMES = ("tp2", "cp2", "tp2_teachers_whole", "cp2_teachers_whole")
CASES = [c for c in w.TWO_RANKS if c.name in NAMES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_dir):
    """The one-process references of `lookahead_end` and `lookahead`, and every case's run of
    `lookahead_end` on two ranks."""
    from crossdistill.alignment.projection import build_projection
    from crossdistill.models import load_tokenizer

    root = tmp_path_factory.mktemp("lookahead_layouts")
    toks = {n: str(tokenizer_dir(n)) for n in ("llama2", "gpt2", "mistral")}
    cfg = h.scenario_config(toks, h.write_corpus(root / "data"), root / "run")
    cfg.teachers[0].target, cfg.teachers[0].top_k = "lookahead_end", TOP_K
    tok_s = load_tokenizer(cfg.student.tokenizer)
    for t in cfg.teachers:
        t.projection = str(root / f"{t.name}.projection.safetensors")
        build_projection(load_tokenizer(t.tokenizer), tok_s).save(t.projection)
    lookahead = copy.deepcopy(cfg)
    lookahead.teachers[0].target = "lookahead"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sc = h.prepare(cfg, h.STEPS * h.WINDOW, root / "scenario.pt")
        reference = h.run_steps(cfg, sc, extra=KD)
        other = h.run_steps(lookahead, sc, steps=1, extra=KD)
    finally:
        torch.set_num_threads(threads)
    out = root / "two.pt"
    args = (cfg, str(root / "scenario.pt"), CASES, str(out), KD)
    h.spawn(h.layouts_worker, 2, *args, errors=root / "errors")
    return reference, other, torch.load(out, weights_only=False)


def test_the_rows_past_the_chunks_end_move_the_kd_term(runs):
    reference, other, _ = runs
    kd, kd_other = reference[0][2], other[0][2]
    assert abs(kd - kd_other) > 2 * KD_REL * abs(kd_other), (kd, kd_other)


@pytest.mark.parametrize("case", NAMES)
def test_a_split_student_on_lookahead_end_matches_one_process(runs, case):
    reference, _, got = runs
    assert len(got[case]) == len(reference) == h.STEPS
    for step, (values, ref) in enumerate(zip(got[case], reference), start=1):
        for name, value, ref_value in zip(("loss", "norm", *KD), values, ref):
            rel = KD_REL if name in KD and step > 1 else REL
            assert abs(value - ref_value) <= rel * abs(ref_value), (
                case,
                step,
                name,
                value,
                ref_value,
            )

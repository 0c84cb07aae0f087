"""Parallelism invariance on CPU: gloo process groups of 2 and 4 ranks against one process.

Two spawns serve the whole file (each process start costs seconds): 2 ranks run the loss-level
checks (vocab-parallel loss and targets, context-parallel row sharding), the layouts dp2,
fsdp2, tp2, cp2, teacher tp2 with student dp2, and tp2 and cp2 students whose teachers run whole
on each rank (the two ranks share the teachers' work), sharded loading, and two `train()` runs
(FSDP, sharded checkpoints); 4 ranks run tp2 x dp2 and resume the 2-rank checkpoint as
tp2 x dp2. Tiny real-architecture models in float32 with real tokenizers; every layout must give
the single-process loss and gradient norm to 1e-5 relative for 3 optimizer steps.

Context parallelism: attention gathers keys and values over the group and applies the
packed-document causal mask of its own rows (`crossdistill/distributed/cp.py`), which runs on
gloo as on NCCL, so the cp2 case here covers the whole model: sharding, the next-token shift
across piece edges, the mask, and loss normalisation by global counts. PyTorch's CUDA-only
ring attention (`torch.distributed.tensor.experimental.context_parallel`) is not used: it takes
no document mask. The bf16 runs on 2 GPUs are recorded in `benchmarks/results/distributed.md`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.distributed import _harness as h
from tests.distributed import _workers as w

pytestmark = pytest.mark.distributed
REL = 1e-5


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer_dir):
    """Config, micro-batches, projections and checkpoints, made once in this process, plus the
    single-process reference of every layout case."""
    from crossdistill.alignment.projection import build_projection
    from crossdistill.models import build_causal_lm, load_tokenizer

    root = tmp_path_factory.mktemp("dist")
    toks = {n: str(tokenizer_dir(n)) for n in ("llama2", "gpt2", "mistral")}
    cfg = h.scenario_config(toks, h.write_corpus(root / "data"), root / "run")
    tok_s = load_tokenizer(cfg.student.tokenizer)
    for t in cfg.teachers:  # built once; train() runs load them
        t.projection = str(root / f"{t.name}.projection.safetensors")
        build_projection(load_tokenizer(t.tokenizer), tok_s).save(t.projection)
    cfg.train.steps, cfg.train.grad_accum = 3, 1
    cfg.train.eval_every, cfg.train.eval_batches, cfg.train.log_every = 3, 1, 1
    cfg.train.checkpoint_every = 2
    paths = {"scenario": str(root / "scenario.pt"), "full": str(root / "full")}
    paths["part"] = str(root / "part")
    for arch in ("phi3", "qwen3"):  # fused + untied, and tied embeddings
        paths[arch] = str(root / arch)
        build_causal_lm(arch=f"tiny-{arch}", seed=5).save_pretrained(paths[arch])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sc = h.prepare(cfg, h.STEPS * h.WINDOW, root / "scenario.pt")
        reference = h.run_steps(cfg, sc)
    finally:
        torch.set_num_threads(threads)
    return root, cfg, paths, reference


@pytest.fixture(scope="module")
def two(setup):
    root, cfg, paths, _ = setup
    h.spawn(w.two_rank_worker, 2, cfg, paths, str(root / "two.pt"), errors=root / "errors2")
    # a copy of the interrupted run, to resume in one process below
    shutil.copytree(paths["part"], root / "part1")
    return torch.load(root / "two.pt", weights_only=False)


@pytest.fixture(scope="module")
def four(setup, two):
    root, cfg, paths, _ = setup
    h.spawn(w.four_rank_worker, 4, cfg, paths, str(root / "four.pt"), errors=root / "errors4")
    return torch.load(root / "four.pt", weights_only=False)


def _assert_invariant(reference, got, case):
    assert len(got) == len(reference) == h.STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, reference), start=1):
        assert abs(loss - ref_loss) <= REL * abs(ref_loss), (case, step, loss, ref_loss)
        assert abs(norm - ref_norm) <= REL * abs(ref_norm), (case, step, norm, ref_norm)


@pytest.mark.parametrize("case", [c.name for c in w.TWO_RANKS])
def test_two_rank_layouts_match_one_process(setup, two, case):
    _assert_invariant(setup[3], two["layouts"][case], case)


def test_tp2_x_dp2_on_four_ranks_matches_one_process(setup, four):
    _assert_invariant(setup[3], four["layouts"]["tp2xdp2"], "tp2xdp2")


def test_training_moves_the_loss(setup):
    """The invariance above compares real training: the reference loss changes every step."""
    losses = [loss for loss, _ in setup[3]]
    assert all(abs(a - b) > 1e-4 for a, b in zip(losses, losses[1:]))


def test_vocab_parallel_loss_and_targets_match_one_device(two):
    tp = {k: v for k, v in two["loss"].items() if k.startswith(("tp/", "targets/"))}
    assert len(tp) >= 8 * 2 * 8
    assert {"tp/forward_kl/1.0/ce_full/loss", "tp/chunk_likelihood/1.0/ce_full/grad_w"} <= set(tp)
    bad = {k: v for k, v in tp.items() if not v <= 1e-10}
    assert not bad, bad


def test_context_parallel_loss_matches_one_device(two):
    cp = {k: v for k, v in two["loss"].items() if k.startswith("cp/")}
    assert len(cp) >= 8 * 8
    assert {"cp/forward_kl/ce_full/loss", "cp/chunk_likelihood/ce_full/grad_h"} <= set(cp)
    bad = {k: v for k, v in cp.items() if not v <= 1e-10}
    assert not bad, bad


def test_sharded_loading_reads_each_rank_its_half(two):
    loading = two["loading"]
    for model in ("phi3", "qwen3"):
        for lay in ("fsdp2", "tp2"):
            key = f"{model}/{lay}"
            assert loading[f"{key}/weights"] == 0.0, key
            assert loading[f"{key}/hidden"] <= 1e-5, key
            # norms and (under tp) the embedding replicas are small: about half per rank
            assert 0.45 <= loading[f"{key}/share"] <= 0.6, (key, loading[f"{key}/share"])


def test_validation_of_two_data_parallel_ranks_equals_one_process(setup, two):
    """The same held-out numbers with the student and teachers sharded over 2 ranks, each rank
    evaluating its share of the validation batches, as in one process."""
    import copy

    root, cfg, paths, _ = setup
    one = w.held_out_metrics(copy.deepcopy(cfg))
    got = two["validation"]
    assert sorted(got) == sorted(one) and "val/bpb/student" in one
    for key, value in one.items():
        assert abs(got[key] - value) <= REL * abs(value), (key, got[key], value)


def _losses(run) -> dict[int, float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def test_fsdp_training_run_checkpoints_and_exports(setup, two):
    root, cfg, paths, _ = setup
    from pathlib import Path

    full = Path(paths["full"])
    assert sorted(_losses(full)) == [1, 2, 3]
    ckpt = full / "checkpoints" / "step_000002"
    assert (ckpt / "dcp" / ".metadata").is_file()
    assert sorted(p.name for p in ckpt.glob("data_*.pt")) == ["data_00000.pt", "data_00001.pt"]
    assert json.loads((ckpt / "meta.json").read_text())["format"] == "dcp"
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(full / "final")
    ids = torch.randint(0, 32000, (1, 12))
    assert torch.isfinite(model(ids).logits).all()
    assert (full / "final" / "tokenizer.json").is_file()


def test_resume_on_four_ranks_in_another_layout_continues_the_run(setup, four):
    """fsdp2 on 2 ranks, checkpoint at step 2, resumed as tp2 x dp2 on 4 ranks: the data-parallel
    size is 2 in both, so the loader resumes exactly and step 3 matches the uninterrupted run."""
    from pathlib import Path

    root, cfg, paths, _ = setup
    full, part = _losses(Path(paths["full"])), _losses(Path(paths["part"]))
    assert sorted(part) == [1, 2, 3]
    for step in (1, 2, 3):
        assert abs(part[step] - full[step]) <= REL * abs(full[step]), (step, part, full)


def test_resharded_checkpoint_loads_exactly_in_one_process(setup, four):
    """The 2-rank checkpoint loaded on 4 ranks as tp2 x dp2 and in one process: the same
    tensors, bit for bit, and the optimizer state is there."""
    from pathlib import Path

    from crossdistill.models import build_causal_lm
    from crossdistill.models.loading import parse_dtype
    from crossdistill.train.optim import build_optimizer

    root, cfg, paths, _ = setup
    s = cfg.student
    model = build_causal_lm(arch=s.arch, dtype=parse_dtype(s.dtype), overrides=s.overrides)
    optimizer = build_optimizer(model, cfg.optim)
    folder = Path(paths["part"]).parent / "part1" / "checkpoints" / "step_000002"
    step = w.load_student(folder, model, optimizer)
    other = four["resharded"]
    assert step == 2 and int(other["_step"]) == 2
    assert int(other["_optimizer_steps"]) > 0 and len(optimizer.state) > 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, other[key]), key


def test_single_process_resumes_a_sharded_checkpoint(setup, two):
    """World size 2 -> 1: the run goes on from step 2 (its data stream restarts, with a
    warning, since the number of data-parallel readers changed) and exports."""
    import copy

    from crossdistill.train.loop import train

    root, cfg, paths, _ = setup
    c = copy.deepcopy(cfg)
    c.run.out_dir = str(root / "part1")
    train(c, resume=True)
    losses = _losses(root / "part1")
    assert sorted(losses) == [1, 2, 3]
    assert (root / "part1" / "final" / "model.safetensors").is_file()

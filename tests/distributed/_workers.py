"""What the gloo worker processes run (importable by `torch.multiprocessing.spawn`).

Each worker returns plain numbers (relative errors, losses); rank 0 saves them and the tests in
`test_parallel.py` assert on them. Errors are maxima over all ranks."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from crossdistill.config import ModelConfig
from crossdistill.config import ParallelConfig as P
from tests.distributed._harness import Layouts, run_steps, with_layouts

# layouts over 2 ranks: (student, teachers). The cp2 case also recomputes the student's
# activations in backward (activation checkpointing reads the same per-forward attention mask).
TWO_RANKS = [
    Layouts("dp2", P(dp_replicate=2, dp_shard=1), [P(dp_replicate=2, dp_shard=1)] * 2),
    Layouts("fsdp2", P(dp_shard=2), [P(dp_shard=2)] * 2),
    Layouts("tp2", P(tp=2, dp_shard=1), [P(tp=2, dp_shard=1)] * 2),
    Layouts("cp2", P(cp=2, dp_shard=1), [P(cp=2, dp_shard=1)] * 2, activation_checkpointing=True),
    Layouts("teacher_tp2_student_dp2", P(dp_shard=2), [P(tp=2, dp_shard=1)] * 2),
    # teachers whole on each rank: the two ranks of a tensor- or context-parallel student read
    # the same batch and share the teachers' work (`distributed/share.py`)
    Layouts("tp2_teachers_whole", P(tp=2, dp_shard=1), [P(dp_replicate=2, dp_shard=1)] * 2),
    Layouts("cp2_teachers_whole", P(cp=2, dp_shard=1), [P(dp_replicate=2, dp_shard=1)] * 2),
]
FOUR_RANKS = [
    Layouts("tp2xdp2", P(tp=2, dp_shard=2), [P(tp=2, dp_shard=2)] * 2),
]


def _max_over_ranks(errors: dict[str, float]) -> dict[str, float]:
    keys = sorted(errors)
    t = torch.tensor([errors[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(keys, t.tolist()))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    if not bool(torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("inf")
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


# ----------------------------------------------------------------------------- losses


def _random_chunks(batch: int, len_s: int, len_t: int, gen: torch.Generator) -> torch.Tensor:
    """Chunk alignments `[C, 4]` over flattened rows: each sequence cut into spans of 1-3 tokens
    on both sides, so chunks straddle any cut of the sequence."""
    out = []
    for b in range(batch):
        s = t = 0
        while s < len_s and t < len_t:
            ds = int(torch.randint(1, 4, (1,), generator=gen))
            dt = int(torch.randint(1, 4, (1,), generator=gen))
            ds, dt = min(ds, len_s - s), min(dt, len_t - t)
            out.append([b * len_s + s, b * len_s + s + ds, b * len_t + t, b * len_t + t + dt])
            s, t = s + ds, t + dt
    return torch.tensor(out)


def _loss_inputs(loss: str, tau: float):
    """A random float64 problem with cross-tokenizer chunks (the same on every rank)."""
    from crossdistill.losses import KDTerm, VocabProjection, kd_positions, teacher_targets

    gen = torch.Generator().manual_seed(7)
    v_s, v_t, hid, batch, len_s, len_t = 97, 131, 12, 2, 16, 20
    h = torch.randn(batch * len_s, hid, dtype=torch.float64, generator=gen)
    w = torch.randn(v_s, hid, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, v_s, (batch * len_s,), generator=gen)
    labels[torch.rand(batch * len_s, generator=gen) < 0.15] = -100
    h_t = torch.randn(batch * len_t, hid, dtype=torch.float64, generator=gen)
    w_t = torch.randn(v_t, hid, dtype=torch.float64, generator=gen)
    next_t = torch.randint(0, v_t, (batch * len_t,), generator=gen)
    chunks = _random_chunks(batch, len_s, len_t, gen)
    first = torch.randint(-1, v_s, (v_t,), generator=gen)
    proj = VocabProjection.from_first_piece(first, v_s, exact=torch.rand(v_t, generator=gen) < 0.6)
    _, kd_t = kd_positions(chunks)
    targets = teacher_targets(h_t, w_t, kd_t, next_t, top_k=8, temperature=tau, chunk_size=7)
    term = KDTerm(
        targets, proj, chunks, torch.tensor(23.0, dtype=torch.float64), loss=loss, weight=0.7
    )
    # hkl's one-to-one pairs: 80 teacher tokens, each with a student token of its own
    proj.matched = torch.full((v_t,), -1, dtype=torch.long)
    paired = torch.randperm(v_t, generator=gen)[:80]
    proj.matched[paired] = torch.randperm(v_s, generator=gen)[:80]
    return h, w, labels, term, (h_t, w_t, kd_t, next_t)


LOSSES = [
    "forward_kl",
    "reverse_kl",
    "jsd",
    "skew_kl",
    "tvd",
    "gold",
    "hkl",
    "uld",
    "chunk_likelihood",
]
METRICS = ["ce", "kd/teacher", "top1/teacher", "nll_s/teacher", "nll_t/teacher"]


# the losses also checked under train.ce_without_kd "full" (KD at one row, at a chunk's rows)
FULL_CE_LOSSES = ["forward_kl", "chunk_likelihood"]


def _reference(h, w, labels, term, ce_without_kd="ratio"):
    from crossdistill.losses import student_loss

    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, m = student_loss(
        h, w, labels, [term], kd_ratio=0.6, ce_denominator=31.0, chunk_size=9,
        ce_without_kd=ce_without_kd,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), m, h.grad, w.grad


def vocab_parallel_errors() -> dict[str, float]:
    """The vocab-parallel student loss and teacher targets against one device, every loss."""
    from crossdistill.distributed.vocab import vocab_shard
    from crossdistill.losses import student_loss, teacher_targets

    errors = {}
    cases = [(name, tau, "ratio") for name in LOSSES for tau in (1.0, 2.0)]
    cases += [(name, 1.0, "full") for name in FULL_CE_LOSSES]
    for loss_name, tau, ce_mode in cases:
        h, w, labels, term, (h_t, w_t, kd_t, next_t) = _loss_inputs(loss_name, tau)
        ref_loss, ref_m, ref_gh, ref_gw = _reference(h, w, labels, term, ce_mode)
        shard = vocab_shard(w.shape[0], dist.group.WORLD)
        cols = slice(shard.start, shard.start + shard.size)
        h2, w2 = h.clone().requires_grad_(), w[cols].clone().requires_grad_()
        loss, m = student_loss(
            h2, w2, labels, [term], kd_ratio=0.6, ce_denominator=31.0, chunk_size=9,
            vocab=shard, ce_without_kd=ce_mode,
        )  # fmt: skip
        loss.backward()
        key = f"tp/{loss_name}/{tau}" + ("" if ce_mode == "ratio" else f"/ce_{ce_mode}")
        errors[f"{key}/loss"] = _rel(loss, ref_loss)
        errors[f"{key}/grad_h"] = _rel(h2.grad, ref_gh)
        errors[f"{key}/grad_w"] = _rel(w2.grad, ref_gw[cols])
        for name in METRICS:
            errors[f"{key}/{name}"] = _rel(m[name], ref_m[name])
        shard_t = vocab_shard(w_t.shape[0], dist.group.WORLD)
        rows_t = slice(shard_t.start, shard_t.start + shard_t.size)
        full = teacher_targets(h_t, w_t, kd_t, next_t, top_k=8, temperature=tau, chunk_size=7)
        part = teacher_targets(
            h_t,
            w_t[rows_t],
            kd_t,
            next_t,
            top_k=8,
            temperature=tau,
            chunk_size=7,
            vocab=shard_t,
        )
        for field, value in full.tensors().items():
            errors[f"targets/{tau}/{field}"] = _rel(part.tensors()[field], value)
    return _max_over_ranks(errors)


def context_parallel_errors() -> dict[str, float]:
    """The row-sharded student loss (load-balanced pieces, chunks across piece edges) against
    one device: partial losses and gradients summed over ranks, every loss."""
    from crossdistill.distributed.cp import global_rows
    from crossdistill.losses import student_loss
    from crossdistill.losses.sharding import RowShard

    size, rank = dist.get_world_size(), dist.get_rank()

    def total(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    errors = {}
    cases = [(name, "ratio") for name in LOSSES] + [(name, "full") for name in FULL_CE_LOSSES]
    for loss_name, ce_mode in cases:
        h, w, labels, term, _ = _loss_inputs(loss_name, 1.5)
        ref_loss, ref_m, ref_gh, ref_gw = _reference(h, w, labels, term, ce_mode)
        rows = global_rows(2, 16, size, rank)
        shard = RowShard(rows, h.shape[0], total)
        h2, w2 = h[rows].clone().requires_grad_(), w.clone().requires_grad_()
        loss, m = student_loss(
            h2, w2, labels, [term], kd_ratio=0.6, ce_denominator=31.0, chunk_size=9, rows=shard,
            ce_without_kd=ce_mode,
        )  # fmt: skip
        loss.backward()
        key = f"cp/{loss_name}" + ("" if ce_mode == "ratio" else f"/ce_{ce_mode}")
        errors[f"{key}/loss"] = _rel(total(loss.detach().clone()), ref_loss)
        errors[f"{key}/grad_h"] = _rel(h2.grad, ref_gh[rows])
        errors[f"{key}/grad_w"] = _rel(total(w2.grad.clone()), ref_gw)
        for name in METRICS + ["num_ce", "num_kd/teacher", "num_chunks/teacher"]:
            errors[f"{key}/{name}"] = _rel(total(m[name].clone().double()), ref_m[name])
    return _max_over_ranks(errors)


# ----------------------------------------------------------------------------- loading


def sharded_loading_errors(checkpoints: dict[str, str]) -> dict[str, float]:
    """Models loaded sharded from safetensors: every full tensor equals the file's, each rank
    stores about 1/2 of the bytes, and the hidden states equal an unsharded model's."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    from crossdistill.distributed.layout import ParallelLayout
    from crossdistill.distributed.loading import build_parallel_model, full_nbytes, local_nbytes
    from crossdistill.distributed.parallelize import model_hidden
    from crossdistill.distributed.runtime import mesh_for
    from crossdistill.distributed.tp_plans import fused_params
    from crossdistill.models import build_causal_lm
    from crossdistill.models.forward import final_hidden

    out = {}
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))
    for name, path in checkpoints.items():
        saved = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            saved.update(load_file(str(f)))
        plain = build_causal_lm(path, dtype=torch.float32)
        want = final_hidden(plain, ids, None)
        for lay_name, lay in (("fsdp2", ParallelLayout(dp_shard=2)), ("tp2", ParallelLayout(tp=2))):
            mcfg = ModelConfig(path=path, dtype="float32")
            model = build_parallel_model(
                mcfg, lay, mesh_for(lay, "cpu"), torch.device("cpu"), trainable=False, seed=0
            )
            fused = fused_params(model, model.config, lay.tp)
            err = 0.0
            for key, p in model.named_parameters():
                full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                if key in fused:
                    back = torch.empty_like(full)
                    back[fused[key]] = full
                    full = back
                err = max(err, _rel(full, saved[key]))
            key = f"{name}/{lay_name}"
            out[f"{key}/share"] = local_nbytes(model) / full_nbytes(model)
            with torch.no_grad():
                got = model_hidden(model, ids, None)
            out[f"{key}/weights"] = err
            out[f"{key}/hidden"] = _rel(got, want)
    return _max_over_ranks(out)


# ----------------------------------------------------------------------------- workers


def two_rank_worker(rank: int, cfg, paths: dict[str, str], out: str) -> None:
    from crossdistill.train.loop import train

    torch.manual_seed(0)
    results: dict = {"loss": {**vocab_parallel_errors(), **context_parallel_errors()}}
    sc = torch.load(paths["scenario"], weights_only=False)
    results["layouts"] = {c.name: run_steps(with_layouts(cfg, c), sc) for c in TWO_RANKS}
    results["loading"] = sharded_loading_errors({"phi3": paths["phi3"], "qwen3": paths["qwen3"]})
    fsdp = TWO_RANKS[1]
    results["validation"] = held_out_metrics(with_layouts(copy.deepcopy(cfg), fsdp))
    for run, stop in (("full", None), ("part", 2)):
        c = with_layouts(copy.deepcopy(cfg), fsdp)
        c.run.out_dir = paths[run]
        train(c, stop_after=stop)
    if rank == 0:
        torch.save(results, out)


def held_out_metrics(cfg) -> dict[str, float]:
    """`evaluate` on the untrained models of `cfg` (every layout starts from the same weights):
    3 validation batches, so one of two data-parallel ranks evaluates a batch of padding."""
    from crossdistill.train.build import build_components
    from crossdistill.train.evaluate import evaluate

    cfg.train.eval_batches = 3
    torch.manual_seed(cfg.train.seed)
    from crossdistill.distributed.layout import init_distributed

    return evaluate(build_components(cfg, init_distributed("cpu")), cfg)


def load_student(folder: Path, student, optimizer) -> int:
    """The checkpoint `folder` loaded into `student` and `optimizer` (in their layout, as the
    trainer resumes); its step."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from crossdistill.train.checkpoint import load_checkpoint

    model_sd, optim_sd = get_state_dict(student, optimizer)
    sharded = {"model": model_sd, "optimizer": optim_sd}
    found = load_checkpoint(folder, sharded)
    set_state_dict(
        student, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"]
    )
    return found.step


def resharded_state(cfg, folder: Path) -> dict[str, torch.Tensor]:
    """The student of `cfg`'s layouts with the sharded checkpoint `folder` loaded, gathered
    (rank 0; the model and optimizer are built as the trainer builds them)."""
    from crossdistill.distributed.layout import init_distributed
    from crossdistill.distributed.setup import build_placement, parallel_models, plan_layouts
    from crossdistill.train.checkpoint import full_state_on_rank0
    from crossdistill.train.optim import build_optimizer
    from crossdistill.train.validate import validate_config

    env = init_distributed("cpu")
    res_s, res_t = validate_config(cfg)
    layouts = plan_layouts(cfg, env.world_size, res_s.hf_config, [r.hf_config for r in res_t])
    student, _, _ = parallel_models(cfg, build_placement(env, layouts))
    optimizer = build_optimizer(student, cfg.optim)
    step = load_student(folder, student, optimizer)
    state = full_state_on_rank0(student)
    state["_step"] = torch.tensor(step)
    state["_optimizer_steps"] = torch.tensor(len(optimizer.state))
    return state


def four_rank_worker(rank: int, cfg, paths: dict[str, str], out: str) -> None:
    from crossdistill.train.loop import train

    sc = torch.load(paths["scenario"], weights_only=False)
    results: dict = {"layouts": {c.name: run_steps(with_layouts(cfg, c), sc) for c in FOUR_RANKS}}
    # the fsdp2 run of two ranks, resumed from its step-2 checkpoint as tp2 x dp2 on four
    c = with_layouts(copy.deepcopy(cfg), FOUR_RANKS[0])
    c.run.out_dir = paths["part"]
    results["resharded"] = resharded_state(c, Path(paths["part"]) / "checkpoints" / "step_000002")
    train(c, resume=True)
    if rank == 0:
        torch.save(results, out)

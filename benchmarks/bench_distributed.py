"""Distributed benchmark: weak scaling 1 -> N GPUs, bf16 invariance against 1 GPU, and the
memory of sharded teacher loading.

A Qwen3-4B-shaped teacher (random weights, the real Qwen3 tokenizer) distils into a
Llama-3.2-1B-shaped student (real Llama-3 tokenizer), cross-tokenizer, forward KL on top-128
targets plus CE, sequence 4096, one micro-batch of one sequence per GPU per step, text from
this machine's Python standard library. Run under torchrun; rank 0 prints one JSON line:

    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py
    torchrun --nproc-per-node 2 benchmarks/bench_distributed.py --layouts ddp,tp2 --steps 20

Phases (every phase on the same global micro-batches):
1. one GPU (rank 0 alone, a plain single-process step): 3 optimizer steps of 2 micro-batches
   each (bf16 invariance reference), then `--warmup` + `--steps` steps of 1 micro-batch
   (tokens/s of one GPU);
2. all GPUs, per layout in `--layouts`: the same 3 steps (each data-parallel rank one
   micro-batch), then the timed steps with one micro-batch per GPU (weak scaling:
   efficiency = (tokens/s of N GPUs / N) / tokens/s of one GPU);
3. the teacher written to disk once, then loaded sharded (FSDP over all ranks, and TP over
   all ranks): peak device and host memory per rank against the model's size.

Layouts (see `LAYOUTS`): `ddp`, the trainer's defaults: student FSDP over all ranks with bf16
parameter gathers, teacher replicated (a frozen model needs no sync); `ddp_keep` the same with
blocks kept gathered from forward to backward; `*_fp32` float32 gathers; `hsdp` student
replicated; `fsdp` teacher sharded too; `tp2`, `teacher_tp2`, `cp2` tensor / context parallel.
Tokenizers come from `$CROSSDISTILL_TOKENIZERS` (default `../shared/tokenizers`).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from crossdistill.config import Config, ParallelConfig, from_dict  # noqa: E402

P = ParallelConfig
LAYOUTS = {
    # the trainer's defaults: student FSDP over all ranks (parameters gathered in bf16 on CUDA,
    # gradients reduced in float32), teacher replicated (a frozen model needs no sync)
    "ddp": (P(dp_shard=-1), P(dp_replicate=-1, dp_shard=1)),
    "ddp_fp32": (P(dp_shard=-1), P(dp_replicate=-1, dp_shard=1)),  # float32 gathers
    # student blocks kept gathered from forward to backward (one all-gather per step)
    "ddp_keep": (P(dp_shard=-1), P(dp_replicate=-1, dp_shard=1)),
    "ddp_keep_fp32": (P(dp_shard=-1), P(dp_replicate=-1, dp_shard=1)),
    # student replicated (HSDP with shards of one rank: gradients all-reduced)
    "hsdp": (P(dp_replicate=-1, dp_shard=1), P(dp_replicate=-1, dp_shard=1)),
    "fsdp": (P(dp_shard=-1), P(dp_shard=-1)),  # teacher sharded too
    "tp2": (P(tp=2, dp_shard=-1), P(tp=2, dp_shard=-1)),
    "teacher_tp2": (P(dp_shard=-1), P(tp=2, dp_shard=-1)),
    "cp2": (P(cp=2, dp_shard=-1), P(cp=2, dp_shard=-1)),
    # four GPUs, heterogeneous: student TP2 x DP2 (FSDP), teacher TP2 x CP2 (one data group)
    "s_tp2dp2_t_tp2cp2": (P(tp=2, dp_shard=-1), P(tp=2, cp=2)),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--teacher-arch", default="qwen3-4b")
    p.add_argument("--student-arch", default="llama-3.2-1b")
    p.add_argument("--teacher-tokenizer", default="qwen3")
    p.add_argument("--student-tokenizer", default="llama3")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=128)
    p.add_argument("--steps", type=int, default=10, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--split-steps", type=int, default=3, help="extra steps timed part by part")
    p.add_argument("--layouts", default="ddp", help=f"comma list of {sorted(LAYOUTS)}")
    p.add_argument("--loss-chunk-size", type=int, default=2048)
    p.add_argument("--invariance-steps", type=int, default=3, help="steps compared across layouts")
    p.add_argument(
        "--invariance-window",
        type=int,
        default=2,
        help="micro-batches per invariance step (a multiple of every layout's data-parallel size)",
    )
    p.add_argument("--workdir", default="/tmp/crossdistill-bench")
    p.add_argument("--skip-load", action="store_true", help="skip phase 3")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument(
        "--tiny", action="store_true", help="tiny layers, real vocabularies (smoke test)"
    )
    return p.parse_args()


TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def tokenizer_root() -> Path:
    return Path(os.environ.get("CROSSDISTILL_TOKENIZERS", REPO.parent / "shared" / "tokenizers"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def make_config(args, work: Path) -> Config:
    root = tokenizer_root()
    dtype_s = "float32"
    raw = {
        "student": {
            "arch": args.student_arch,
            "tokenizer": str(root / args.student_tokenizer / "hf"),
            "dtype": dtype_s,
            "overrides": TINY if args.tiny else {},
        },
        "teachers": [
            {
                "name": "teacher",
                "arch": args.teacher_arch,
                "tokenizer": str(root / args.teacher_tokenizer / "hf"),
                "dtype": "bfloat16",
                "overrides": TINY if args.tiny else {},
                "top_k": args.top_k,
                "projection": str(work / "projection.safetensors"),
                "target": "first_piece",  # the target its recorded numbers were timed on
            }
        ],
        "data": {
            "train": [str(work / "corpus.jsonl")],
            "seq_len": args.seq_len,
            "micro_batch_size": 1,
            "num_workers": 0,
            "val_fraction": 0.0,
            "pad_multiple": 64,
        },
        "optim": {"lr": 1e-5, "warmup_steps": 0, "grad_clip": 1.0},
        "train": {"device": args.device, "loss_chunk_size": args.loss_chunk_size, "seed": 0},
        "run": {"out_dir": str(work / "run"), "tensorboard": False, "progress": False},
    }
    return from_dict(Config, raw)


def prepare(cfg: Config, work: Path, rank: int) -> None:
    """Rank 0 writes the corpus (stdlib sources) and the vocabulary projection."""
    if rank == 0:
        from crossdistill.alignment.projection import build_projection
        from crossdistill.models import load_tokenizer
        from crossdistill.train.demo_assets import stdlib_corpus

        work.mkdir(parents=True, exist_ok=True)
        if not (work / "corpus.jsonl").is_file():
            texts, _ = stdlib_corpus()
            with open(work / "corpus.jsonl", "w") as f:
                for t in texts:
                    f.write(json.dumps({"text": t}) + "\n")
        tok_t = load_tokenizer(cfg.teachers[0].tokenizer)
        tok_s = load_tokenizer(cfg.student.tokenizer)
        build_projection(tok_t, tok_s).save(cfg.teachers[0].projection)
    barrier()


def global_batches(cfg: Config, count: int) -> list:
    """The first `count` micro-batches of the one global stream (the same on every rank)."""
    from crossdistill.data import build_loader
    from crossdistill.models import load_tokenizer

    tok_s = load_tokenizer(cfg.student.tokenizer)
    toks_t = [load_tokenizer(t.tokenizer) for t in cfg.teachers]
    stream = iter(build_loader(cfg.data, tok_s, toks_t, split="train"))
    return [next(stream) for _ in range(count)]


def slots_for(cfg: Config, models_t: list, device: torch.device) -> list:
    from crossdistill.distributed.runtime import TeacherSlot
    from crossdistill.models import Teacher, load_tokenizer
    from crossdistill.train.build import build_projection_for
    from crossdistill.train.validate import validate_config

    res_s, res_t = validate_config(cfg)
    tok_s = load_tokenizer(cfg.student.tokenizer)
    slots = []
    for t, r, model in zip(cfg.teachers, res_t, models_t):
        tok = load_tokenizer(t.tokenizer)
        proj = build_projection_for(
            t, tok, tok_s, r.hf_config.vocab_size, res_s.hf_config.vocab_size, device, cfg.data
        )
        slots.append(TeacherSlot(Teacher(model, t.name), t, proj))
    return slots


def run_phase(cfg, student, slots, placement, batches, args, device, rank_of_data, num_data):
    """Invariance steps (2 micro-batches per step globally), then timed steps (one micro-batch
    per data-parallel rank). Returns losses, grad norms, tokens/s of this rank, peak memory."""
    from crossdistill.distributed.grads import clip_grad_norm_
    from crossdistill.train.optim import build_optimizer
    from crossdistill.train.step import StepSettings, train_step

    settings = StepSettings(
        kd_ratio=0.5,
        teacher_mode="weighted",
        loss_chunk_size=args.loss_chunk_size,
        autocast=device.type == "cuda",
        device=device,
    )
    optimizer = build_optimizer(student, cfg.optim)

    split = {"step": 0.0, "clip": 0.0, "optimizer": 0.0}

    def step(window, timing=False):
        t0 = time.perf_counter()
        metrics = train_step(student, slots, window, settings, placement)
        sync(device) if timing else None
        t1 = time.perf_counter()
        norm = clip_grad_norm_(student.parameters(), cfg.optim.grad_clip)
        sync(device) if timing else None
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device) if timing else None
        if timing:
            split["step"] += t1 - t0
            split["clip"] += t2 - t1
            split["optimizer"] += time.perf_counter() - t2
        return metrics, norm

    invariance = []
    w = args.invariance_window
    for i in range(args.invariance_steps):
        window = batches[w * i : w * i + w]
        mine = [mb for j, mb in enumerate(window) if j % num_data == rank_of_data]
        metrics, norm = step(mine)
        invariance.append((float(metrics["loss"]), float(norm)))
    base = w * args.invariance_steps
    timed = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for k in range(args.warmup + args.steps):
        mb = batches[base + k * num_data + rank_of_data]
        sync(device)
        t0 = time.perf_counter()
        step([mb])
        sync(device)
        if k >= args.warmup:
            timed.append((time.perf_counter() - t0, int((mb.student.doc_ids >= 0).sum())))
    for k in range(args.split_steps):  # the same steps again, synchronised between parts
        step([batches[base + k * num_data + rank_of_data]], timing=True)
    seconds = sum(t for t, _ in timed)
    tokens = sum(n for _, n in timed)
    world = placement.env.world_size
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "invariance": invariance,
        # every data-parallel rank reads its own micro-batch; TP / CP ranks share one
        "tokens_per_s_per_gpu": tokens * num_data / world / seconds,
        "step_s": seconds / len(timed),
        "peak_device_gib": peak / 2**30,
        "split_s": {k: v / max(args.split_steps, 1) for k, v in split.items()},
    }


def one_gpu(cfg: Config, batches: list, args, device: torch.device) -> dict:
    """The same step on this rank's device alone: the one-rank layouts (no mesh, every
    reduction the identity), as a job of one process runs it."""
    from crossdistill.distributed.layout import DistEnv
    from crossdistill.distributed.setup import build_placement, parallel_models, plan_layouts
    from crossdistill.train.validate import validate_config

    res_s, res_t = validate_config(cfg)
    layouts = plan_layouts(cfg, 1, res_s.hf_config, [r.hf_config for r in res_t])
    placement = build_placement(DistEnv(device=device), layouts)
    student, models_t, _ = parallel_models(cfg, placement)
    slots = slots_for(cfg, models_t, device)
    out = run_phase(cfg, student, slots, placement, batches, args, device, 0, 1)
    del student, models_t, slots
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    return out


def all_gpus(cfg: Config, batches: list, args, env, layout: str) -> dict:
    from crossdistill.distributed.setup import build_placement, parallel_models, plan_layouts
    from crossdistill.train.validate import validate_config

    cfg = copy.deepcopy(cfg)
    student_par, teacher_par = LAYOUTS[layout]
    cfg.student.parallel = copy.deepcopy(student_par)
    cfg.teachers[0].parallel = copy.deepcopy(teacher_par)
    if teacher_par.dp_replicate == -1:  # replicate on every rank
        cfg.teachers[0].parallel = P(dp_replicate=env.world_size, dp_shard=1)
    if student_par.dp_replicate == -1:
        cfg.student.parallel = P(dp_replicate=env.world_size, dp_shard=1)
    res_s, res_t = validate_config(cfg)
    layouts = plan_layouts(cfg, env.world_size, res_s.hf_config, [r.hf_config for r in res_t])
    placement = build_placement(env, layouts)
    keep = layout.startswith("ddp_keep")
    gather = torch.float32 if layout.endswith("fp32") else None  # None: the trainer's default
    student, models_t, _ = parallel_models(cfg, placement, not keep, gather)
    slots = slots_for(cfg, models_t, env.device)
    out = run_phase(
        cfg,
        student,
        slots,
        placement,
        batches,
        args,
        env.device,
        placement.data_rank,
        placement.data_size,
    )
    out["layouts"] = [layouts.student.describe()] + [t.describe() for t in layouts.teachers]
    del student, models_t, slots
    gc.collect()
    torch.cuda.empty_cache() if env.device.type == "cuda" else None
    return out


def _reset_host_peak() -> int | None:
    """Reset the peak resident set (Linux `clear_refs` 5) and return the current one, bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _host_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sharded_load(cfg: Config, args, env, work: Path) -> dict:
    """Write the teacher once (rank 0), then load it sharded: FSDP over all ranks, and TP over
    all ranks. Peak memory per rank during the load, against the model's size."""
    from crossdistill.config import ModelConfig
    from crossdistill.distributed.layout import ParallelLayout
    from crossdistill.distributed.loading import build_parallel_model, full_nbytes, local_nbytes
    from crossdistill.distributed.runtime import mesh_for
    from crossdistill.models import build_causal_lm
    from crossdistill.models.loading import parse_dtype

    t = cfg.teachers[0]
    folder = work / "teacher"
    if env.rank == 0 and not (folder / "config.json").is_file():
        model = build_causal_lm(
            arch=t.arch,
            device=env.device,
            dtype=parse_dtype(t.dtype),
            overrides=t.overrides,
            seed=1,
        )
        model.save_pretrained(folder, safe_serialization=True)
        del model
        gc.collect()
        torch.cuda.empty_cache() if env.device.type == "cuda" else None
    barrier()
    out = {}
    world = env.world_size
    for name, layout in (
        ("fsdp", ParallelLayout(dp_shard=world)),
        ("tp", ParallelLayout(tp=world)),
    ):
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
            base_device = torch.cuda.memory_allocated(env.device)
        host_before = _reset_host_peak()
        t0 = time.perf_counter()
        model = build_parallel_model(
            ModelConfig(path=str(folder), dtype=t.dtype, overrides=t.overrides),
            layout,
            mesh_for(layout, env.device.type),
            env.device,
            trainable=False,
            seed=0,
        )
        sync(env.device)
        seconds = time.perf_counter() - t0
        full = full_nbytes(model)
        row = {
            "model_gib": full / 2**30,
            "local_gib": local_nbytes(model) / 2**30,
            "load_s": seconds,
        }
        if env.device.type == "cuda":
            row["peak_device_gib"] = (
                torch.cuda.max_memory_allocated(env.device) - base_device
            ) / 2**30
        if host_before is not None:
            row["peak_host_extra_gib"] = (_host_peak() - host_before) / 2**30
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        out[name] = gathered
        del model
        gc.collect()
        torch.cuda.empty_cache() if env.device.type == "cuda" else None
        barrier()
    return out


def flops_per_token(cfg: Config, batches: list) -> float:
    """Training FLOPs per student token, counted as `crossdistill bench step` counts them."""
    from crossdistill.bench.step import _flops_per_student_token, _shape
    from crossdistill.models.loading import build_meta_model

    s, t = cfg.student, cfg.teachers[0]
    meta_s = build_meta_model(None, s.arch, dtype=torch.bfloat16, overrides=s.overrides)
    meta_t = build_meta_model(None, t.arch, dtype=torch.bfloat16, overrides=t.overrides)
    n_s = sum(int((b.student.doc_ids >= 0).sum()) for b in batches)
    n_t = sum(int((b.teachers[0].doc_ids >= 0).sum()) for b in batches)
    ratio = n_t / max(n_s, 1)
    return _flops_per_student_token(_shape(meta_s), [(_shape(meta_t), ratio)], cfg.data.seq_len)


def main() -> int:
    from crossdistill.distributed.layout import init_distributed

    args = parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    env = init_distributed(args.device)
    work = Path(args.workdir)
    cfg = make_config(args, work)
    prepare(cfg, work, env.rank)
    world = env.world_size
    need = args.invariance_window * args.invariance_steps
    need += world * (args.warmup + args.steps + args.split_steps)
    batches = global_batches(cfg, need)
    result: dict = {
        "benchmark": "distributed",
        "world_size": world,
        "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "teacher": args.teacher_arch,
        "student": args.student_arch,
        "seq_len": args.seq_len,
        "micro_batch_per_gpu": 1,
        "timed_steps": args.steps,
        "errors": {},
    }
    phases = [
        ("one_gpu", lambda: one_gpu(cfg, batches, args, env.device) if env.rank == 0 else None)
    ]
    for name in args.layouts.split(","):
        phases.append((f"gpus_{name}", lambda n=name: all_gpus(cfg, batches, args, env, n)))
    if not args.skip_load and world > 1:
        phases.append(("sharded_load", lambda: sharded_load(cfg, args, env, work)))
    for name, fn in phases:
        try:
            value = fn()
            if value is not None:
                result[name] = value
        except Exception:  # a failed phase is reported, the others still run
            result["errors"][name] = traceback.format_exc()[-3000:]
        if env.rank == 0:  # progress, in case the job is cut short
            print(f"phase {name}: {json.dumps(result.get(name, result['errors'].get(name)))}")
        barrier()
    if env.rank == 0:
        one = result.get("one_gpu")
        for name in args.layouts.split(","):
            many = result.get(f"gpus_{name}")
            if one and many:
                many["weak_scaling_efficiency"] = (
                    many["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
                )
                many["invariance_rel"] = [
                    [abs(a - c) / abs(c), abs(b - d) / abs(d)]
                    for (a, b), (c, d) in zip(many["invariance"], one["invariance"])
                ]
        names = args.layouts.split(",")
        first, second = (result.get(f"gpus_{n}") for n in (names + names)[:2])
        if len(names) >= 2 and first and second:  # the first two layouts against each other
            result["layout_pair"] = names[:2]
            result["layout_pair_rel"] = [
                [abs(a - c) / abs(c), abs(b - d) / abs(d)]
                for (a, b), (c, d) in zip(first["invariance"], second["invariance"])
            ]
        flops = flops_per_token(cfg, batches)
        result["flops_per_token"] = flops
        for name in ["one_gpu"] + [f"gpus_{n}" for n in names]:
            phase = result.get(name)
            if phase and env.device.type == "cuda":
                phase["mfu"] = phase["tokens_per_s_per_gpu"] * flops / 989e12
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            Path(args.out).write_text(line + "\n")
    if env.owns_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

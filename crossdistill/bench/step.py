"""`crossdistill bench step`: the real distillation step on random-init models of real shapes.

Real tokenizers, real text (this machine's Python sources) through the real collator, the real
teachers' targets, chunked loss, backward and fused AdamW, timed after warm-up. Reports tokens/s
(student tokens), model-FLOPs utilisation against the dense-bf16 datasheet peak (and against the
bf16 matmul rate measured in the same run) and peak memory. `benchmarks/bench_step.py` runs the
same command with the naive baseline (what a user writes without this library), the phase
split and a profile beside it, through `measure`'s `extras` hook.

The run is built from a `crossdistill train` config by the trainer's own code; attention,
compile, recomputation and the teachers' padding are options of that config, so comparing
them is comparing runs (`benchmarks/step_ablations.py` runs them side by side).

FLOPs per student token: 6·N_s + 2·Σ N_t·(T_t/T_s) for the weight matmuls (lm_head included,
embeddings not), plus attention: 6·L_s·T·d_s (training: 3x the 2·T·d causal forward) and
2·L_t·T_t·d_t per teacher.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from crossdistill.config import ATTENTION_CHOICES, CHECKPOINT_SCOPES, TARGETS, TeacherConfig

DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
EXAMPLES = """examples:
  crossdistill bench step --teacher qwen3-4b --teacher-tokenizer $TOK/qwen3/hf \\
      --student llama-3.2-1b --student-tokenizer $TOK/llama3/hf --seq-len 2048 --compile
  crossdistill bench step --teacher phi-4-mini --teacher-tokenizer $TOK/phi-4-mini/hf \\
      --teacher llama-3.2-3b --teacher-tokenizer $TOK/llama3/hf --student llama-3.2-1b \\
      --student-tokenizer $TOK/llama3/hf --json
  crossdistill bench step --tiny --device cpu      # a smoke run of the same code on the CPU
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "step",
        help="time the full distillation step (teachers, loss, backward, optimizer)",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--student", default="llama-3.2-1b", help="architecture preset of the student")
    p.add_argument("--student-tokenizer", required=True)
    p.add_argument("--teacher", action="append", default=[], help="teacher preset (repeatable)")
    p.add_argument("--teacher-tokenizer", action="append", default=[], help="one per --teacher")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="micro-batches per optimizer step",
    )
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--loss", default="forward_kl")
    p.add_argument(
        "--target",
        choices=TARGETS,
        default=TeacherConfig.target,
        help="the teachers' projected target (teachers.N.target)",
    )
    p.add_argument("--loss-chunk-size", type=int, default=4096)
    p.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        default="auto",
        help="attention of every model, as `attn_implementation` (auto: flash varlen on CUDA)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every transformer block (student and teachers), as `compile: true`",
    )
    p.add_argument(
        "--checkpoint-blocks",
        type=int,
        default=0,
        help="recompute the first N student blocks in backward (memory for a little time)",
    )
    p.add_argument(
        "--checkpoint-scope",
        choices=CHECKPOINT_SCOPES,
        default="block",
        help="with --checkpoint-blocks: recompute whole blocks, only their MLPs, or only the "
        "MLPs' elementwise work (weight casts, gated activation; matmul outputs kept)",
    )
    p.add_argument(
        "--loss-kernels",
        choices=["auto", "pytorch"],
        default="auto",
        help="the loss and teacher targets in fused Triton kernels on CUDA (auto) or in PyTorch",
    )
    p.add_argument(
        "--teacher-padding",
        choices=["auto", "drop", "keep"],
        default="auto",
        help="cross teachers' bodies over their non-pad tokens alone (drop), over the padded "
        "rows (keep), or drop where flash attention covers every layer (auto)",
    )
    p.add_argument(
        "--teacher-cache",
        action="store_true",
        help="also build each teacher's cache over the corpus and time the step reading it "
        "(beside the live step, and the student alone for memory)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a `crossdistill train` setting of the benchmark's run (repeatable), e.g. "
        "student.parallel.tp=2 or teachers.0.parallel.dp_shard=2 under torchrun",
    )
    p.add_argument(
        "--one-gpu-reference",
        action="store_true",
        help="under torchrun: first time the same command in one process on the first GPU "
        "(layouts left out), and report the job's per-GPU rate beside it",
    )
    p.add_argument(
        "--teacher-placement",
        choices=["colocated", "separate"],
        default="colocated",
        help="separate: each teacher on processes of its own, under torchrun --nproc_per_node "
        "1 + teachers x --teacher-ranks (the student's time spent waiting for targets is "
        "reported)",
    )
    p.add_argument(
        "--teacher-ranks",
        type=int,
        default=1,
        help="with --teacher-placement separate: processes per teacher, laid out by "
        "--set teachers.N.parallel... (e.g. teachers.0.parallel.pp=2: a two-stage pipeline)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--tiny", action="store_true", help="override shapes to a few layers (CPU smoke)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


@dataclass
class Shape:
    params_matmul: int  # weights used in matmuls per token (lm_head included, embedding not)
    layers: int
    attn_dim: int  # heads * head_dim


def _shape(model) -> Shape:
    cfg = model.config
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    n = total - emb.numel() + (head.numel() if head is emb else 0)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return Shape(n, cfg.num_hidden_layers, cfg.num_attention_heads * head_dim)


def _teacher_shape(slot) -> Shape:
    """A teacher's shape; one that runs in another process is built on the meta device."""
    if slot.teacher is not None:
        return _shape(slot.teacher.model)
    return _shape(_meta_model(slot.cfg))


def _meta_model(model_cfg):
    """The whole model of a config on the meta device (a pipeline stage holds only part)."""
    import torch

    from crossdistill.models.loading import build_meta_model

    c = model_cfg
    return build_meta_model(c.path, c.arch, dtype=torch.bfloat16, overrides=c.overrides)


def _flops_per_student_token(s: Shape, teachers: list[tuple[Shape, float]], t_s: int) -> float:
    """Training FLOPs per student token; `teachers` holds (shape, teacher tokens per student token)."""
    flops = 6 * s.params_matmul + 6 * s.layers * t_s * s.attn_dim
    for t, ratio in teachers:
        t_t = t_s * ratio
        flops += ratio * (2 * t.params_matmul + 2 * t.layers * t_t * t.attn_dim)
    return flops


def _matmul_tflops(device) -> float | None:
    import torch

    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - t0) / 1e12


def run(args: argparse.Namespace) -> int:
    from crossdistill.errors import UserError

    if len(args.teacher) != len(args.teacher_tokenizer):
        raise UserError("give one --teacher-tokenizer per --teacher")
    if args.grad_accum < 1:
        raise UserError(f"--grad-accum must be >= 1, got {args.grad_accum}")
    if args.teacher_ranks < 1 or (args.teacher_ranks > 1 and args.teacher_placement != "separate"):
        raise UserError(
            f"--teacher-ranks {args.teacher_ranks}: give 1 or more, and more than 1 only with "
            "--teacher-placement separate (a colocated teacher shares the student's processes)"
        )
    if args.teacher_placement == "separate":
        if args.teacher_cache or not args.teacher:
            raise UserError("--teacher-placement separate needs --teacher and no --teacher-cache")
        from crossdistill.bench.step_torchrun import measure_separate

        result = measure_separate(args, measure)
        if result is None:  # a teacher's process: the student's reports
            return 0
    elif args.teacher_cache:
        if not args.teacher:
            raise UserError("--teacher-cache needs at least one --teacher")
        from crossdistill.bench.step_cache import CacheBench

        cache = CacheBench(args)
        result = measure(args, extras=cache.extras)
        result.update(cache.cached_runs())
        result["speedup_vs_live"] = result["cached_tokens_per_s"] / result["tokens_per_s"]
    else:
        result = measure(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # the job reports once, from its first process
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def measure(
    args: argparse.Namespace,
    extras: Callable[[Any, dict], None] | None = None,
    env: Any = None,
) -> dict:
    """The timed steps of the run `args` describes, with FLOPs, MFU and the run's facts.
    `extras(bench, result)` runs after the timing on the same run (a `step_setup.Bench`) and
    adds its own keys to `result`: `ms/<phase>` keys join the split, `<prefix>tokens_per_s`
    keys get their MFU (a baseline's, on the same FLOPs per token). `env`: the student's
    process of a job with separate teachers (MFU is then per GPU the job uses)."""
    from crossdistill.bench.step_setup import build_bench, timed_steps
    from crossdistill.bench.step_torchrun import gpus_of, job_rates, one_gpu_reference
    from crossdistill.distributed.streams import announce_start

    reference = one_gpu_reference(args) if args.one_gpu_reference else None
    with build_bench(args, env=env) as bench:
        if env is not None:
            announce_start(env, 0, bench.cfg.train.teacher_timeout_s)
            result = {"processes": env.job_size, "gpus": gpus_of(env)}
        else:
            result = {}
        result.update(timed_steps(bench, args))
        # each teacher's target as the run resolved it (`auto` chooses at load, from the pair)
        result["targets"] = [slot.cfg.target for slot in bench.c.slots]
        if bench.c.env.world_size > 1:
            result.update(job_rates(bench, result))
        if reference is not None:
            result["one_gpu_tokens_per_s"] = reference["tokens_per_s"]
            result["one_gpu_peak_gib"] = reference.get("peak_gib")
            per_gpu = result.get("per_gpu_tokens_per_s", result["tokens_per_s"])
            result["per_gpu_vs_one_gpu"] = per_gpu / reference["tokens_per_s"]
        bench.teacher_ratio = result["teacher_tokens_per_student_token"]
        student = bench.c.student
        if getattr(bench.c.placement, "pipeline", None) is not None:  # a rank holds some stages
            student = _meta_model(bench.cfg.student)
        shapes = Shapes(
            _shape(student),
            [_teacher_shape(s) for s in bench.c.slots],
            _lm_head_size(student),
        )
        if extras is not None:
            extras(bench, result)
        result["matmul_tflops_measured"] = _matmul_tflops(bench.device)
        _finish(result, shapes, bench, args)
    return result


@dataclass
class Shapes:
    student: Shape
    teachers: list[Shape]
    head_s: int  # the student's lm_head weights


def add_rates(result: dict, flops: float, peak: float | None) -> None:
    """TFLOP/s, MFU (of `peak` TFLOP/s per GPU) and the fraction of the measured matmul rate for
    every `<prefix>tokens_per_s` of `result`, and our speed-up over each baseline. A job's
    `tokens_per_s` is spread over its `gpus`; `per_gpu_` and `one_gpu_` rates are one GPU's."""
    prefixes = [k.removesuffix("tokens_per_s") for k in result if k.endswith("tokens_per_s")]
    for key in prefixes:  # ours (""), any baseline's (`extras`), a job's per GPU and one GPU's
        tps = result[f"{key}tokens_per_s"]
        one = key in ("per_gpu_", "one_gpu_")  # rates of a single GPU
        if key and not one:
            result[f"speedup_vs_{key.rstrip('_')}"] = result["tokens_per_s"] / tps
        gpus = 1 if one else result.get("gpus") or 1  # a separate teacher's GPU counts too
        achieved = tps * flops / 1e12
        result[f"{key}tflops"] = achieved
        result[f"{key}mfu"] = achieved / (peak * gpus) if peak else None
        if result.get("matmul_tflops_measured"):
            result[f"{key}fraction_of_measured_matmul"] = achieved / (
                result["matmul_tflops_measured"] * gpus
            )


def _finish(result: dict, shapes: Shapes, bench, args) -> None:
    import torch

    s = shapes.student
    teachers = list(zip(shapes.teachers, bench.teacher_ratio))
    flops = _flops_per_student_token(s, teachers, args.seq_len)
    name = torch.cuda.get_device_name() if bench.device.type == "cuda" else "cpu"
    peak = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)
    result.update(
        device=name,
        date=time.strftime("%Y-%m-%d"),
        command="crossdistill bench step " + " ".join(sys.argv[3:]),
        torch=torch.__version__,
        flops_per_token=flops,
        student=args.student,
        teachers=args.teacher,
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        compile=args.compile,
        checkpoint_blocks=args.checkpoint_blocks,
        checkpoint_scope=args.checkpoint_scope,
        attention=args.attention,
        teacher_padding=args.teacher_padding,
        loss_kernels=args.loss_kernels,
        teacher_tokens_per_student_token=bench.teacher_ratio,
    )
    add_rates(result, flops, peak)
    rate = result.get("matmul_tflops_measured")
    if rate and "ms/student_loss" in result:
        # the student's loss pass holds its three lm_head matmuls (forward, two backward): what
        # the chunked loss adds beyond them, at the matmul rate of this run
        tokens = args.seq_len * args.micro_batch * args.grad_accum  # per optimizer step
        head_ms = 3 * 2 * tokens * shapes.head_s / (rate * 1e12) * 1e3
        split = sum(
            v for k, v in result.items() if k.startswith("ms/") and not k.endswith("step")
        )  # the phases (`ms/step` is ours whole, `ms/<baseline>_step` a baseline's)
        result["student_lm_head_matmul_ms"] = head_ms
        result["student_loss_beyond_lm_head_fraction"] = (
            max(result["ms/student_loss"] - head_ms, 0.0) / split
        )


def _lm_head_size(model) -> int:
    return model.get_output_embeddings().weight.numel()


def print_table(result: dict) -> None:
    keys = [
        "device",
        "student",
        "teachers",
        "targets",
        "seq_len",
        "micro_batch",
        "grad_accum",
        "checkpoint_scope",
        "checkpoint_blocks",
        "teacher_padding",
        "graphs_compiled_in_timed_steps",
        "tokens_per_s",
        "mfu",
        "fraction_of_measured_matmul",
        "peak_gib",
        "loader_fraction",
        "target_wait_fraction",
        "processes",
        "gpus",
        "layout",
        "per_gpu_tokens_per_s",
        "peak_gib_per_rank",
        "one_gpu_tokens_per_s",
        "per_gpu_vs_one_gpu",
        "attention",
        "student_loss_fraction",
        "student_loss_beyond_lm_head_fraction",
        "teacher_fraction",
        "naive_tokens_per_s",
        "naive_mfu",
        "naive_peak_gib",
        "speedup_vs_naive",
        "cached_tokens_per_s",
        "speedup_vs_live",
        "cached_peak_gib",
        "student_only_peak_gib",
        "cached_loader_fraction",
        "cache_bytes_per_token",
        "cache_build_fraction_of_forward",
    ]
    for k in keys:
        if k in result and result[k] is not None:
            v = result[k]
            print(f"{k:30s} {v:.4g}" if isinstance(v, float) else f"{k:30s} {v}")
    print("time split (ms per step):")
    for k, v in sorted(result.items()):
        if k.startswith("ms/"):
            print(f"  {k[3:]:28s} {v:8.1f}")

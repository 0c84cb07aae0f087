"""`crossdistill bench step`: the real distillation step on random-init models of real shapes.

Real tokenizers, real text (this machine's Python sources) through the real collator, the real
teachers' targets, chunked loss, backward and fused AdamW, timed after warm-up. Reports tokens/s
(student tokens), model-FLOPs utilisation against the dense-bf16 datasheet peak (and against the
bf16 matmul rate measured in the same run), peak memory, and the time split. With
`--baseline naive` it also times what a user would write without this library, on the same
models and the same student batch: plain HF forwards with full logits, fp32 log-softmax losses
over the full vocabularies (the teacher fed the student's ids: no alignment), fused AdamW.

FLOPs per student token: 6·N_s + 2·Σ N_t·(T_t/T_s) for the weight matmuls (lm_head included,
embeddings not), plus attention: 6·L_s·T·d_s (training: 3x the 2·T·d causal forward) and
2·L_t·T_t·d_t per teacher.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

from crossdistill.config import CHECKPOINT_SCOPES

ABLATIONS = {
    "sdpa": "transformers' SDPA attention with the block mask from positions (not varlen)",
    "eager": "no torch.compile (with --compile)",
    "torch-varlen": "torch.nn.attention.varlen_attn (its own backend choice) for varlen attention",
    "full-topk": "teacher top-k by torch.topk over the whole vocabulary (not from the blocks "
    "with the largest maxima)",
    "fp32-queries": "attention of the float32 student in float32 under autocast (misses flash: "
    "the masked path over all T² scores)",
}
VARIANTS = {
    "bitmask-stats": "teacher targets by top-k from the blocks, then the stats kernel over the "
    "whole chunk with a bitmask of the top-k (instead of one pass of per-block maxima and sums)",
}
TEACHER_PADDING = {"auto": "auto", "drop": "on", "keep": "off"}  # -> DROP_TEACHER_PADDING mode
DATASHEET_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
EXAMPLES = """examples:
  crossdistill bench step --teacher qwen3-4b --teacher-tokenizer $TOK/qwen3/hf \\
      --student llama-3.2-1b --student-tokenizer $TOK/llama3/hf --seq-len 2048 --baseline naive
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
        help="micro-batches per optimizer step (ours and the naive step alike)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--loss", default="forward_kl")
    p.add_argument("--loss-chunk-size", type=int, default=4096)
    p.add_argument("--baseline", choices=["none", "naive"], default="none")
    for flag, table, what in (
        ("--ablate", ABLATIONS, "with one optimisation undone"),
        ("--variant", VARIANTS, "with an alternative not on by default"),
    ):
        p.add_argument(
            flag,
            action="append",
            default=[],
            choices=sorted(table),
            help=f"also time the step {what} (repeatable): "
            + "; ".join(f"{k}: {v}" for k, v in sorted(table.items())),
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
        "--teacher-padding",
        choices=sorted(TEACHER_PADDING),
        default="auto",
        help="cross teachers' bodies over their non-pad tokens alone (drop), over the padded "
        "rows (keep), or drop where flash attention covers every layer (auto). Compare them in "
        "separate runs: switched inside one process (as an ablation) the padded rows timed "
        "3-12%% slower than in a run of their own on an H200, cause unknown",
    )
    p.add_argument(
        "--profile", action="store_true", help="profile 2 real steps: top kernels, busy fraction"
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


def _flops_per_student_token(s: Shape, teachers: list[tuple[Shape, float]], t_s: int) -> float:
    """Training FLOPs per student token; `teachers` holds (shape, teacher tokens per student token)."""
    flops = 6 * s.params_matmul + 6 * s.layers * t_s * s.attn_dim
    for t, ratio in teachers:
        t_t = t_s * ratio
        flops += ratio * (2 * t.params_matmul + 2 * t.layers * t_t * t.attn_dim)
    return flops


class Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0


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
    from crossdistill.train import step as train_step_module

    padding = args.teacher_padding
    saved = train_step_module.DROP_TEACHER_PADDING
    train_step_module.DROP_TEACHER_PADDING = {"mode": TEACHER_PADDING[padding]}
    try:
        result = _measure(args)
    finally:
        train_step_module.DROP_TEACHER_PADDING = saved
    result["teacher_padding"] = padding
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0


def _measure(args: argparse.Namespace) -> dict:
    """Every timing `args` asks for, with FLOPs, MFU and the run's facts (`_finish`)."""
    from crossdistill.bench.step_setup import (
        build_bench,
        naive_step,
        profile_real_step,
        profiled_step,
        retimed_steps,
        timed_steps,
    )

    bench = build_bench(args)
    result = timed_steps(bench, args)
    bench.teacher_ratio = result["teacher_tokens_per_student_token"]
    result.update(profiled_step(bench, args))
    if args.profile:
        result["profile"] = profile_real_step(bench, args)
    for kind in ("ablate", "variant"):
        for name in getattr(args, kind):
            result.update(retimed_steps(bench, args, kind, name))
    if args.baseline == "naive":
        result.update(naive_step(bench, args))
    result["matmul_tflops_measured"] = _matmul_tflops(bench.device)
    _finish(result, bench, args)
    return result


def _finish(result: dict, bench, args) -> None:
    import torch

    s = _shape(bench.student)
    teachers = [(_shape(t.teacher.model), r) for t, r in zip(bench.slots, bench.teacher_ratio)]
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
        teacher_tokens_per_student_token=bench.teacher_ratio,
    )
    for key in ("", "naive_"):
        tps = result.get(f"{key}tokens_per_s")
        if tps is None:
            continue
        achieved = tps * flops / 1e12
        result[f"{key}tflops"] = achieved
        result[f"{key}mfu"] = achieved / peak if peak else None
        if result.get("matmul_tflops_measured"):
            result[f"{key}fraction_of_measured_matmul"] = (
                achieved / result["matmul_tflops_measured"]
            )
    for key in [k for k in result if k.endswith("/teacher_tokens_per_student_token")]:
        # an ablation or variant: timed on later batches, so FLOPs from its own teacher tokens
        prefix = key.removesuffix("teacher_tokens_per_student_token")
        own = [(_shape(t.teacher.model), r) for t, r in zip(bench.slots, result[key])]
        achieved = result[f"{prefix}tokens_per_s"] * _flops_per_student_token(s, own, args.seq_len)
        result[f"{prefix}mfu"] = achieved / 1e12 / peak if peak else None
    if result.get("naive_tokens_per_s"):
        result["speedup_vs_naive"] = result["tokens_per_s"] / result["naive_tokens_per_s"]
    rate = result.get("matmul_tflops_measured")
    if rate and "ms/student_loss" in result:
        # the loss phases hold the lm_head matmuls any step runs (the student's three, each
        # teacher's one): what the loss adds beyond them, at the matmul rate of this run
        tokens = args.seq_len * args.micro_batch * args.grad_accum  # per optimizer step
        head = 3 * 2 * tokens * _lm_head_size(bench.student)
        head += sum(
            2 * tokens * r * _lm_head_size(t.teacher.model)
            for t, r in zip(bench.slots, bench.teacher_ratio)
        )
        head_ms = head / (rate * 1e12) * 1e3
        split = sum(v for k, v in result.items() if k.startswith("ms/") and k != "ms/step")
        split -= result.get("ms/naive_step", 0.0)
        loss_ms = result["ms/student_loss"] + sum(
            v for k, v in result.items() if k.startswith("ms/teacher_targets")
        )
        result["lm_head_matmul_ms"] = head_ms
        result["loss_fraction_beyond_lm_head"] = max(loss_ms - head_ms, 0.0) / split


def _lm_head_size(model) -> int:
    return model.get_output_embeddings().weight.numel()


def _print_table(result: dict) -> None:
    keys = [
        "device",
        "student",
        "teachers",
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
        "loss_fraction",
        "loss_fraction_beyond_lm_head",
        "student_loss_fraction",
        "teacher_targets_fraction",
        "naive_tokens_per_s",
        "naive_mfu",
        "naive_peak_gib",
        "speedup_vs_naive",
    ]
    for k in keys:
        if k in result and result[k] is not None:
            v = result[k]
            print(f"{k:30s} {v:.4g}" if isinstance(v, float) else f"{k:30s} {v}")
    for k, v in sorted(result.items()):
        if k.startswith(("ablate/", "variant/")) and isinstance(v, float):
            print(f"{k:30s} {v:.4g}")
    print("time split (ms per step):")
    for k, v in sorted(result.items()):
        if k.startswith("ms/"):
            print(f"  {k[3:]:28s} {v:8.1f}")
    if "profile" in result:
        from crossdistill.bench.profile import format_profile

        print(format_profile(result["profile"]))

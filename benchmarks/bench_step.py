"""`crossdistill bench step` and what only a benchmark needs beside it: the phase-by-phase
split of a step, a profile of real steps, and the naive baseline (what a user writes without
this library). The package's command times the real step and reports FLOPs and MFU; this script
adds its extras through the command's `extras` hook, on the same run.

    python benchmarks/bench_step.py --teacher qwen3-4b --teacher-tokenizer $TOK/qwen3/hf \\
        --student llama-3.2-1b --student-tokenizer $TOK/llama3/hf --seq-len 2048 \\
        --compile --split --profile --baseline naive --json

Naive baseline: plain HF forwards with full logits, fp32 log-softmax losses over the full
vocabularies (the teacher fed the student's ids: no alignment), CE, transformers' SDPA attention
(packed documents through position ids), eager modules, fused AdamW; same architectures, same
student batches, models of its own (ours are dropped first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager

import torch
from profile_summary import find_syncs, format_profile, profile_steps

from crossdistill.bench.step import add_parser, measure, print_table
from crossdistill.bench.step_setup import Bench, next_window, one_step, sync_device
from crossdistill.losses import kd_count, student_loss
from crossdistill.models.attention import segments_of
from crossdistill.models.forward import final_hidden
from crossdistill.train.step import make_term


def profile_real_step(bench: Bench, args, steps: int = 2) -> dict:
    """`torch.profiler` over real steps (see `profile_summary.py`)."""
    dev = bench.device

    def step():
        one_step(bench, next_window(bench, args))

    out = profile_steps(step, steps, dev.type == "cuda")
    if dev.type == "cuda":
        out["syncs"] = find_syncs(step)
    return out


def profiles_per_rank(bench: Bench, profile: dict) -> list[dict] | None:
    """Every rank's profile, on every rank, when the job's processes all run the student (a
    job with separate teachers keeps the student's only: None)."""
    import torch.distributed as dist

    env = bench.c.env
    if env.world_size == 1 or env.job_size != env.world_size:
        return None
    out: list = [None] * env.world_size
    dist.all_gather_object(out, profile)
    return out


class Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0


def profiled_step(bench: Bench, args, repeats: int = 3) -> dict[str, float]:
    """The same work as a step, phase by phase with a device sync between phases (slower than
    the real step; used for the split only). Times are per optimizer step."""
    c, dev, timer = bench.c, bench.device, Timer(bench.device.type == "cuda")
    chunk = bench.settings.loss_chunk_size
    autocast = bench.settings.autocast
    for i in range(repeats * args.grad_accum):
        batch = next(bench.loader).to(dev)
        labels = batch.student.labels.flatten()
        terms = []
        for k, slot in enumerate(c.slots):
            tb = batch.teachers[k]
            with timer(f"teacher/{slot.cfg.name}"):  # body, lm_head and top-k
                targets = c.placement.teacher_targets(slot, k, tb, chunk)
            term = make_term(slot, tb, targets, dev, batch.student.input_ids)
            term.denominator = kd_count(term, labels).to(torch.float32)
            terms.append(term)
        with timer("student_body_forward"), torch.autocast(dev.type, torch.bfloat16, autocast):
            hidden_s = final_hidden(
                c.student,
                batch.student.input_ids,
                batch.student.position_ids,
                segments_of(batch.student, dev),
            )
        with timer("student_loss"), torch.autocast(dev.type, torch.bfloat16, autocast):
            loss, _ = student_loss(
                hidden_s.flatten(0, 1),
                c.student.get_output_embeddings().weight,
                labels,
                terms,
                kd_ratio=bench.settings.kd_ratio,
                chunk_size=chunk,
            )
        with timer("backward"):
            loss.backward()
        if (i + 1) % args.grad_accum:
            continue  # the optimizer steps once per window of micro-batches
        with timer("optimizer"):
            torch.nn.utils.clip_grad_norm_(c.student.parameters(), 1.0)
            c.optimizer.step()
            c.optimizer.zero_grad(set_to_none=True)
    total = sum(timer.totals.values())
    out = {f"ms/{k}": 1e3 * v / repeats for k, v in timer.totals.items()}
    teachers = sum(v for k, v in timer.totals.items() if k.startswith("teacher/"))
    # the student's pass alone (CE and every teacher's KD terms, lm_head forward and backward
    # included), and the teachers (bodies, lm_heads and top-k)
    out["student_loss_fraction"] = timer.totals.get("student_loss", 0.0) / total
    out["teacher_fraction"] = teachers / total
    return out


def naive_step(bench: Bench, args) -> dict[str, float]:
    """What a user writes without this library, same architectures, same student batches: full
    logits, fp32 log-softmax, forward KL over the shared leading vocabulary ids (no alignment),
    CE, transformers' SDPA attention (packed documents through position ids), eager modules,
    no recomputation. Runs last, on models of its own: ours are dropped first."""
    import torch.nn.functional as F

    from crossdistill.models import build_causal_lm

    dev, cfg = bench.device, bench.cfg
    batches = [
        [next(bench.loader).to(dev) for _ in range(args.grad_accum)] for _ in range(args.steps)
    ]
    bench.c = None  # free our models and optimizer state: the baseline brings its own
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    def plain(m, dtype: torch.dtype, seed: int):
        return build_causal_lm(
            arch=m.arch,
            device=dev,
            dtype=dtype,
            overrides=m.overrides,
            attn_implementation="sdpa",
            seed=seed,
        )

    student = plain(cfg.student, torch.float32, 0)
    t_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    teachers = [
        plain(t, t_dtype, 1 + i).eval().requires_grad_(False) for i, t in enumerate(cfg.teachers)
    ]
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5, fused=dev.type == "cuda")

    def step(window: list) -> None:
        for batch in window:
            micro_step(batch, scale=1 / len(window))
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def micro_step(batch, scale: float) -> None:
        sb = batch.student
        ids, labels, pos = sb.input_ids, sb.labels, sb.position_ids
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            logits_s = student(input_ids=ids, position_ids=pos, use_cache=False).logits
            kl = 0.0
            for teacher in teachers:
                with torch.no_grad():
                    v_t = teacher.get_output_embeddings().weight.shape[0]
                    logits_t = teacher(
                        input_ids=ids.clamp(max=v_t - 1), position_ids=pos, use_cache=False
                    ).logits
                v = min(v_t, logits_s.shape[-1])
                logp_t = F.log_softmax(logits_t.float(), -1)[..., :v]
                logp_s = F.log_softmax(logits_s.float(), -1)[..., :v]
                mask = (labels >= 0).float()
                kl = kl + ((logp_t.exp() * (logp_t - logp_s)).sum(-1) * mask).sum() / mask.sum()
            ce = F.cross_entropy(
                logits_s.float().flatten(0, 1), labels.flatten(), ignore_index=-100
            )
            loss = 0.5 * ce + 0.5 * kl / max(len(teachers), 1)
        (loss * scale).backward()

    try:
        for b in batches[: args.warmup]:
            step(b)
    except torch.OutOfMemoryError:
        # the naive step does not fit this device at this micro-batch: say so, keep ours
        return {"naive_error": f"out of memory at micro-batch {args.micro_batch}"}
    sync_device(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    tokens = 0
    for window in batches:
        tokens += sum(b.student.input_ids.numel() for b in window)
        step(window)
    sync_device(dev)
    total = time.perf_counter() - t0
    out = {"naive_tokens_per_s": tokens / total, "ms/naive_step": 1e3 * total / len(batches)}
    if dev.type == "cuda":
        out["naive_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench_step", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="bench")
    add_parser(sub)
    step = sub.choices["step"]
    step.add_argument("--split", action="store_true", help="time the step phase by phase")
    step.add_argument(
        "--profile", action="store_true", help="profile 2 real steps: top kernels, busy fraction"
    )
    step.add_argument("--baseline", choices=["none", "naive"], default="none")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(["step", *(sys.argv[1:] if argv is None else argv)])

    def extras(bench: Bench, result: dict) -> None:
        if args.split:
            result.update(profiled_step(bench, args))
        if args.profile:
            result["profile"] = profile_real_step(bench, args)
            per_rank = profiles_per_rank(bench, result["profile"])
            if per_rank is not None:
                result["profile_per_rank"] = per_rank
        if args.baseline == "naive":
            result.update(naive_step(bench, args))  # last: it drops our models

    result = measure(args, extras)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # a job under torchrun reports once, from its first process
    result["command"] = "python benchmarks/bench_step.py " + " ".join(sys.argv[1:])
    if args.json:
        print(json.dumps(result))
        return 0
    print_table(result)
    for rank, p in enumerate(result.get("profile_per_rank") or [result.get("profile")]):
        if p is not None:
            print(f"rank {rank}: " + format_profile(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

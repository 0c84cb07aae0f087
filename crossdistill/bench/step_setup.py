"""The pieces of `crossdistill bench step`: building the models and data, timing the real step,
a phase-by-phase profile, and the naive baseline."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crossdistill.config import DataConfig, OptimConfig, TeacherConfig
from crossdistill.losses import kd_count, student_loss
from crossdistill.models import Teacher, build_causal_lm, load_tokenizer
from crossdistill.models.attention import segments_of, set_attention
from crossdistill.models.forward import final_hidden
from crossdistill.train.optim import build_optimizer
from crossdistill.train.step import StepSettings, TeacherSlot, make_term, train_step

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


@dataclass
class Bench:
    device: torch.device
    student: Any
    tok_s: Any
    slots: list[TeacherSlot]
    optimizer: Any
    loader: Any
    settings: StepSettings
    teacher_ratio: list[float]
    workdir: Any


def _corpus(workdir: Path, min_bytes: int) -> Path:
    """Real text from this machine: the Python standard library's sources, as JSONL."""
    from crossdistill.train.demo_assets import stdlib_corpus

    train, val = stdlib_corpus(max_files=2000, train_bytes=min_bytes, val_bytes=1)
    path = workdir / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in train + val:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def build_bench(args) -> Bench:
    from crossdistill.train.build import build_projection_for

    device = torch.device(args.device)
    workdir = tempfile.TemporaryDirectory(prefix="crossdistill-bench-")
    tok_s = load_tokenizer(args.student_tokenizer)
    toks_t = [load_tokenizer(t) for t in args.teacher_tokenizer]
    overrides = TINY if args.tiny else {}
    student = build_causal_lm(
        arch=args.student, device=device, dtype=torch.float32, overrides=overrides, seed=0
    )
    rows_s = student.get_output_embeddings().weight.shape[0]
    slots = []
    for i, (arch, tok) in enumerate(zip(args.teacher, toks_t)):
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = build_causal_lm(
            arch=arch, device=device, dtype=dtype, overrides=overrides, seed=1 + i
        )
        tcfg = TeacherConfig(name=f"{i}-{arch}", arch=arch, loss=args.loss, top_k=args.top_k)
        proj = build_projection_for(
            tcfg, tok, tok_s, model.get_output_embeddings().weight.shape[0], rows_s, device
        )
        slots.append(TeacherSlot(Teacher(model, tcfg.name), tcfg, proj))
    loader = bench_loader(args, Path(workdir.name), tok_s, toks_t, cuda=device.type == "cuda")
    settings = StepSettings(
        kd_ratio=0.5,
        teacher_mode="weighted",
        loss_chunk_size=args.loss_chunk_size,
        autocast=device.type == "cuda",
        device=device,
    )
    if args.checkpoint_blocks:
        from crossdistill.distributed.parallelize import apply_activation_checkpointing

        student.train()
        apply_activation_checkpointing(student, args.checkpoint_blocks, args.checkpoint_scope)
    if args.compile:
        from crossdistill.distributed.parallelize import apply_compile

        for model in [student] + [slot.teacher.model for slot in slots]:
            apply_compile(model)
    optimizer = build_optimizer(student, OptimConfig())
    bench = Bench(device, student, tok_s, slots, optimizer, iter(loader), settings, [], workdir)
    bench.teacher_ratio = first_ratio(next(bench.loader))  # the timed steps count their own
    return bench


def first_ratio(batch) -> list[float]:
    """Each teacher's non-pad tokens per non-pad student token in one batch."""
    n_s = int((batch.student.doc_ids >= 0).sum())
    return [float((tb.doc_ids >= 0).sum()) / max(n_s, 1) for tb in batch.teachers]


def bench_loader(args, folder: Path, tok_s, toks_t, cuda: bool):
    """The benchmark's loader: this interpreter's standard-library sources (written to
    `folder`), enough for every micro-batch `args` asks for, through the real collator; the
    same batches in the same order for the same arguments and Python version."""
    from crossdistill.data import build_loader

    steps = (args.warmup + args.steps) * args.grad_accum + 4
    corpus = _corpus(folder, min_bytes=steps * args.micro_batch * args.seq_len * 5)
    data_cfg = DataConfig(
        train=[str(corpus)],
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch,
        num_workers=4 if cuda else 0,
        val_fraction=0.0,
    )
    return build_loader(data_cfg, tok_s, toks_t, split="train")


def count_tokens(batch, counts: list[int]) -> None:
    """`counts` (student row slots, then each teacher's non-pad tokens) plus `batch`'s, counted
    on its host copy."""
    counts[0] += batch.student.input_ids.numel()
    for k, tb in enumerate(batch.teachers):
        counts[1 + k] += int((tb.doc_ids >= 0).sum())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _next_window(bench: Bench, args, counts: list[int] | None = None) -> list:
    """The micro-batches of one optimizer step, on the device. `counts` (student tokens, then
    each teacher's non-pad tokens) grows by the window's, counted on the host copies."""
    window = []
    for _ in range(args.grad_accum):
        batch = next(bench.loader)
        if counts is not None:
            count_tokens(batch, counts)
        window.append(batch.to(bench.device, non_blocking=True))
    return window


def _one_step(bench: Bench, window: list) -> None:
    train_step(bench.student, bench.slots, window, bench.settings)
    torch.nn.utils.clip_grad_norm_(bench.student.parameters(), 1.0)
    bench.optimizer.step()
    bench.optimizer.zero_grad(set_to_none=True)


def timed_steps(bench: Bench, args) -> dict[str, float]:
    """Warm-up, then `args.steps` real steps; the loader's blocking time is measured apart."""
    dev = bench.device
    for _ in range(args.warmup):
        _one_step(bench, _next_window(bench, args))
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    wait = 0.0
    counts = [0] * (1 + len(bench.slots))
    graphs = _graphs_compiled()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        w0 = time.perf_counter()
        window = _next_window(bench, args, counts)
        wait += time.perf_counter() - w0
        _one_step(bench, window)
    _sync(dev)
    total = time.perf_counter() - t0
    tokens = counts[0]
    out = {
        "tokens_per_s": tokens / total,
        "ms/step": 1e3 * total / args.steps,
        "loader_fraction": wait / total,
        # the teachers' work per student token in exactly the timed batches (it varies from
        # batch to batch by several percent): what the FLOP count uses
        "teacher_tokens_per_student_token": [c / max(tokens, 1) for c in counts[1:]],
        # graphs `torch.compile` built inside the timed steps (compile time counted in them):
        # above 0, the warm-up did not cover every shape and the timing is not a steady state
        "graphs_compiled_in_timed_steps": _graphs_compiled() - graphs,
    }
    if dev.type == "cuda":
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def _graphs_compiled() -> int:
    """How many graphs `torch.compile` has built in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def profile_real_step(bench: Bench, args, steps: int = 2) -> dict:
    """`torch.profiler` over real steps (see `crossdistill.bench.profile`)."""
    from crossdistill.bench.profile import find_syncs, profile_steps

    dev = bench.device

    def step():
        _one_step(bench, _next_window(bench, args))

    out = profile_steps(step, steps, dev.type == "cuda")
    if dev.type == "cuda":
        out["syncs"] = find_syncs(step)
    return out


def retimed_steps(bench: Bench, args, kind: str, name: str) -> dict[str, float]:
    """The real step timed again under one switch: an optimisation undone (`kind` "ablate",
    `ABLATIONS` in `bench.step`) or an alternative switched on ("variant", `VARIANTS`)."""
    do, undo = _switch(bench, args, name)
    do()
    try:
        out = timed_steps(bench, args)
    finally:
        undo()
    return {f"{kind}/{name}/{k}": v for k, v in out.items() if k != "loader_fraction"}


def _switch(bench: Bench, args, name: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(switch on, switch back) for one ablation or variant."""
    from crossdistill.distributed.parallelize import apply_compile, remove_compile
    from crossdistill.losses import targets
    from crossdistill.models import attention

    models = [bench.student] + [s.teacher.model for s in bench.slots]

    def on_each(fn: Callable[[Any], None]) -> Callable[[], None]:
        def run() -> None:
            for model in models:
                fn(model)

        return run

    if name == "eager":
        return on_each(remove_compile), on_each(apply_compile if args.compile else lambda m: None)
    if name == "sdpa":
        return (
            on_each(lambda m: set_attention(m, "sdpa")),
            on_each(lambda m: set_attention(m, "varlen")),
        )
    if name == "torch-varlen":
        return (
            lambda: attention.set_varlen_backend("torch"),
            lambda: attention.set_varlen_backend("flash"),
        )
    replaced = {  # name: (module, attribute, its value during the run)
        "fp32-queries": (attention, "compute_dtype", lambda query: query.dtype),
        "full-topk": (targets, "topk_by_blocks", lambda z, k: z.topk(k, dim=1)),
        "bitmask-stats": (targets, "TARGET_FLOW", {"name": "bitmask"}),
    }
    if name not in replaced:
        raise ValueError(f"unknown ablation or variant {name!r}")
    module, attr, value = replaced[name]
    old = getattr(module, attr)
    return lambda: setattr(module, attr, value), lambda: setattr(module, attr, old)


def profiled_step(bench: Bench, args, repeats: int = 3) -> dict[str, float]:
    """The same work as a step, phase by phase with a device sync between phases (slower than
    the real step; used for the split only). Times are per optimizer step."""
    from crossdistill.bench.step import Timer
    from crossdistill.train.step import targets_from_hidden, teacher_hidden

    dev, timer = bench.device, Timer(bench.device.type == "cuda")
    for i in range(repeats * args.grad_accum):
        batch = next(bench.loader).to(dev)
        labels = batch.student.labels.flatten()
        terms = []
        for k, slot in enumerate(bench.slots):
            tb = batch.teachers[k]
            with timer(f"teacher_body/{slot.cfg.name}"):
                hidden, rows = teacher_hidden(slot, tb, dev)
            with timer(f"teacher_targets/{slot.cfg.name}"):
                chunk = bench.settings.loss_chunk_size
                targets = targets_from_hidden(slot, tb, hidden, rows, chunk, dev)
            term = make_term(slot, tb, targets, dev)
            term.denominator = kd_count(term, labels).to(torch.float32)
            terms.append(term)
        with (
            timer("student_body_forward"),
            torch.autocast(dev.type, torch.bfloat16, enabled=bench.settings.autocast),
        ):
            hidden_s = final_hidden(
                bench.student,
                batch.student.input_ids,
                batch.student.position_ids,
                segments_of(batch.student, dev),
            )
        with (
            timer("student_loss"),
            torch.autocast(dev.type, torch.bfloat16, enabled=bench.settings.autocast),
        ):
            loss, _ = student_loss(
                hidden_s.flatten(0, 1),
                bench.student.get_output_embeddings().weight,
                labels,
                terms,
                kd_ratio=0.5,
                chunk_size=bench.settings.loss_chunk_size,
            )
        with timer("backward"):
            loss.backward()
        if (i + 1) % args.grad_accum:
            continue  # the optimizer steps once per window of micro-batches
        with timer("optimizer"):
            torch.nn.utils.clip_grad_norm_(bench.student.parameters(), 1.0)
            bench.optimizer.step()
            bench.optimizer.zero_grad(set_to_none=True)
    total = sum(timer.totals.values())
    out = {f"ms/{k}": 1e3 * v / repeats for k, v in timer.totals.items()}
    loss_time = sum(
        v for k, v in timer.totals.items() if k.startswith("teacher_targets") or k == "student_loss"
    )
    out["loss_fraction"] = loss_time / total  # both loss phases: student pass + teacher targets
    # the student's pass alone (CE and every teacher's KD terms, lm_head forward and backward
    # included), and the teachers' top-k extraction (their lm_head and top-k)
    out["student_loss_fraction"] = timer.totals.get("student_loss", 0.0) / total
    out["teacher_targets_fraction"] = (
        sum(v for k, v in timer.totals.items() if k.startswith("teacher_targets")) / total
    )
    return out


def naive_step(bench: Bench, args) -> dict[str, float]:
    """What a user writes without this library, same models, same student batch: full logits,
    fp32 log-softmax, forward KL over the shared leading vocabulary ids (no alignment), CE,
    transformers' SDPA attention (packed documents through position ids). Runs last: it drops
    our optimizer and switches the models' attention."""
    import torch.nn.functional as F

    dev = bench.device
    bench.optimizer.zero_grad(set_to_none=True)
    bench.optimizer = None  # free our optimizer state: the baseline brings its own
    from crossdistill.distributed.parallelize import remove_compile, remove_recompute

    for model in [bench.student] + [s.teacher.model for s in bench.slots]:
        set_attention(model, "sdpa")  # transformers' default: the block mask from positions
        remove_compile(model)  # plain eager modules
        remove_recompute(model)  # and no recomputation (`--checkpoint-blocks`)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    opt = torch.optim.AdamW(bench.student.parameters(), lr=1e-5, fused=dev.type == "cuda")

    def step(window: list) -> None:
        for batch in window:
            micro_step(batch, scale=1 / len(window))
        torch.nn.utils.clip_grad_norm_(bench.student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def micro_step(batch, scale: float) -> None:
        ids, labels = batch.student.input_ids, batch.student.labels
        with torch.autocast(dev.type, torch.bfloat16, enabled=dev.type == "cuda"):
            logits_s = bench.student(
                input_ids=ids, position_ids=batch.student.position_ids, use_cache=False
            ).logits
            kl = 0.0
            for slot in bench.slots:
                with torch.no_grad():
                    v_t = slot.teacher.lm_head_weight.shape[0]
                    logits_t = slot.teacher.model(
                        input_ids=ids.clamp(max=v_t - 1),
                        position_ids=batch.student.position_ids,
                        use_cache=False,
                    ).logits
                v = min(v_t, logits_s.shape[-1])
                logp_t = F.log_softmax(logits_t.float(), -1)[..., :v]
                logp_s = F.log_softmax(logits_s.float(), -1)[..., :v]
                mask = (labels >= 0).float()
                kl = kl + ((logp_t.exp() * (logp_t - logp_s)).sum(-1) * mask).sum() / mask.sum()
            ce = F.cross_entropy(
                logits_s.float().flatten(0, 1), labels.flatten(), ignore_index=-100
            )
            loss = 0.5 * ce + 0.5 * kl / max(len(bench.slots), 1)
        (loss * scale).backward()

    batches = [
        [next(bench.loader).to(dev) for _ in range(args.grad_accum)] for _ in range(args.steps)
    ]
    try:
        for b in batches[: args.warmup]:
            step(b)
    except torch.OutOfMemoryError:
        # the naive step does not fit this device at this micro-batch: say so, keep ours
        return {"naive_error": f"out of memory at micro-batch {args.micro_batch}"}
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    tokens = 0
    for window in batches:
        tokens += sum(b.student.input_ids.numel() for b in window)
        step(window)
    _sync(dev)
    total = time.perf_counter() - t0
    out = {"naive_tokens_per_s": tokens / total, "ms/naive_step": 1e3 * total / len(batches)}
    if dev.type == "cuda":
        out["naive_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out

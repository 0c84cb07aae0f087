"""The pieces of `crossdistill bench step`: the run's components built from a config exactly as
`crossdistill train` builds them, the real step timed, a phase-by-phase split, and the naive
baseline. Alternatives (attention, compile, recomputation, teacher padding) are options of the
config, so a comparison is two runs of this command (`benchmarks/step_ablations.py`)."""

from __future__ import annotations

import json
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from crossdistill.config import (
    Config,
    DataConfig,
    OptimConfig,
    StudentConfig,
    TeacherConfig,
    TrainConfig,
)
from crossdistill.losses import kd_count, student_loss
from crossdistill.models.attention import segments_of
from crossdistill.models.forward import final_hidden
from crossdistill.train.build import Components, build_components
from crossdistill.train.step import StepSettings, make_term, train_step

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
    cfg: Config
    c: Components
    loader: Any
    settings: StepSettings
    teacher_ratio: list[float]
    workdir: Any
    device: torch.device


def write_corpus(workdir: Path, args) -> Path:
    """Real text from this machine, enough for every micro-batch `args` asks for: the Python
    standard library's sources, as JSONL (the same text for the same Python version)."""
    micro_batches = (args.warmup + args.steps) * args.grad_accum + 4
    min_bytes = micro_batches * args.micro_batch * args.seq_len * 5
    from crossdistill.train.demo_assets import stdlib_corpus

    train, val = stdlib_corpus(max_files=2000, train_bytes=min_bytes, val_bytes=1)
    path = workdir / "corpus.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in train + val:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def bench_config(args, corpus: Path) -> Config:
    """The `crossdistill train` config of the benchmark's run: random-init models of the
    presets' shapes (`--tiny`: a few narrow layers), this machine's Python sources."""
    cuda = torch.device(args.device).type == "cuda"
    overrides = dict(TINY) if args.tiny else {}
    model = {"overrides": overrides, "attn_implementation": args.attention, "compile": args.compile}
    student = StudentConfig(
        arch=args.student,
        tokenizer=args.student_tokenizer,
        dtype="float32",
        activation_checkpointing=args.checkpoint_blocks > 0,
        activation_checkpointing_blocks=args.checkpoint_blocks,
        activation_checkpointing_scope=args.checkpoint_scope,
        **model,
    )
    teachers = [
        TeacherConfig(
            name=f"{i}-{arch}",
            arch=arch,
            tokenizer=tok,
            dtype="bfloat16" if cuda else "float32",
            loss=args.loss,
            top_k=args.top_k,
            **model,
        )
        for i, (arch, tok) in enumerate(zip(args.teacher, args.teacher_tokenizer))
    ]
    data = DataConfig(
        train=[str(corpus)],
        seq_len=args.seq_len,
        micro_batch_size=args.micro_batch,
        num_workers=4 if cuda else 0,
    )
    train = TrainConfig(
        steps=args.warmup + args.steps,
        grad_accum=args.grad_accum,
        kd_ratio=0.5,
        loss_chunk_size=args.loss_chunk_size,
        device=args.device,
        teacher_padding=args.teacher_padding,
        loss_kernels=args.loss_kernels,
    )
    return Config(student=student, teachers=teachers, data=data, optim=OptimConfig(), train=train)


def build_bench(args) -> Bench:
    workdir = tempfile.TemporaryDirectory(prefix="crossdistill-bench-")
    cfg = bench_config(args, write_corpus(Path(workdir.name), args))
    c = build_components(cfg)
    settings = StepSettings.of(cfg.train, c.device)
    bench = Bench(cfg, c, iter(c.train_loader), settings, [], workdir, c.device)
    bench.teacher_ratio = first_ratio(next(bench.loader))  # the timed steps count their own
    return bench


def first_ratio(batch) -> list[float]:
    """Each teacher's non-pad tokens per non-pad student token in one batch."""
    n_s = int((batch.student.doc_ids >= 0).sum())
    return [float((tb.doc_ids >= 0).sum()) / max(n_s, 1) for tb in batch.teachers]


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
    c = bench.c
    train_step(c.student, c.slots, window, bench.settings, c.placement)
    torch.nn.utils.clip_grad_norm_(c.student.parameters(), 1.0)
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)


def timed_steps(bench: Bench, args) -> dict[str, float]:
    """Warm-up, then `args.steps` real steps; the loader's blocking time is measured apart."""
    dev = bench.device
    for _ in range(args.warmup):
        _one_step(bench, _next_window(bench, args))
    _sync(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    wait = 0.0
    counts = [0] * (1 + len(bench.c.slots))
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
            term = make_term(slot, tb, targets, dev)
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

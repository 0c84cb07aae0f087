"""The pieces of `crossdistill bench step`: the run's components built from a config exactly as
`crossdistill train` builds them, the real step timed, a phase-by-phase split, and the naive
baseline. Alternatives (attention, compile, recomputation, teacher padding) are options of the
config, so a comparison is two runs of this command (`benchmarks/step_ablations.py`)."""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from crossdistill.config import (
    Config,
    DataConfig,
    OptimConfig,
    StudentConfig,
    TeacherConfig,
    TrainConfig,
    apply_overrides,
)
from crossdistill.distributed.runtime import target_wait
from crossdistill.train.build import Components, build_components
from crossdistill.train.step import PHASE_OPTIMIZER, StepSettings, train_step

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

    def close(self) -> None:
        """Stop the loader's workers, then remove the corpus they read (in that order: a
        worker whose file vanished under it dies mid-read)."""
        self.loader.close()
        self.workdir.cleanup()

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def bench_config(args, corpus: Path, caches: list[str] | None = None) -> Config:
    """The `crossdistill train` config of the benchmark's run: random-init models of the
    presets' shapes (`--tiny`: a few narrow layers), this machine's Python sources; with
    `caches`, each teacher read from its cache folder instead; each teacher placed as
    `--teacher-placement` says (separate: one process of its own)."""
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
            arch=None if caches else arch,
            cache=caches[i] if caches else None,
            tokenizer=tok,
            dtype="bfloat16" if cuda else "float32",
            loss=args.loss,
            top_k=args.top_k,
            target=getattr(args, "target", TeacherConfig.target),
            placement=getattr(args, "teacher_placement", "colocated"),
            ranks=getattr(args, "teacher_ranks", 1),
            **model,
        )
        for i, (arch, tok) in enumerate(zip(args.teacher, args.teacher_tokenizer))
    ]
    data = DataConfig(  # no step is validated: the held-out set only has to exist
        train=[str(corpus)],
        validation=[str(corpus)],
        val_fraction=0.0,
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
    cfg = Config(student=student, teachers=teachers, data=data, optim=OptimConfig(), train=train)
    return apply_overrides(cfg, list(getattr(args, "set", None) or []))


def build_bench(args, caches: list[str] | None = None, env: Any = None) -> Bench:
    """The benchmark's run, built by the trainer's code (`env`: this process's place in a job
    of several, as for a separate teacher; default: one process)."""
    workdir = tempfile.TemporaryDirectory(prefix="crossdistill-bench-")
    cfg = bench_config(args, write_corpus(Path(workdir.name), args), caches)
    c = build_components(cfg, env)
    settings = StepSettings.of(cfg.train, c.device)
    bench = Bench(cfg, c, iter(c.train_loader), settings, [], workdir, c.device)
    if all(s.stream is None for s in c.slots):
        # a first look at the ratio (the timed steps count their own); the recorded results
        # time the batches after this one. A separate teacher serves every batch in order, so
        # there the student reads none apart.
        bench.teacher_ratio = first_ratio(next(bench.loader))
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


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def next_window(bench: Bench, args, counts: list[int] | None = None) -> list:
    """The micro-batches of one optimizer step, on the device. `counts` (student tokens, then
    each teacher's non-pad tokens) grows by the window's, counted on the host copies."""
    window = []
    for _ in range(args.grad_accum):
        batch = next(bench.loader)
        if counts is not None:
            count_tokens(batch, counts)
        window.append(batch.to(bench.device, non_blocking=True))
    return window


def one_step(bench: Bench, window: list) -> None:
    c = bench.c
    train_step(c.student, c.slots, window, bench.settings, c.placement)
    with record_function(PHASE_OPTIMIZER):
        c.placement.clip_grads(c.student, 1.0)  # the trainer's (any layout)
        c.optimizer.step()
        c.optimizer.zero_grad(set_to_none=True)


def timed_steps(bench: Bench, args) -> dict[str, float]:
    """Warm-up, then `args.steps` real steps; the loader's blocking time is measured apart."""
    dev = bench.device
    for _ in range(args.warmup):
        one_step(bench, next_window(bench, args))
    sync_device(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    wait = 0.0
    counts = [0] * (1 + len(bench.c.slots))
    graphs = _graphs_compiled()
    waited = target_wait(bench.c.slots)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        w0 = time.perf_counter()
        window = next_window(bench, args, counts)
        wait += time.perf_counter() - w0
        one_step(bench, window)
    sync_device(dev)
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
    if waited is not None:  # separate teachers: the student's time spent waiting for targets
        out["target_wait_fraction"] = (target_wait(bench.c.slots) - waited) / total
    return out


def _graphs_compiled() -> int:
    """How many graphs `torch.compile` has built in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]

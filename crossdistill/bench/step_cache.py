"""`crossdistill bench step --teacher-cache`: the step with every teacher read from a cache,
beside the live step in one run.

In the live run's process, after its timed steps: each teacher's cache is built over the
benchmark's corpus (`train.cache_build.build_teacher_cache`, the teacher already in memory)
and the teacher's bare forward (body and lm_head logits, nothing kept) is timed over the same
packed documents. The live run is then closed, and two more runs are built and timed the same
way: the student with its teachers read from the caches, and the student alone (for peak
memory). Keys added: `cached_tokens_per_s`, `speedup_vs_live`, `cached_peak_gib`,
`cached_loader_fraction`, `student_only_peak_gib`, `cache_bytes_per_token`,
`cache_build_rate`, `bare_forward_rate` (tokens/s), `cache_build_fraction_of_forward`
(per teacher, lists).
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crossdistill.bench.step_setup import Bench, build_bench, sync_device, timed_steps
from crossdistill.data.documents import BadInputPolicy
from crossdistill.data.encoders import TokenizerSide
from crossdistill.distributed.layout import DistEnv
from crossdistill.models import load_tokenizer
from crossdistill.models.forward import final_hidden, packed_row
from crossdistill.train.cache_build import (
    BuildOptions,
    build_teacher_cache,
    iter_documents,
    teacher_tokens,
)


class CacheBench:
    """Builds the caches inside the live run (`extras`), then times the cached runs."""

    def __init__(self, args: Any):
        self.args = args
        self.dir = tempfile.TemporaryDirectory(prefix="crossdistill-cache-bench-")
        self.folders: list[Path] = []
        self.stats: dict[str, list[float]] = {}

    def extras(self, bench: Bench, result: dict) -> None:
        """In the live run: build each teacher's cache and time its bare forward."""
        options = BuildOptions(progress=False)
        env = DistEnv(device=bench.device)
        for k, slot in enumerate(bench.c.slots):
            folder = Path(self.dir.name) / f"t{k}"
            batch_tokens = 16384 if bench.device.type == "cuda" else 2048
            # first: its warm-up compiles the teacher's graphs for the build's row lengths
            bare = bare_forward_rate(slot.teacher, slot.cfg, bench.cfg, batch_tokens)
            sync_device(bench.device)
            m = build_teacher_cache(
                slot.teacher, slot.cfg, "random-init", bench.cfg, folder, options, env
            )
            self.folders.append(folder)
            rate = m["build_tokens"] / m["build_seconds"]
            for key, value in (
                ("cache_bytes_per_token", m["bytes"] / max(m["tokens"], 1)),
                ("cache_build_rate", rate),
                ("bare_forward_rate", bare),
                ("cache_build_fraction_of_forward", rate / bare),
            ):
                self.stats.setdefault(key, []).append(value)
        result.update(self.stats)

    def cached_runs(self) -> dict[str, Any]:
        """The step with the teachers read from the caches, then the student alone."""
        out: dict[str, Any] = {}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with build_bench(self.args, caches=[str(f) for f in self.folders]) as bench:
            timed = timed_steps(bench, self.args)
        out["cached_tokens_per_s"] = timed["tokens_per_s"]
        out["cached_loader_fraction"] = timed["loader_fraction"]
        out["ms/cached_step"] = timed["ms/step"]
        if "peak_gib" in timed:
            out["cached_peak_gib"] = timed["peak_gib"]
        del bench
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        alone = copy.copy(self.args)
        alone.teacher, alone.teacher_tokenizer = [], []
        with build_bench(alone) as bench:
            timed = timed_steps(bench, alone)
        out["student_only_tokens_per_s"] = timed["tokens_per_s"]
        if "peak_gib" in timed:
            out["student_only_peak_gib"] = timed["peak_gib"]
        self.dir.cleanup()
        return out


def corpus_rows(
    cfg, tcfg, batch_tokens: int, max_tokens: int = 1 << 18, window: int = 4096
) -> list[list[np.ndarray]]:
    """The teacher tokens of the corpus's documents (each cut at `window`), grouped into rows
    of at least `batch_tokens`, as a cache build groups them (up to `max_tokens` in all)."""
    side = TokenizerSide(load_tokenizer(tcfg.tokenizer or tcfg.path))
    rows, row, size, total = [], [], 0, 0
    for _, doc, _ in iter_documents(cfg, BadInputPolicy("skip")):
        made = teacher_tokens(doc, side, cfg.data.loss_on)
        if not isinstance(made, tuple):
            continue
        row.append(made[0][:window])
        size += row[-1].size
        total += row[-1].size
        if size >= batch_tokens:
            rows.append(row)
            row, size = [], 0
        if total >= max_tokens:
            break
    return rows or [row]


def timed_rate(forward, rows: list, device: torch.device) -> float:
    """Tokens/s of `forward(row) -> tokens` over `rows`, after three rows of warm-up (and
    compilation for three row lengths)."""
    for parts in rows[:3]:
        forward(parts)
    sync_device(device)
    t0, tokens = time.perf_counter(), 0
    for parts in rows:
        tokens += forward(parts)
    sync_device(device)
    return tokens / (time.perf_counter() - t0)


@torch.no_grad()
def bare_forward(teacher, parts: list[np.ndarray], chunk: int) -> int:
    """The teacher's body over one packed row, then its lm_head logits chunk by chunk (the
    top-k and everything else left out); returns the row's tokens."""
    ids, pos, segments = packed_row(parts, teacher.device)
    hidden = final_hidden(teacher.model, ids, pos, segments).flatten(0, 1)
    weight = teacher.lm_head_weight
    for r0 in range(0, hidden.shape[0], chunk):
        _ = hidden[r0 : r0 + chunk] @ weight.t()
    return ids.numel()


def bare_forward_rate(teacher, tcfg, cfg, batch_tokens: int, max_tokens: int = 1 << 18) -> float:
    """Tokens/s of the teacher's bare forward over the corpus packed as the build packs it."""
    rows = corpus_rows(cfg, tcfg, batch_tokens, max_tokens)
    chunk = cfg.train.loss_chunk_size
    return timed_rate(lambda parts: bare_forward(teacher, parts, chunk), rows, teacher.device)

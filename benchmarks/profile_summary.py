"""A profile summary of real steps: where the device time goes, by kernel and by kind.

`torch.profiler` records a few steps; the summary keeps what a reader needs to decide the next
optimisation: the busy fraction of the device over the wall time (what is left is host
overhead and synchronisation), time per step by kind (matmul, attention, Triton, elementwise,
reductions, copies, optimizer, communication) and the top kernels. On a CPU the same is done
over operators (self CPU time)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

KINDS = [  # first match wins; names are lower-cased kernel names
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "matmul", "addmm", "::mm", "bmm", "mm_")),
    ("triton", ("triton",)),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("communication", ("nccl", "allreduce", "allgather", "reducescatter")),
    ("reduction", ("reduce", "softmax", "norm", "topk", "sort", "scan", "max", "sum")),
    ("copy / cast", ("copy", "cast", "memcpy", "memset", "fill", "cat", "index", "gather")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "pointwise")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def profile_steps(step: Callable[[], None], steps: int, cuda: bool, top: int = 20) -> dict:
    """Run `step` `steps` times under the profiler (after one unprofiled call) and summarise
    per step: `busy_fraction`, `ms_by_kind`, `top` kernels (name, kind, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    if cuda:
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out = summarize(prof.key_averages(), wall, steps, cuda, top)
    events = prof.events()
    if cuda:
        spans = [
            (e.time_range.start, e.time_range.end, e.name)
            for e in events
            if _on_device(e) and not _is_range(e) and e.time_range.end > 0
        ]
        out["gaps"] = largest_gaps(spans, steps)
    out["phases"] = phase_times(events, steps, cuda)
    return out


PHASE_PREFIX = "crossdistill/"  # the step's ranges (`crossdistill.train.step.PHASE_*`)


def _on_device(e) -> bool:
    return str(getattr(e, "device_type", "")).endswith("CUDA")


def _is_range(e) -> bool:
    """A `record_function` range (its device-side copy spans kernels counted already)."""
    name = getattr(e, "name", None) or e.key  # an event, or an average of events
    return bool(getattr(e, "is_user_annotation", False)) or name.startswith(
        (PHASE_PREFIX, "ProfilerStep")
    )


def phase_times(events, steps: int, cuda: bool) -> dict[str, dict[str, float]]:
    """Per step, for each of the step's phases (`crossdistill/...` ranges): `host_ms`, the time
    the host spent inside it; on a GPU `kernel_ms`, the device time of the kernels it launched,
    and where the profiler recorded the range on the device too, `span_ms` (its first kernel's
    start to its last kernel's end), `communication_ms` and `compute_ms` (kernels running inside
    that span, by kind) and `idle_ms` (the span's time with no kernel running: waiting for the
    host, for another rank or for a transfer)."""
    out: dict[str, dict[str, float]] = {}

    def add(name: str, key: str, us: float) -> None:
        row = out.setdefault(name[len(PHASE_PREFIX) :], {})
        row[key] = row.get(key, 0.0) + us / 1e3 / max(steps, 1)

    kernels = sorted(
        (e.time_range.start, e.time_range.end, kind_of(e.name))
        for e in events
        if cuda and _on_device(e) and not _is_range(e) and e.time_range.end > 0
    )
    for e in events:
        if not e.name.startswith(PHASE_PREFIX):
            continue
        if not _on_device(e):
            add(e.name, "host_ms", e.time_range.end - e.time_range.start)
            if cuda:
                add(e.name, "kernel_ms", float(getattr(e, "device_time_total", 0.0)))
            continue
        if not cuda:
            continue
        start, end = e.time_range.start, e.time_range.end
        add(e.name, "span_ms", end - start)
        inside = [(max(a, start), min(b, end), k) for a, b, k in kernels if a < end and b > start]
        for a, b, kind in inside:
            add(e.name, "communication_ms" if kind == "communication" else "compute_ms", b - a)
        add(e.name, "idle_ms", (end - start) - _union([(a, b) for a, b, _ in inside]))
    return {name: {k: round(v, 3) for k, v in row.items()} for name, row in out.items()}


def _union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals` (overlaps counted once)."""
    total, reach = 0.0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


def largest_gaps(spans: list[tuple[float, float, str]], steps: int, top: int = 10) -> list[dict]:
    """Where the device waits: idle intervals between kernels (`(start_us, end_us, name)`, any
    stream), summed per (kernel before, kernel after) pair, in ms per step, largest first. Long
    gaps after the same kernel point at the host work (or a sync) that follows it."""
    totals: dict[tuple[str, str], list[float]] = {}
    last_end, last_name = None, ""
    for start, end, name in sorted(spans):
        if last_end is not None and start > last_end:
            entry = totals.setdefault((last_name[:80], name[:80]), [0.0, 0])
            entry[0] += (start - last_end) / 1e3 / steps
            entry[1] += 1
        if last_end is None or end >= last_end:
            last_end, last_name = end, name
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [
        {"ms": round(ms, 3), "count": count // max(steps, 1), "after": a, "before": b}
        for (a, b), (ms, count) in rows
    ]


def find_syncs(step: Callable[[], None]) -> list[dict]:
    """Run `step` once with CUDA's synchronisation debug mode on; where (file:line) each host
    synchronisation came from, most frequent first."""
    import warnings

    counts: dict[str, int] = {}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{w.filename}:{w.lineno}"
            counts[where] = counts.get(where, 0) + 1
    return [{"where": k, "count": v} for k, v in sorted(counts.items(), key=lambda kv: -kv[1])]


def _device_us(event) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def summarize(events, wall_s: float, steps: int, cuda: bool, top: int) -> dict:
    rows = []
    for e in events:
        if cuda:
            us = _device_us(e)
            is_kernel = str(getattr(e, "device_type", "")).endswith("CUDA")
            # ranges of annotated regions (`Optimizer.step#AdamW.step`, ...) span kernels
            # already counted: skip them
            if not is_kernel or us <= 0 or "#" in e.key or _is_range(e):
                continue
        else:
            us = float(e.self_cpu_time_total)
            if us <= 0 or _is_range(e):
                continue
        rows.append((e.key, us / steps / 1e3, e.count // max(steps, 1)))
    rows.sort(key=lambda r: -r[1])
    busy = sum(ms for _, ms, _ in rows)
    by_kind: dict[str, float] = {}
    for name, ms, _ in rows:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + ms
    step_ms = 1e3 * wall_s / steps
    return {
        "step_ms": step_ms,
        "busy_ms": busy,
        "busy_fraction": busy / step_ms if step_ms else None,
        "ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top": [
            {"name": name[:120], "kind": kind_of(name), "calls": calls, "ms": round(ms, 3)}
            for name, ms, calls in rows[:top]
        ],
        "what": "device kernels" if cuda else "CPU operators (self time)",
    }


def format_profile(p: dict) -> str:
    lines = [
        f"profile ({p['what']}): step {p['step_ms']:.1f} ms, busy {p['busy_ms']:.1f} ms "
        f"({100 * (p['busy_fraction'] or 0):.0f}%)",
        "  by kind: " + ", ".join(f"{k} {v:.1f}" for k, v in p["ms_by_kind"].items()),
    ]
    for row in p["top"]:
        lines.append(f"  {row['ms']:8.2f} ms  {row['calls']:5d}x  {row['kind']:12s} {row['name']}")
    if p.get("phases"):
        lines.append("  by phase (ms per step):")
        for name, row in p["phases"].items():
            lines.append(f"  {name:28s} " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
    if p.get("gaps"):
        lines.append("  device idle, largest gaps (after -> before):")
        for g in p["gaps"]:
            lines.append(f"  {g['ms']:8.2f} ms  {g['count']:5d}x  {g['after']} -> {g['before']}")
    return "\n".join(lines)

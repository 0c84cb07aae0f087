"""What a run reports while it trains: `metrics.jsonl`, TensorBoard events, and a progress line.

One `MetricsLogger.log(step, scalars)` call writes one JSON object per line to
`run_dir/metrics.jsonl`, the same scalars to TensorBoard (`run_dir/tensorboard/`), and updates the
progress bar. Scalars may be floats or 0-d tensors: they are converted here, together, so that a
step pays one host sync for all of them instead of one per `.item()`.

Key names the progress display and `crossdistill plot` understand (others are logged as given):

- `loss` (the optimized total), `loss/ce`, `loss/kd`, `loss/kd/<teacher>`: training loss terms
- `tokens_per_s`, `lr`, `grad_norm`
- `val/<name>` for validation values, e.g. `val/loss`, `val/loss/ce`, and bits per byte as
  `val/bpb/student` and `val/bpb/teacher` (or `val/bpb/teacher/<name>` with several teachers)

Non-finite values are written as `null` (JSON has no NaN).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
VAL_PREFIX = "val/"
LOSS_KEY = "loss"
TOKENS_PER_S_KEY = "tokens_per_s"

_warned_no_tensorboard = False


class MetricsLogger:
    """Appends metrics of one run; usable as a context manager.

    `resume_step`: the step of the checkpoint a resumed run starts from. Lines of a later step
    are dropped from `metrics.jsonl` (they were logged after that checkpoint and will be logged
    again) and TensorBoard hides its events past it. Without it the run is new: an earlier
    `metrics.jsonl` and TensorBoard events in `run_dir` are deleted. `print_every`: without a progress bar (not a TTY, or
    `progress=False`) a plain line is printed at most every this many steps (default: about 100
    lines per run); validation values are always printed.
    """

    def __init__(
        self,
        run_dir: str | Path,
        total_steps: int,
        *,
        tensorboard: bool = True,
        progress: bool = True,
        resume_step: int | None = None,
        print_every: int | None = None,
        stream: IO[str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        self._stream = stream if stream is not None else sys.stderr
        self._start_step = resume_step or 0
        self._start_time = time.monotonic()
        self._print_every = print_every or max(1, total_steps // 100)
        self._last_printed: int | None = None
        if resume_step is None:  # a new run: nothing of an earlier one in this folder stays
            self.path.unlink(missing_ok=True)
            for old in (self.run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"):
                old.unlink()
        else:
            drop_after(self.path, resume_step)
        # Held open for the logger's lifetime; `close()` (or the `with` block) closes it.
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        self._writer = None
        if tensorboard:
            self._writer = _open_tensorboard(
                self.run_dir / TENSORBOARD_DIR,
                purge_step=None if resume_step is None else resume_step + 1,
            )
        self._bar = None
        if progress and _isatty(self._stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=self._start_step,
                unit="step",
                dynamic_ncols=True,
                file=self._stream,
            )

    def log(self, step: int, scalars: Mapping[str, float | int | torch.Tensor]) -> dict[str, float]:
        """Record `scalars` at `step`; returns them as floats (NaN where non-finite)."""
        if self._file is None:
            raise RuntimeError("MetricsLogger.log called after close()")
        values = to_floats(scalars)
        record: dict[str, Any] = {"step": int(step), "time": round(time.time(), 3)}
        record.update({k: v if math.isfinite(v) else None for k, v in values.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key, value, global_step=int(step))
        self._show(int(step), values)
        return values

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if self._bar is not None:
            self._bar.write(message, file=self._stream)
        else:
            print(message, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _show(self, step: int, values: dict[str, float]) -> None:
        val = {k: v for k, v in values.items() if k.startswith(VAL_PREFIX)}
        if val:
            self.write(
                f"step {step}/{self.total_steps} | "
                + " | ".join(_fmt(k, v) for k, v in val.items())
            )
        train = {k: v for k, v in values.items() if not k.startswith(VAL_PREFIX)}
        if not train:
            return
        loss = train.get(LOSS_KEY)
        tok_s = train.get(TOKENS_PER_S_KEY)
        if self._bar is not None:
            if step > self._bar.n:
                self._bar.update(step - self._bar.n)
            parts = [] if loss is None else [f"loss {loss:.4f}"]
            parts += [] if tok_s is None else [f"{_si(tok_s)} tok/s"]
            self._bar.set_postfix_str(", ".join(parts), refresh=True)
            return
        due = self._last_printed is None or step - self._last_printed >= self._print_every
        if not (due or step >= self.total_steps):
            return
        self._last_printed = step
        parts = [f"step {step}/{self.total_steps}"]
        parts += [] if loss is None else [f"loss {loss:.4f}"]
        parts += [] if tok_s is None else [f"{_si(tok_s)} tok/s"]
        parts.append(f"eta {_eta(self._start_step, step, self.total_steps, self._start_time)}")
        self.write(" | ".join(parts))


def to_floats(scalars: Mapping[str, float | int | torch.Tensor]) -> dict[str, float]:
    """Python floats from floats and one-element tensors, with one device-to-host copy per device."""
    import torch  # here, so that reading metrics (`crossdistill plot`) does not load torch

    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in scalars.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"metric {key!r} is a tensor of shape {list(value.shape)}, not a scalar"
                )
            by_device.setdefault(value.device, []).append((key, value))
        else:
            out[key] = float(value)
    for device, items in by_device.items():
        dtype = torch.float32 if device.type == "mps" else torch.float64  # mps has no float64
        stacked = torch.stack([t.detach().reshape(()).to(dtype) for _, t in items])
        for (key, _), v in zip(items, stacked.cpu().tolist()):
            out[key] = v
    return {k: out[k] for k in scalars}  # the caller's order


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl`; an unreadable line (a write cut by a kill) is skipped."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def drop_after(path: str | Path, step: int) -> None:
    """Rewrite `metrics.jsonl` without the records of steps after `step` (atomic replace)."""
    path = Path(path)
    if not path.exists():
        return
    kept = [r for r in read_metrics(path) if r["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _open_tensorboard(log_dir: Path, purge_step: int | None):
    global _warned_no_tensorboard
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if not _warned_no_tensorboard:
            _warned_no_tensorboard = True
            log.warning(
                "tensorboard is not installed: metrics go to metrics.jsonl only "
                "(pip install tensorboard, or set run.tensorboard=false to silence this)"
            )
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _eta(start_step: int, step: int, total: int, start_time: float) -> str:
    done = step - start_step
    if done <= 0:
        return "?"
    seconds = (time.monotonic() - start_time) / done * max(0, total - step)
    return _hms(seconds)


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _si(x: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _fmt(key: str, value: float) -> str:
    return f"{key} {value:.4g}"

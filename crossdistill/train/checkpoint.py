"""Checkpoints of a run directory, written so that a run killed at any instant resumes cleanly.

Layout::

    run_dir/checkpoints/
        step_000100/            one complete checkpoint
            model.safetensors   the model state_dict (model.pt when it holds non-tensors)
            state.pt            optimizer, scheduler, loader state, RNG states, ...
            meta.json           step, file sizes, and the JSON-able entries of the state
        step_000200/
        latest                  "step_000200": the last checkpoint whose save completed

A checkpoint is written into a temporary folder beside the others (``.tmp-*``), every file is
fsynced, then the folder is renamed into place; ``latest`` is replaced atomically after that, and
old checkpoints are deleted only then. So a ``step_*`` folder is always complete, a crash leaves
at worst a ``.tmp-*`` folder that ``load_latest`` removes, and ``latest`` never names a partial
checkpoint. A checkpoint that is damaged later (truncated file, disk error) is moved aside as
``step_*.corrupt`` by ``load_latest``, which falls back to the previous one.

Single-process state dicts only; sharded (DTensor) checkpoints belong to ``distributed/``.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crossdistill.errors import UserError

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
LATEST_MARKER = "latest"
MODEL_SAFETENSORS = "model.safetensors"
MODEL_PT = "model.pt"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
FORMAT_VERSION = 1

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_CORRUPT_SUFFIX = ".corrupt"
# Leaf types that `torch.load(weights_only=True)` reads back; anything else in the state would
# save fine and then fail at resume time, so it is refused at save time instead.
_SAFE_LEAVES = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device, torch.Size)


class NonFiniteStateError(UserError):
    """The model holds NaN or Inf values: saving it would make every later resume useless."""


# ----------------------------------------------------------------------------- saving


def save_checkpoint(
    run_dir: str | Path, step: int, state: Mapping[str, Any], *, keep_last: int = 2
) -> Path:
    """Write `state` as checkpoint `step` of `run_dir`, atomically, and keep the last `keep_last`.

    `state["model"]` (a state_dict) goes to safetensors; the entries that survive a JSON round
    trip (config, counters) go to `meta.json`, readable by people; the rest to `state.pt`.
    Refuses a model with non-finite values (`NonFiniteStateError`). Checkpoints of higher steps
    than `step` (left by an abandoned run in the same folder) are deleted once this one is
    complete, so that the newest checkpoint is always the one just saved. Returns its folder.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    _check_state(state)
    return _write_checkpoint(Path(run_dir), step, state, keep_last)


def _check_state(state: Mapping[str, Any]) -> None:
    """Refuse a state that must not be saved: a non-finite model, or entries that would not
    load back."""
    if state.get("model") is not None:
        _check_finite(state["model"])
    _check_loadable(state, "state")


def _write_checkpoint(run_dir: Path, step: int, state: Mapping[str, Any], keep_last: int) -> Path:
    """`save_checkpoint` after its checks: the atomic write, the marker, the pruning."""
    root = run_dir / CHECKPOINTS_DIR
    model_sd = state.get("model")
    rest = {k: v for k, v in state.items() if k != "model"}
    root.mkdir(parents=True, exist_ok=True)
    name = _dir_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{name}-", dir=root))
    try:
        _write_payload(tmp, step, model_sd, rest)
        _move_into_place(tmp, root / name)
        _write_marker(root, name)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _out_of_space(e):
            raise UserError(
                f"disk full ({e}) while writing checkpoint {root / name}; nothing partial "
                f"was kept and the previous checkpoint is intact. Free space (or lower "
                f"train.keep_last) and resume with --resume"
            ) from None
        raise
    _prune(root, step, keep_last)
    return root / name


class BackgroundSaver:
    """`save_checkpoint` off the training loop's path. `save` checks the state and copies it
    into host memory (on a GPU the device-to-host copy is what the loop waits for), then one
    thread writes that copy with the same atomic protocol while training goes on. One save at
    a time: the next `save`, or `wait`, waits for the one in flight and raises its error there
    (a full disk: `UserError`, the previous checkpoint intact). The thread is not a daemon, so
    an interpreter that exits, even on an error, finishes the save first; a killed process
    leaves the previous checkpoint as `latest`, as with a synchronous save.

    The copy holds the whole state once more in host memory while it is written."""

    def __init__(self, run_dir: str | Path, keep_last: int = 2) -> None:
        self.run_dir, self.keep_last = Path(run_dir), keep_last
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        self.wait()
        _check_state(state)
        snapshot = _host_copy(state)
        self._thread = threading.Thread(
            target=self._write, args=(step, snapshot), name=f"checkpoint-{step}"
        )
        self._thread.start()

    def _write(self, step: int, snapshot: dict[str, Any]) -> None:
        try:
            _write_checkpoint(self.run_dir, step, snapshot, self.keep_last)
        except BaseException as e:  # raised in the loop's thread by the next save or wait
            self._error = e

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _host_copy(obj: Any) -> Any:
    """`obj` with every tensor copied to host memory and every container rebuilt, so that the
    training that goes on cannot change what is being written."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: _host_copy(v) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _write_payload(
    folder: Path, step: int, model_sd: Mapping[str, Any] | None, rest: dict[str, Any]
) -> None:
    files: dict[str, int] = {}
    if model_sd is not None:
        fname = _write_model(folder, model_sd)
        files[fname] = (folder / fname).stat().st_size
    json_state = {k: v for k, v in rest.items() if _json_roundtrips(v)}
    binary_state = {k: v for k, v in rest.items() if k not in json_state}
    _torch_save(binary_state, folder / STATE_FILE)
    files[STATE_FILE] = (folder / STATE_FILE).stat().st_size
    meta = {
        "format": FORMAT_VERSION,
        "step": int(step),
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "files": files,
        "state": json_state,
    }
    # meta.json last: a folder with a valid meta.json had everything else written before it.
    with open(folder / META_FILE, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
        _flush_and_sync(f)
    _fsync_dir(folder)


def _write_model(folder: Path, model_sd: Mapping[str, Any]) -> str:
    if not all(isinstance(v, torch.Tensor) for v in model_sd.values()):
        # A state_dict with `_extra_state` objects cannot go to safetensors.
        _torch_save(dict(model_sd), folder / MODEL_PT)
        return MODEL_PT
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen_storages: set[int] = set()
    for key, t in model_sd.items():
        t = t.detach().to("cpu").contiguous()
        # Tied weights (embedding = lm_head) share storage, which safetensors refuses; the
        # duplicate is stored as its own copy and tied again by `load_state_dict`.
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storages and t.numel() > 0:
            t = t.clone()
        seen_storages.add(t.untyped_storage().data_ptr())
        tensors[key] = t
    save_file(tensors, str(folder / MODEL_SAFETENSORS), metadata={"format": "pt"})
    with open(folder / MODEL_SAFETENSORS, "rb") as f:
        os.fsync(f.fileno())
    return MODEL_SAFETENSORS


def _torch_save(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        sink = _KeepWriteError(f)
        try:
            torch.save(obj, sink)
        except RuntimeError as e:
            # torch reports a failed write as a RuntimeError without the errno; give back the
            # OSError underneath so that a full disk is recognised as one.
            if sink.error is not None:
                raise sink.error from e
            raise
        _flush_and_sync(f)


class _KeepWriteError(io.RawIOBase):
    """A write-through view of a file that remembers the OSError of a failed write."""

    def __init__(self, f: Any) -> None:
        super().__init__()
        self._f = f
        self.error: OSError | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = e
            raise


def _out_of_space(e: BaseException) -> bool:
    codes = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    if isinstance(e, OSError):
        return e.errno in codes
    # safetensors raises its own error type, with the OS error number in the message.
    m = re.search(r"os error (\d+)", str(e))
    return m is not None and int(m.group(1)) in codes


def _move_into_place(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():  # the same step saved again (a resumed run passing it a second time)
        old = final.with_name(f"{_OLD_PREFIX}{final.name}-{os.getpid()}-{time.time_ns()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_marker(root: Path, name: str) -> None:
    tmp = root / f"{LATEST_MARKER}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        _flush_and_sync(f)
    os.replace(tmp, root / LATEST_MARKER)
    _fsync_dir(root)


def _prune(root: Path, newest: int, keep_last: int) -> None:
    steps = sorted(_complete_steps(root))
    stale = [s for s in steps if s > newest]
    if stale:
        log.warning(
            "deleting checkpoints of steps %s: they are newer than step %d just saved and belong "
            "to an abandoned run in the same folder",
            stale,
            newest,
        )
    older = [s for s in steps if s <= newest]
    for s in stale + older[: max(0, len(older) - keep_last)]:
        shutil.rmtree(root / _dir_name(s), ignore_errors=True)


def write_folder(out: str | Path, write: Any, what: str) -> Path:
    """Write a folder with `write(tmp)` into a temporary folder beside `out`, then rename it
    into place (a previous `out` is replaced only once the new one is complete). A full disk
    is one `UserError` naming `what`; nothing partial is left and a previous `out` stays."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{out.name}-", dir=out.parent))
    try:
        write(tmp)
        _move_into_place(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if _out_of_space(e):
            raise UserError(
                f"disk full ({str(e).splitlines()[0] if str(e) else e}) while writing {what} "
                f"{out}; nothing partial was kept and the checkpoints are intact. Free space and "
                f"run the same command with --resume: a finished run only writes {out.name}/ again"
            ) from None
        raise
    return out


# ----------------------------------------------------------------------------- loading


def load_latest(
    run_dir: str | Path, *, map_location: str | torch.device = "cpu"
) -> tuple[int, dict[str, Any]] | None:
    """The newest loadable checkpoint of `run_dir` as `(step, state)`, or None when there is none.

    Leftover temporary folders of a killed save are removed. A checkpoint that fails to load
    (missing or truncated file, bad meta.json) is moved aside as `step_*.corrupt` with a warning
    and the previous one is tried. If checkpoints exist but none loads, raises `UserError`
    rather than letting the run silently start over.
    """
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return None
    _clean_leftovers(root)
    marked = _read_marker(root)
    errors: list[str] = []
    for step in sorted(_complete_steps(root), reverse=True):
        folder = root / _dir_name(step)
        try:
            state = _load_folder(folder, step, map_location)
        except Exception as e:  # any failure to read means this checkpoint is unusable
            reason = (
                f"{folder.name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            )
            errors.append(reason)
            aside = folder.with_name(folder.name + _CORRUPT_SUFFIX)
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(folder, aside)
            log.warning(
                "checkpoint %s cannot be loaded (%s); moved it to %s and falling back to the "
                "previous checkpoint",
                folder,
                reason,
                aside.name,
            )
            continue
        if marked is not None and marked != folder.name:
            log.warning("'latest' names %s but resuming from %s", marked, folder.name)
        return step, state
    if errors:
        raise UserError(
            f"no checkpoint in {root} could be loaded ({'; '.join(errors)}); the damaged ones "
            f"were renamed *{_CORRUPT_SUFFIX}. Start a new run in another folder, or remove "
            f"{root} to start this one over"
        )
    return None


def _load_folder(folder: Path, step: int, map_location: str | torch.device) -> dict[str, Any]:
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT_VERSION or meta.get("step") != step:
        raise ValueError(f"meta.json has format {meta.get('format')} and step {meta.get('step')}")
    for fname, size in meta["files"].items():
        actual = (folder / fname).stat().st_size
        if actual != size:
            raise ValueError(f"{fname} has {actual} bytes, {size} were written")
    state: dict[str, Any] = torch.load(
        folder / STATE_FILE, map_location=map_location, weights_only=True
    )
    state.update(meta["state"])
    if MODEL_SAFETENSORS in meta["files"]:
        from safetensors.torch import load_file

        device = str(map_location) if not isinstance(map_location, str) else map_location
        state["model"] = load_file(str(folder / MODEL_SAFETENSORS), device=device)
    elif MODEL_PT in meta["files"]:
        state["model"] = torch.load(folder / MODEL_PT, map_location=map_location, weights_only=True)
    return state


def _clean_leftovers(root: Path) -> None:
    for p in root.iterdir():
        if p.name.startswith((_TMP_PREFIX, _OLD_PREFIX)) or p.name == f"{LATEST_MARKER}.tmp":
            log.info("removing %s left by an interrupted save", p)
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _read_marker(root: Path) -> str | None:
    try:
        name = (root / LATEST_MARKER).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return name if _STEP_DIR.match(name) else None


def _complete_steps(root: Path) -> list[int]:
    return [
        int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    ]


def _dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}"


# ----------------------------------------------------------------------------- checks


def _check_finite(model_sd: Mapping[str, Any]) -> None:
    """One host sync for the whole model: a float32 sum per tensor is NaN/Inf iff it holds one."""
    names, sums = [], []
    for name, t in model_sd.items():
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            names.append(name)
            sums.append(t.detach().sum(dtype=torch.float32 if t.is_floating_point() else None))
    if not sums:
        return
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    bad: list[str] = []
    for idx in by_device.values():
        finite = torch.isfinite(torch.stack([sums[i] for i in idx])).tolist()
        # A sum overflowing fp32 from finite values is possible only for absurd weights; the
        # exact per-tensor check below separates it from a real NaN/Inf.
        bad += [
            names[i]
            for i, ok in zip(idx, finite)
            if not ok and not bool(torch.isfinite(model_sd[names[i]]).all())
        ]
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteStateError(
            f"refusing to save a checkpoint: the model holds NaN or Inf values ({shown}). The "
            f"previous checkpoint is intact: resume from it with a lower learning rate or "
            f"stronger gradient clipping"
        )


def _check_loadable(obj: Any, where: str) -> None:
    if isinstance(obj, (torch.Tensor, *_SAFE_LEAVES)):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint {where} has a key of type {type(k).__name__}")
            _check_loadable(v, f"{where}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_loadable(v, f"{where}[{i}]")
    else:
        raise TypeError(
            f"checkpoint {where} is a {type(obj).__module__}.{type(obj).__name__}; store tensors, "
            f"numbers, strings and plain containers only (they must load with weights_only=True)"
        )


def _json_roundtrips(value: Any) -> bool:
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError):
        return False


# What decides the student's tensors; a resume with other values cannot load them.
_SHAPE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
    "moe_intermediate_size", "num_experts", "num_local_experts",
)  # fmt: skip


def student_shape(student) -> dict:
    """The student's architecture settings that decide its tensors' shapes."""
    config = student.config.to_dict()
    return {k: config[k] for k in _SHAPE_KEYS if k in config}


def check_same_student(saved: dict | None, student, folder, saved_sd: dict | None = None) -> None:
    """Refuse a resume whose student is built differently from the checkpoint's, naming the
    settings that differ (or, for a checkpoint without them, the first tensors), before any
    tensor is loaded."""
    now = student_shape(student)
    if saved:
        diff = [k for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
        if diff:
            detail = ", ".join(
                f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} now" for k in diff
            )
            raise UserError(
                f"cannot resume from {folder}: the student is built differently ({detail}); "
                "resume with the student settings of the checkpointed run (student.arch / "
                "student.path / student.overrides), or start a new run in another run.out_dir"
            )
    if saved_sd is not None:
        mine = student.state_dict()
        bad = [
            f"{k} {tuple(v.shape)} in the checkpoint, {tuple(mine[k].shape)} now"
            for k, v in saved_sd.items()
            if k in mine and tuple(v.shape) != tuple(mine[k].shape)
        ]
        if bad:
            raise UserError(
                f"cannot resume from {folder}: the student's tensors differ in shape "
                f"({'; '.join(bad[:3])}); resume with the student settings of the checkpointed "
                "run, or start a new run in another run.out_dir"
            )


# ----------------------------------------------------------------------------- RNG


def capture_rng_state() -> dict[str, Any]:
    """The generators a run draws from: python `random`, numpy's global one, torch CPU and CUDA.

    Plain containers and tensors only, so the result goes into a checkpoint as it is.
    """
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Put back what `capture_rng_state` captured. CUDA states are restored where both sides
    have CUDA; a different device count restores the devices both runs have, with a warning."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np.asarray(np_state["keys"], dtype=np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if count != len(cuda_states):
            log.warning(
                "checkpoint has CUDA RNG states for %d devices, this machine has %d",
                len(cuda_states),
                count,
            )
        for i, s in enumerate(cuda_states[:count]):
            torch.cuda.set_rng_state(s, device=i)


# ----------------------------------------------------------------------------- probes


def check_writable(run_dir: str | Path, min_free_bytes: int) -> None:
    """Fail at start, not at the first checkpoint: `run_dir` must be creatable and writable and
    its disk must have at least `min_free_bytes` free (e.g. (keep_last + 1) checkpoints)."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=run_dir)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * 4096)
                _flush_and_sync(f)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(probe)
    except OSError as e:
        raise UserError(
            f"run directory {run_dir} is not writable ({e.strerror or e}); choose another "
            f"run.out_dir or fix its permissions"
        ) from None
    free = shutil.disk_usage(run_dir).free
    if free < min_free_bytes:
        raise UserError(
            f"only {free / 2**30:.2f} GiB free on the disk of {run_dir}, the run needs about "
            f"{min_free_bytes / 2**30:.2f} GiB for its checkpoints; free space, lower "
            f"train.keep_last, or choose another run.out_dir"
        )


def _flush_and_sync(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # Makes a rename durable; some filesystems refuse fsync on directories, which is harmless.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

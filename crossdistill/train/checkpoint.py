"""Checkpoints of a run directory: one format and one writer for every layout (a single process
is the one-rank case), written so that a run killed at any instant resumes cleanly.

Layout::

    run_dir/checkpoints/
        step_000100/            one complete checkpoint
            dcp/                model and optimizer (`torch.distributed.checkpoint`: each rank
                                writes its shards, with their global shapes)
            data_00000.pt       the train loader's state of data-parallel rank 0, 1, ...
            rng_00000.pt        the RNG states of global rank 0, 1, ...
            meta.json           format, step, the JSON state (scheduler, layout, the student's
                                shape) and every file's size: written last
        step_000200/
        latest                  "step_000200": the last checkpoint whose save completed

Every rank writes into `.tmp-step_*`; once all have, rank 0 writes `meta.json`, fsyncs, renames
the folder into place, replaces `latest` atomically, and only then deletes old checkpoints. So
a `step_*` folder is always complete, a crash leaves at worst a `.tmp-*` folder that the next
load removes, and `latest` never names a partial checkpoint. A checkpoint damaged later
(truncated or missing file, bad `meta.json`, shards that do not load) is moved aside as
`step_*.corrupt` at load time and the previous one is used. A full disk is one clear error and
leaves the previous checkpoint intact. A model holding NaN or Inf is never saved.

Tensors are stored with their global shapes, so a checkpoint resumes under any number of
processes or layout (resharding), one process included; the loader's position resumes exactly
when the data-parallel size is unchanged.

`Checkpointer(background=True)`: the loop waits only for the state to be checked and copied into
host memory; a thread writes that copy (DCP's `async_save`, over a gloo group of its own under
`torchrun`) and completes the checkpoint while training goes on. One save at a time: the next
save, or `wait`, waits for the one in flight and raises its error there.
"""

from __future__ import annotations

import contextlib
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
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from crossdistill.errors import UserError

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
LATEST_MARKER = "latest"
META_FILE = "meta.json"
DCP_DIR = "dcp"
FORMAT = "dcp"
FORMAT_VERSION = 2

_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"
_CORRUPT_SUFFIX = ".corrupt"
# Leaf types that `torch.load(weights_only=True)` reads back; anything else in a per-rank state
# would save fine and then fail at resume time, so it is refused at save time instead.
_SAFE_LEAVES = (str, int, float, bool, type(None), bytes, torch.dtype, torch.device, torch.Size)


class NonFiniteStateError(UserError):
    """The model holds NaN or Inf values: saving it would make every later resume useless."""


# ----------------------------------------------------------------------------- ranks


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


_CPU_GROUP: dict[int, Any] = {}  # id of the default group -> its checkpoint group


def _cpu_group() -> Any:
    """A gloo group over every rank for the checkpoint's own collectives (small objects, and
    DCP's background writes, which need a CPU backend). Always a group of its own, even where
    the default group is gloo: a background save finishes with collectives in its thread
    while training goes on with its own in the main thread, and two threads' collectives on
    one group would interleave. Created once, by every rank at the same call (all ranks save
    and load together)."""
    if not _dist():
        return None
    key = id(dist.group.WORLD)  # a process group started again gets a group of its own
    if key not in _CPU_GROUP:
        _CPU_GROUP.clear()
        _CPU_GROUP[key] = dist.new_group(backend="gloo")
    return _CPU_GROUP[key]


def _barrier() -> None:
    if _dist():
        dist.barrier(group=_cpu_group())


def _broadcast(obj: Any) -> Any:
    if not _dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_cpu_group())
    return box[0]


def _any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank gets the same answer)."""
    if not _dist():
        return flag
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_cpu_group())
    return bool(t.item())


# ----------------------------------------------------------------------------- saving


class Checkpointer:
    """Writes the checkpoints of `run_dir` (see module doc), on every rank of the job."""

    def __init__(self, run_dir: str | Path, keep_last: int = 2, background: bool = False):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.root = Path(run_dir) / CHECKPOINTS_DIR
        self.keep_last = keep_last
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(
        self,
        step: int,
        sharded: Mapping[str, Any],
        meta: Mapping[str, Any] | None = None,
        data_state: tuple[int, Any] | None = None,
        rng_state: Any = None,
    ) -> Path:
        """Checkpoint `step`, called by every rank. `sharded`: what DCP stores, e.g.
        `{"model": ..., "optimizer": ...}` from `get_state_dict` (this rank's shards; a plain
        state dict in one process); `meta`: JSON-able state, rank 0's is kept (scheduler,
        layout); `data_state`: `(data-parallel rank, loader state)` from one rank per data rank;
        `rng_state`: this rank's generators. Refuses a model with non-finite values
        (`NonFiniteStateError`, on every rank). Checkpoints of higher steps (an abandoned run in
        the same folder) are deleted once this one is complete. Returns its folder."""
        self.wait()
        meta = dict(meta or {})
        _check_json(meta)
        _check_loadable({"data": data_state, "rng": rng_state}, "state")
        bad = _non_finite(sharded.get("model") or {})
        if _any_rank(bool(bad)):
            raise NonFiniteStateError(
                "refusing to save a checkpoint: the model holds NaN or Inf values"
                + (f" ({_names(bad)})" if bad else "")
                + ". The previous checkpoint is intact: resume from it with a lower learning "
                "rate or stronger gradient clipping"
            )
        name = _dir_name(step)
        tmp = self.root / f"{_TMP_PREFIX}{name}"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        try:
            if data_state is not None:
                _torch_save(data_state[1], tmp / f"data_{int(data_state[0]):05d}.pt")
            if rng_state is not None:
                _torch_save(rng_state, tmp / f"rng_{_rank():05d}.pt")
            if not self.background:
                with _one_process_is_meant():
                    _dcp().save(dict(sharded), checkpoint_id=str(tmp / DCP_DIR))
                self._complete(step, tmp, meta)
                return self.root / name
            with _one_process_is_meant():  # copies the state into host memory, then returns
                future = _dcp().async_save(
                    dict(sharded), checkpoint_id=str(tmp / DCP_DIR), process_group=_cpu_group()
                )
        except BaseException as e:
            raise self._failed(e, step, tmp) from None
        self._thread = threading.Thread(
            target=self._finish, args=(future, step, tmp, meta), name=f"checkpoint-{step}"
        )
        self._thread.start()
        return self.root / name

    def _finish(self, future: Any, step: int, tmp: Path, meta: dict) -> None:
        try:
            future.result()
            self._complete(step, tmp, meta)
        except BaseException as e:  # raised in the loop's thread by the next save or wait
            self._error = self._failed(e, step, tmp)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete; raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _complete(self, step: int, tmp: Path, meta: dict) -> None:
        """Rank 0, once every rank has written: `meta.json` last, then the folder into place,
        `latest`, pruning."""
        if _rank() != 0:
            return
        files = {
            str(p.relative_to(tmp)): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()
        }
        record = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": int(step),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "files": files,
            "state": meta,
        }
        with open(tmp / META_FILE, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            _flush_and_sync(f)
        _fsync_dir(tmp)
        name = _dir_name(step)
        _move_into_place(tmp, self.root / name)
        _write_marker(self.root, name)
        _prune(self.root, step, self.keep_last)

    def _failed(self, e: BaseException, step: int, tmp: Path) -> BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if _out_of_space(e) or _disk_refuses(self.root):
            return UserError(
                f"disk full ({_first_line(e)}) while writing checkpoint {self.root / _dir_name(step)}"
                "; nothing partial was kept and the previous checkpoint is intact. Free space "
                "(or lower train.keep_last) and resume with --resume"
            )
        return e


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a failed DCP load raises: its `CheckpointException` derives from BaseException."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


@contextlib.contextmanager
def _one_process_is_meant():
    """DCP warns that it "assumes the intent" of one process whenever no process group runs:
    here one process is the one-rank layout, meant as such."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _check_json(meta: Mapping[str, Any]) -> None:
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"checkpoint meta must be plain JSON data: {e}") from None


def _names(bad: list[str]) -> str:
    return ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")


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
    """Whether `e`, its causes, or (DCP) any rank's failure inside it is a full disk."""
    codes = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    seen: set[int] = set()
    stack = [e]
    while stack:
        err = stack.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in codes:
            return True
        m = re.search(r"os error (\d+)|\[Errno (\d+)\]", str(err))
        if m is not None and int(m.group(1) or m.group(2)) in codes:
            return True
        if "No space left on device" in str(err):
            return True
        failures = getattr(err, "failures", None)
        if isinstance(failures, Mapping):
            stack.extend(v for v in failures.values() if isinstance(v, BaseException))
        stack.extend([err.__cause__, err.__context__])
    return False


def _disk_refuses(folder: Path, probe_bytes: int = 1 << 20) -> bool:
    """Whether `folder` cannot take `probe_bytes` more now. DCP's shard writer reports a short
    write (a full disk, a quota, a file size limit) as a torch zip-writer position mismatch,
    not as an OSError; after a failed save this probe tells a full disk from any other error."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=_TMP_PREFIX + "probe-") as f:
            f.write(bytes(probe_bytes))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return _out_of_space(e)
    return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


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
        if _out_of_space(e) or _disk_refuses(out.parent):
            raise UserError(
                f"disk full ({str(e).splitlines()[0] if str(e) else e}) while writing {what} "
                f"{out}; nothing partial was kept and the checkpoints are intact. Free space and "
                f"run the same command with --resume: a finished run only writes {out.name}/ again"
            ) from None
        raise
    return out


# ----------------------------------------------------------------------------- loading


@dataclass
class Found:
    """A checkpoint that loaded: its step, folder and JSON state (`meta.json`'s "state")."""

    step: int
    folder: Path
    state: dict[str, Any]

    def data_state(self, data_rank: int, data_size: int) -> Any:
        """This data rank's loader state; None (with a warning) when the data-parallel size
        changed, since the order of batches depends on how many ranks read the data."""
        saved = int(self.state.get("data_size", 1))
        if saved != data_size:
            log.warning(
                "data-parallel size changed from %d to %d: the data stream restarts from its "
                "beginning (the order of batches depends on how many ranks read it)",
                saved,
                data_size,
            )
            return None
        path = self.folder / f"data_{data_rank:05d}.pt"
        return torch.load(path, weights_only=True) if path.is_file() else None

    def model_shapes(self) -> dict[str, tuple[int, ...]]:
        """The global shape of every model tensor stored (read from DCP's metadata only)."""
        metadata = _dcp().FileSystemReader(str(self.folder / DCP_DIR)).read_metadata()
        return {
            key[len("model.") :]: tuple(item.size)
            for key, item in metadata.state_dict_metadata.items()
            if key.startswith("model.") and hasattr(item, "size")
        }

    def rng_state(self) -> Any:
        """This rank's RNG states, None when the checkpoint had no such rank."""
        path = self.folder / f"rng_{_rank():05d}.pt"
        return torch.load(path, weights_only=True) if path.is_file() else None


def load_latest(
    run_dir: str | Path,
    sharded: Mapping[str, Any] | None = None,
    check: Callable[[Found], None] | None = None,
) -> Found | None:
    """The newest checkpoint of `run_dir` that loads, with its DCP part loaded in place into
    `sharded` (templates from `get_state_dict`: this rank's shards), or None when there is
    none. Called by every rank. `check(found)` runs before any tensor is loaded (a `UserError`
    there, such as another student's shape, is raised as it is).

    Leftover temporary folders of a killed save are removed. A checkpoint that fails to load is
    moved aside as `step_*.corrupt` with a warning and the previous one is tried. If
    checkpoints exist but none loads, raises `UserError` rather than silently starting over."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    steps: list[int] = []
    if _rank() == 0 and root.is_dir():
        _clean_leftovers(root)
        steps = sorted(_complete_steps(root), reverse=True)
        marked = _read_marker(root)
        if steps and marked is not None and marked != _dir_name(steps[0]):
            log.warning(
                "'latest' names %s but the newest checkpoint is %s", marked, _dir_name(steps[0])
            )
    steps = _broadcast(steps)
    errors: list[str] = []
    for step in steps:
        folder = root / _dir_name(step)
        found, reason = _try_load(folder, step, sharded, check)
        if found is not None:
            return found
        errors.append(f"{folder.name}: {reason}")
        if _rank() == 0:
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
        _barrier()
    if errors:
        raise UserError(
            f"no checkpoint in {root} could be loaded ({'; '.join(errors)}); the damaged ones "
            f"were renamed *{_CORRUPT_SUFFIX}. Start a new run in another folder, or remove "
            f"{root} to start this one over"
        )
    return None


def _try_load(
    folder: Path,
    step: int,
    sharded: Mapping[str, Any] | None,
    check: Callable[[Found], None] | None,
) -> tuple[Found | None, str]:
    """(the checkpoint `folder` of `step`, loaded into `sharded`; "") or (None, why it does not
    load). Called by every rank; every rank gets the same answer."""
    verdict = _broadcast(_read_meta(folder, step) if _rank() == 0 else None)
    if isinstance(verdict, str):
        return None, verdict
    found = Found(step, folder, verdict["state"])
    if check is not None:
        check(found)
    reason = ""
    if sharded is not None:
        try:
            with _one_process_is_meant():
                _dcp().load(dict(sharded), checkpoint_id=str(folder / DCP_DIR))
        except _load_errors() as e:  # unreadable shards: this checkpoint is unusable
            reason = f"{type(e).__name__}: {_first_line(e)}"
    if not _any_rank(bool(reason)):
        return found, ""
    return None, reason or "shards of another rank did not load"


def found_at(run_dir: str | Path, step: int) -> Found:
    """The complete checkpoint of `step` in `run_dir`, its JSON state only (what a process
    without the student's weights needs: the data ranks' loader states)."""
    folder = Path(run_dir) / CHECKPOINTS_DIR / _dir_name(step)
    meta = _read_meta(folder, step)
    if isinstance(meta, str):
        raise UserError(f"checkpoint {folder} cannot be read: {meta}")
    return Found(step, folder, meta["state"])


def load_checkpoint(
    folder: str | Path,
    sharded: Mapping[str, Any] | None = None,
    check: Callable[[Found], None] | None = None,
) -> Found:
    """The checkpoint `folder` (a `step_*` folder of a run), its DCP part loaded in place into
    `sharded` as by `load_latest`, in any layout. A folder that does not load is a `UserError`
    naming why (it is left where it is)."""
    folder = Path(folder)
    m = re.fullmatch(r"step_(\d+)", folder.name)
    if m is None or not folder.is_dir():
        raise UserError(
            f"{folder} is not a checkpoint folder (runs keep them as checkpoints/step_*)"
        )
    found, reason = _try_load(folder, int(m.group(1)), sharded, check)
    if found is None:
        raise UserError(f"checkpoint {folder} cannot be loaded: {reason}")
    return found


def _read_meta(folder: Path, step: int) -> dict[str, Any] | str:
    """`meta.json` of a complete checkpoint, or why the folder is not one."""
    try:
        meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"{META_FILE}: {type(e).__name__}: {_first_line(e)}"
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("step") != step:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        if fmt == 1:
            return "written by an earlier version of crossdistill (single-process format 1)"
        return f"{META_FILE} has format {fmt!r}, not a {FORMAT} checkpoint of step {step}"
    for name, size in meta.get("files", {}).items():
        try:
            actual = (folder / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written"
    return meta


def read_checkpoint(folder: str | Path) -> dict[str, Any]:
    """A checkpoint's whole content in this process, for inspection: `state` (the JSON
    state), `step`, and whatever DCP stored (`model`, `optimizer`, full tensors)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    folder = Path(folder)
    meta = json.loads((folder / META_FILE).read_text(encoding="utf-8"))
    with _one_process_is_meant():
        out = _load_state_dict_from_keys(checkpoint_id=str(folder / DCP_DIR))
    out.update(state=meta["state"], step=meta["step"])
    return out


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


def _non_finite(model_sd: Mapping[str, Any]) -> list[str]:
    """Names of this rank's tensors (its shards) holding NaN or Inf: one host sync for the
    whole model, a float32 sum per tensor being non-finite iff it holds one (or, for absurd
    weights, overflows: the exact check separates those)."""
    from torch.distributed.tensor import DTensor

    names, sums, local = [], [], {}
    for name, t in model_sd.items():
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
            names.append(name)
            local[name] = t
            sums.append(t.detach().sum(dtype=torch.float32 if t.is_floating_point() else None))
    if not sums:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    bad: list[str] = []
    for idx in by_device.values():
        finite = torch.isfinite(torch.stack([sums[i] for i in idx])).tolist()
        bad += [
            names[i]
            for i, ok in zip(idx, finite)
            if not ok and not bool(torch.isfinite(local[names[i]]).all())
        ]
    return bad


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


def check_same_student(
    saved: dict | None, student, folder, saved_shapes: Mapping[str, tuple] | None = None
) -> None:
    """Refuse a resume whose student is built differently from the checkpoint's, naming the
    settings that differ, or else the first tensors whose shapes differ (`saved_shapes`: global
    shapes by name), before any tensor is loaded."""
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
    if saved_shapes is not None:
        mine = {k: tuple(v.shape) for k, v in student.state_dict().items()}
        bad = [
            f"{k} {shape} in the checkpoint, {mine[k]} now"
            for k, shape in saved_shapes.items()
            if k in mine and tuple(shape) != mine[k]
        ]
        if bad:
            raise UserError(
                f"cannot resume from {folder}: the student's tensors differ in shape "
                f"({'; '.join(bad[:3])}); resume with the student settings of the checkpointed "
                "run, or start a new run in another run.out_dir"
            )


# ----------------------------------------------------------------------------- export


def full_state_on_rank0(model: torch.nn.Module, stages: Any = None) -> dict[str, torch.Tensor]:
    """The model's full state dict on CPU on rank 0 (empty elsewhere), gathered once.
    `stages`: the pipeline group of a model split into stages; each stage's part is gathered
    within its data-parallel group, then the stages' parts on the first stage."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not _dist():  # one process holds it all already
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if stages is None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    part = {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=options).items()}
    first = torch.distributed.get_group_rank(stages, torch.distributed.get_rank()) == 0
    parts: list[Any] = [None] * torch.distributed.get_world_size(stages) if first else []
    torch.distributed.gather_object(part, parts if first else None, group=stages, group_dst=0)
    if _rank() != 0:
        return {}
    return {k: v for p in parts for k, v in p.items()}


def export_hf(
    model: torch.nn.Module,
    tokenizer: Any,
    out: Path,
    fused: Mapping[str, torch.Tensor],
    stages: Any = None,
) -> None:
    """The student as a plain Hugging Face folder (`save_pretrained` + its tokenizer), written
    by rank 0 from the full weights gathered once; fused tensor-parallel rows are put back in
    Hugging Face order (`fused`: their orders, see `distributed/tp_plans.py`). Called by every
    rank, with no background save in flight (`Checkpointer.wait` first: both use the checkpoint
    group). `stages`: the pipeline group where the model is split into stages."""
    import copy

    from transformers import AutoModelForCausalLM

    state = full_state_on_rank0(model, stages)
    if _rank() == 0:
        for name, order in fused.items():
            if name in state:
                restored = torch.empty_like(state[name])
                restored[order] = state[name]
                state[name] = restored
        config = copy.deepcopy(model.config)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(state, strict=False, assign=True)
        plain.tie_weights()

        def write(folder: Path) -> None:
            plain.save_pretrained(folder, safe_serialization=True)
            tokenizer.save_pretrained(folder)

        write_folder(out, write, "the final Hugging Face folder")
    _barrier()


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

"""The resumable loader the trainer uses, and `build_loader`, its one builder.

Workers: with `num_workers = W > 0` each DataLoader worker (a fresh process, see
`WORKER_START_METHOD`) is one consumer of the schedule
(`rank * W + worker`) and builds whole batches (tokenize, align, pack, collate); the DataLoader
hands them out round-robin, worker 0 first. The loader remembers, per worker, the state after
the last batch it handed to the trainer, and which worker is next. On resume the workers start
from those states and are renumbered so the next one is asked first: the stream continues
exactly where it stopped. `num_workers = 0` runs the one consumer in the main process and gives
the same batches as `num_workers = 1`. Changing `num_workers` or the world size changes the
stream, so a resume with other values is refused.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from crossdistill.data.batch import Batch
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.schedule import EmptyStream, Plan
from crossdistill.data.stream import StreamSpec, WorkerState, batch_stream, empty_batch
from crossdistill.errors import UserError

STATE_VERSION = 2  # 2: training streams shuffle documents one row a block (`schedule`)
# Workers start from a fresh interpreter, never forked from the trainer: a forked worker holds a
# copy of the trainer's whole heap, and when its garbage collector frees a CUDA tensor it finds
# there (garbage of the parent's, not yet collected at the fork) the worker aborts with "CUDA
# error: initialization error". "spawn" rather than "forkserver": the fork server is one
# process-wide server whose preloaded modules are a global setting of the user's program.
# What a worker receives is pickled (`PackedStream`: the plan and the tokenizer sides).
WORKER_START_METHOD = "spawn"


@dataclass(frozen=True)
class _Failure:
    """A user-caused error inside a worker, re-raised as one clean `UserError` in the trainer."""

    message: str


STREAM_PREFIX = "crossdistill-stream-"  # then the writing process's id
# a stream file lives seconds (until every worker has given a batch); one this old whose writer
# is not running is stale. The age also spares a live writer whose process id this process
# cannot see (another container's, sharing the temp folder)
STALE_STREAM_S = 3600.0


def _remove_stale_stream_files(folder: str) -> None:
    """Deletes the stream files in `folder` whose writing process is gone: one killed in the
    seconds before its workers had all read theirs (SIGKILL skips every `finally`) leaves its
    file there, and the next loader built on the machine removes it. Files younger than
    `STALE_STREAM_S`, another user's, and names without a process id are left alone."""
    now = time.time()
    with os.scandir(folder) as entries:
        for entry in entries:
            name = entry.name
            if not (name.startswith(STREAM_PREFIX) and name.endswith(".pkl")):
                continue
            pid = name[len(STREAM_PREFIX) :].partition("-")[0]
            with contextlib.suppress(OSError):
                old = now - entry.stat().st_mtime > STALE_STREAM_S
                if old and pid.isdigit() and not _running(int(pid)):
                    os.remove(entry.path)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class _StreamFile(IterableDataset):
    """What each loader worker is sent in place of the stream: the path of a file that holds
    the stream pickled, which the worker reads as it starts.

    A spawned process's arguments reach it through a pipe that the parent writes whole before
    `Process.start` returns, and the parent keeps the pipe's reading end open until then. The
    stream pickles to megabytes (the tokenizers), more than a pipe buffers, so a worker that
    dies before reading them (its interpreter cannot import the program, as when the script
    was moved or edited mid-run, or it is killed) left the trainer blocked in that write for
    good. A path fits the buffer: `start` returns, and the DataLoader reports the dead worker
    ("exited unexpectedly") within seconds."""

    def __init__(self, stream: PackedStream):
        _remove_stale_stream_files(tempfile.gettempdir())
        fd, self.path = tempfile.mkstemp(prefix=f"{STREAM_PREFIX}{os.getpid()}-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(stream, f, protocol=pickle.HIGHEST_PROTOCOL)
        self.stream: PackedStream | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        with open(self.path, "rb") as f:
            self.stream = pickle.load(f)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        assert self.stream is not None, "read in the worker, from the file"
        return iter(self.stream)

    def remove(self) -> None:
        """Deletes the file, once every worker of the loader has read it or is gone; a second
        call does nothing."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)


class PackedStream(IterableDataset):
    """The per-consumer batch streams of one rank, as a DataLoader dataset. Yields
    `(batch, (worker, state))` pairs."""

    def __init__(
        self,
        plan: Plan,
        sides: list[TokenizerSide],
        spec: StreamSpec,
        rank: int,
        num_workers: int,
        repeat: bool,
    ):
        self.plan = plan
        self.sides = sides
        self.spec = spec
        self.rank = rank
        self.num_logical = max(1, num_workers)
        self.repeat = repeat
        self.start_states = [WorkerState()] * self.num_logical
        self.worker_offset = 0

    def consumer(self, logical: int) -> int:
        return self.rank * self.num_logical + logical

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        info = get_worker_info()
        physical = info.id if info is not None else 0
        logical = (physical + self.worker_offset) % self.num_logical
        try:
            stream = batch_stream(
                self.plan,
                self.consumer(logical),
                self.sides,
                self.spec,
                self.start_states[logical],
                self.repeat,
            )
            for batch, state in stream:
                yield batch, (logical, state)
        except UserError as e:
            yield _Failure(str(e)), None
        except EmptyStream as e:
            yield _Failure(_empty_message(e.consumer, self.plan.num_consumers)), None


def _empty_message(consumer: int, num_consumers: int) -> str:
    return (
        f"data reader {consumer} of {num_consumers} (world size x data workers) gets no usable "
        "document: give more data, or lower data.num_workers or the number of ranks"
    )


def _keep(item: Any) -> Any:
    return item


class DistillLoader:
    """Iterate for `Batch`es. A train loader never ends (epochs follow each other) and resumes
    from its `state_dict()`, which describes the batches handed out so far (use one iterator
    at a time); a validation loader yields its split once per `iter()`, always the same
    batches, the last one padded with empty rows. Ranks may get different numbers of
    validation batches: `take(n)` gives exactly `n` on every rank."""

    def __init__(self, stream: PackedStream, num_workers: int, pin_memory: bool, resumable: bool):
        self.stream = stream
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.resumable = resumable
        self._states = [WorkerState()] * stream.num_logical
        self._next = 0
        self.batches_yielded = 0

    def __iter__(self) -> Iterator[Batch]:
        n = self.stream.num_logical
        if self.resumable:
            self.stream.start_states, self.stream.worker_offset = list(self._states), self._next
        else:
            self.stream.start_states, self.stream.worker_offset = [WorkerState()] * n, 0
        dataset: IterableDataset = self.stream
        workers = {}
        if self.num_workers > 0:
            workers = {"multiprocessing_context": WORKER_START_METHOD}
            dataset = _StreamFile(self.stream)
        loader = DataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=_keep,
            **workers,
        )
        try:
            for given, (batch, where) in enumerate(loader, start=1):
                if isinstance(batch, _Failure):
                    raise UserError(batch.message)
                if given == self.num_workers and isinstance(dataset, _StreamFile):
                    # the DataLoader hands out its first tasks one per worker and gives results
                    # in task order: by the n-th batch every worker has answered, so has read
                    # the file, and a run killed later leaves none behind
                    dataset.remove()
                if self.resumable:
                    logical, state = where
                    self._states[logical] = state
                    self._next = (logical + 1) % n
                    self.batches_yielded += 1
                yield batch
        finally:
            if isinstance(dataset, _StreamFile):
                dataset.remove()

    def take(self, num: int) -> Iterator[Batch]:
        """Exactly `num` batches of a validation loader, starting over where the split runs
        out, so every data-parallel rank evaluates the same number of batches."""
        given = 0
        while given < num:
            before = given
            for batch in self:
                yield batch
                given += 1
                if given == num:
                    return
            if given == before:
                raise UserError("the validation split gave no batch")

    @property
    def num_skipped(self) -> int:
        """Bad rows skipped so far (train loader), summed over workers."""
        return sum(s.skipped for s in self._states)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the stream: per-worker positions (epoch, block, row,
        piece, cut point inside the partly packed document), the next worker, and the settings
        the stream depends on (checked on load)."""
        return {
            "version": STATE_VERSION,
            "identity": self._identity(),
            "workers": [s.to_dict() for s in self._states],
            "next_worker": self._next,
            "batches_yielded": self.batches_yielded,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.resumable:
            raise UserError(
                "a validation loader has no state to load; only the train loader resumes"
            )
        if state.get("version") != STATE_VERSION:
            raise UserError(
                f"data loader state version {state.get('version')} is not {STATE_VERSION}: the "
                "checkpoint was written by another crossdistill version, whose batch order "
                "differs; resume it with the version that wrote it, or start a new run"
            )
        mine, theirs = self._identity(), state.get("identity", {})
        changed = [k for k in mine if theirs.get(k) != mine[k]]
        if changed:
            detail = ", ".join(f"{k}: {theirs.get(k)!r} -> {mine[k]!r}" for k in changed)
            raise UserError(
                f"cannot resume the data stream: {detail}. The batch order depends on these; "
                "resume with the values of the checkpointed run"
            )
        self._states = [WorkerState.from_dict(d) for d in state["workers"]]
        self._next = int(state["next_worker"])
        self.batches_yielded = int(state["batches_yielded"])

    def _identity(self) -> dict[str, Any]:
        s = self.stream
        return {
            "seed": s.plan.seed,
            "num_workers": s.num_logical,
            "num_consumers": s.plan.num_consumers,
            "rank": s.rank,
            "seq_len": s.spec.seq_len,
            "micro_batch_size": s.spec.batch_size,
            "pad_multiple": s.spec.pad_multiple,
            "loss_on": s.spec.loss_on,
            "val_fraction": s.plan.val_fraction,
            "num_blocks": int(s.plan.blocks.shape[0]),
            "tokenizers": [side.fingerprint[:16] for side in s.sides],
        }


class HeldOut:
    """The validation split as the same batches every time, whatever the number of loader
    workers or data-parallel ranks: one consumer packs the whole split in file order, in this
    process (no workers), and its batches are kept in host memory once built, since every
    validation evaluates the same ones. The first `num` batches are the validation set;
    data-parallel rank `r` of `D` evaluates batches `r, r + D, ...` of them, and every rank gets
    the same number of batches (a rank short of one gets a batch of padding, which adds
    nothing), because teacher forwards spread over ranks are collectives."""

    def __init__(self, stream: PackedStream, data_rank: int = 0, data_size: int = 1):
        self.stream = stream
        self.data_rank, self.data_size = data_rank, data_size
        self._built: list[Batch] = []
        self._source: Iterator[tuple[Batch, WorkerState]] | None = None
        self._complete = False
        self._padding: Batch | None = None

    def _global(self, num: int) -> list[Batch]:
        """The first `num` batches of the split (fewer if it has fewer), built once."""
        if self._source is None and not self._complete:
            self._source = self.stream_batches()
        while len(self._built) < num and not self._complete:
            item = next(self._source, None)
            if item is None:
                self._complete, self._source = True, None
            else:
                self._built.append(item[0])
        return self._built[:num]

    def stream_batches(self) -> Iterator[tuple[Batch, WorkerState]]:
        """The whole split's batches as they are packed, none kept (a one-pass evaluation)."""
        s = self.stream
        try:
            yield from batch_stream(s.plan, 0, s.sides, s.spec, WorkerState(), repeat=False)
        except EmptyStream:
            return

    def take(self, num: int) -> list[Batch]:
        """This rank's share of the first `num` validation batches of the split, padded with
        empty batches to the same count on every rank."""
        batches = self._global(num)
        if not batches:
            raise UserError("the validation split gave no batch")
        mine = batches[self.data_rank :: self.data_size]
        count = -(-len(batches) // self.data_size)
        return mine + [self._empty()] * (count - len(mine))

    def __iter__(self) -> Iterator[Batch]:
        """This rank's share of the whole split."""
        yield from self.take(1 << 62)

    def _empty(self) -> Batch:
        if self._padding is None:
            self._padding = empty_batch(self.stream.sides, self.stream.spec)
        return self._padding

    @property
    def num_skipped(self) -> int:
        return 0


def default_pin_memory() -> bool:
    return torch.cuda.is_available()

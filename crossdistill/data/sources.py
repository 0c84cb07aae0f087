"""Readers for the corpus formats: each gives random access to rows without loading the corpus.

| format    | one row is                  | how it is read                                             |
|-----------|-----------------------------|------------------------------------------------------------|
| `text`    | one whole file              | a file per document; a folder gives all its files, sorted  |
| `jsonl`   | one line (a JSON object)    | a byte-offset index of line starts (numpy, cached on disk) |
| `parquet` | one table row               | one row group at a time, only the needed column            |
| `arrow`   | one table row               | Arrow IPC file or stream, memory-mapped                    |
| `hf_disk` | one table row               | the arrow files of a `datasets` `save_to_disk` folder, mmap |

A file compressed with gzip, bzip2, xz or zstandard (`.gz`, `.bz2`, `.xz`, `.zst`) is read by
the format of its name without that suffix (`docs.jsonl.gz` is JSONL). A compressed table or
JSONL file is decompressed once into the cache (`$CROSSDISTILL_CACHE`, keyed by path, size and
mtime), since rows are read at random; a copy of a version of the file that has since changed is
removed once no process reads it. A compressed text file is one document, decompressed when
read.

`read(start, stop)` returns one entry per row: the raw field value, `None` for a blank JSONL line
(skipped silently), or a `Bad` naming what is wrong. Turning values into documents (type and
emptiness checks) is `documents.check_document`'s job, so every format gets the same policy.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from crossdistill.cache import cache_path, write_atomic
from crossdistill.errors import UserError

FORMATS = ("text", "jsonl", "parquet", "arrow", "hf_disk")
COMPRESSIONS = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz", ".zst": "zstd", ".zstd": "zstd"}
_ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")
_SCAN_BYTES = 1 << 26  # newline scan window: 64 MiB of the mapped file at a time
_OLD_INDEX_NAME = re.compile(r"[0-9a-f]{32}\.npy")  # the line indexes' naming before keys split


@dataclass(frozen=True)
class Bad:
    """A row that cannot become a document, with the reason shown to the user."""

    reason: str


class MissingField(UserError):
    """A table without the column that holds the documents; `names` are the columns it has,
    `fix` what to change (the config's key; a command line names its flag instead)."""

    def __init__(
        self, path: str, field: str, names: list[str],
        fix: str = "set data.text_field or data.messages_field",
    ):  # fmt: skip
        super().__init__(f"{path} has no column {field!r} (columns: {', '.join(names)}); {fix}")
        self.path, self.field, self.names, self.fix = path, field, names, fix

    def __reduce__(self):  # pickled whole: a process pool hands it back to the parent
        return MissingField, (self.path, self.field, self.names, self.fix)

    def for_command_line(self) -> MissingField:
        """The same problem, with the fix a command that reads a corpus takes (`--text-field`)."""
        fix = "name the one that holds the text with --text-field"
        return MissingField(self.path, self.field, self.names, fix)


class Source(Protocol):
    """Random access to the rows of one corpus file (or folder)."""

    path: str
    num_rows: int

    def groups(self) -> list[tuple[int, int]]:
        """Row ranges `[start, stop)` that are cheap to read together (row groups, batches)."""
        ...

    def read(self, start: int, stop: int) -> list[Any]:
        """The field value of rows `[start, stop)`, `None` (blank line) or `Bad`."""
        ...

    def where(self, row: int) -> str:
        """`file:line` (or `file row N`) of a row, for messages."""
        ...


def detect_format(path: str) -> str:
    p = Path(path)
    if p.is_dir():
        if (p / "dataset_dict.json").is_file():
            splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
            raise UserError(
                f"{path} is a `datasets` DatasetDict; give one split folder instead, "
                f"e.g. {p / (splits[0] if splits else 'train')}"
            )
        if (p / "state.json").is_file():
            return "hf_disk"
        return "text"
    name = p.name.lower()
    suffix = Path(name).suffix
    if suffix in COMPRESSIONS:
        name = name[: -len(suffix)]
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith(_ARROW_SUFFIXES):
        return "arrow"
    return "text"


def open_source(path: str, fmt: str, field: str) -> Source:
    """Open one path as a `Source` reading column/key `field` (ignored for plain text)."""
    if not Path(path).exists():
        raise UserError(f"data path not found: {path}")
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "text":
        return TextSource(path)
    if fmt not in ("jsonl", "parquet", "arrow", "hf_disk"):
        raise UserError(f"unknown data format {fmt!r}; use one of auto, {', '.join(FORMATS)}")
    name, path = path, decompressed(path) if compression(path) else path
    if fmt == "jsonl":
        return JsonlSource(path, field, name)
    if fmt == "parquet":
        return ParquetSource(path, field, name)
    return ArrowSource(path, field, name)


def compression(path: str) -> str | None:
    """The compression of a file named for one (`COMPRESSIONS`), or None."""
    p = Path(path)
    return COMPRESSIONS.get(p.suffix.lower()) if p.is_file() else None


def _open_compressed(path: str) -> Any:
    """A binary reader of the decompressed bytes of `path`."""
    kind = compression(path)
    if kind == "gzip":
        import gzip

        return gzip.open(path, "rb")
    if kind == "bzip2":
        import bz2

        return bz2.open(path, "rb")
    if kind == "xz":
        import lzma

        return lzma.open(path, "rb")
    try:
        import zstandard
    except ImportError:
        raise UserError(
            f"{path} is zstandard-compressed: pip install zstandard, or decompress it first "
            f"(zstd -d {path})"
        ) from None
    return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)


def _decompress_errors() -> tuple[type[BaseException], ...]:
    import lzma
    import zlib

    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error, lzma.LZMAError)
    try:
        import zstandard

        errors += (zstandard.ZstdError,)
    except ImportError:
        pass
    return errors


# The lease files of the decompressed copies this process has opened, each under a shared lock
# held until the process exits: a copy is kept while any process holds its lease.
_LEASES: dict[str, Any] = {}


def decompressed(path: str) -> str:
    """The path of a decompressed copy of `path` in the cache, written on first use: one
    process writes it while the others (ranks, workers) wait on a lock. The copy's name holds a
    key of the source's path and one of its size and mtime. The process then holds a lease on
    it (a shared lock on `.NAME.lease`) until it exits, and copies made from earlier versions of
    the same source whose leases nobody holds are removed (`_prune_copies`)."""
    import fcntl

    plain = Path(path).name[: -len(Path(path).suffix)]
    source, state = _source_keys(path)
    cached = cache_path("decompressed", f"{source}-{state}-{plain}")
    if str(cached) in _LEASES and cached.is_file():
        _prune_copies(cached, f"{source}-*-{plain}")
        return str(cached)
    failure: list[str] = []

    def write(tmp: Path) -> None:
        with _open_compressed(path) as src, open(tmp, "wb") as dst:
            while True:
                try:
                    chunk = src.read(1 << 22)
                except _decompress_errors() as e:
                    failure.append(str(e))
                    raise OSError(e) from e  # `write_atomic` removes the partial copy
                if not chunk:
                    return
                dst.write(chunk)

    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):  # twice: once more if a stale view of the source pruned it meanwhile
            with open(cached.parent / f".{cached.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if not (cached.is_file() or write_atomic(cached, write)):
                    break
            lease = open(cached.parent / f".{cached.name}.lease", "a")  # noqa: SIM115
            fcntl.flock(lease, fcntl.LOCK_SH)
            if cached.is_file():
                _LEASES[str(cached)] = lease
                _prune_copies(cached, f"{source}-*-{plain}")
                return str(cached)
            lease.close()
    except OSError:
        pass
    if failure:
        raise UserError(f"cannot decompress {path} ({compression(path)}): {failure[0]}")
    raise UserError(
        f"cannot write a decompressed copy of {path} under {cached.parent}: set "
        "CROSSDISTILL_CACHE to a writable folder with room for it, or decompress it yourself"
    )


def _source_keys(path: str) -> tuple[str, str]:
    """(a key of `path`'s absolute path, a key of its size and modification time)."""
    st = os.stat(path)
    where = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    when = hashlib.sha256(f"{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return where, when


def _prune_copies(current: Path, pattern: str) -> None:
    """Remove the decompressed copies matching `pattern` (the same source) other than
    `current`, with their line indexes, locks and leases, where no process holds the lease:
    they were made from versions of the source that no longer exist."""
    import fcntl

    for old in current.parent.glob(pattern):
        if old == current:
            continue
        lease_path = old.parent / f".{old.name}.lease"
        try:
            with open(lease_path, "a") as lease:
                fcntl.flock(lease, fcntl.LOCK_EX | fcntl.LOCK_NB)  # fails while a run reads it
                if old.exists():  # not removed by another process meanwhile
                    _index_path(*_source_keys(str(old))).unlink(missing_ok=True)
                    old.unlink()
                (old.parent / f".{old.name}.lock").unlink(missing_ok=True)
                lease_path.unlink(missing_ok=True)
        except OSError:
            continue


class TextSource:
    """Plain text: every file is one document (a folder: every regular file below it, sorted)."""

    def __init__(self, path: str):
        p = Path(path)
        if p.is_dir():
            files = sorted(
                str(f)
                for f in p.rglob("*")
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
        else:
            files = [str(p)]
        if not files:
            raise UserError(f"no files under {path}; a text corpus folder needs at least one file")
        self.path = path
        self.files = files
        self.num_rows = len(files)

    def groups(self) -> list[tuple[int, int]]:
        return [(0, self.num_rows)]

    def read(self, start: int, stop: int) -> list[Any]:
        out: list[Any] = []
        for f in self.files[start:stop]:
            if compression(f):
                try:
                    with _open_compressed(f) as packed:
                        data = packed.read()
                except _decompress_errors() as e:
                    out.append(Bad(f"cannot decompress it ({compression(f)}): {e}"))
                    continue
            else:
                data = Path(f).read_bytes()
            try:
                out.append(data.decode("utf-8"))
            except UnicodeDecodeError as e:
                line = data.count(b"\n", 0, e.start) + 1
                out.append(Bad(f"non-UTF-8 bytes at line {line} (byte {e.start})"))
        return out

    def where(self, row: int) -> str:
        return self.files[row]


class JsonlSource:
    """JSON Lines read through an index of line starts: `offsets[i]` is where line `i` begins,
    `offsets[-1]` the file size. The index is built once by a vectorised newline scan and cached
    (see `jsonl_index`); workers map it read-only, so RAM holds only what is being read."""

    def __init__(self, path: str, field: str, name: str | None = None):
        self.path = path  # what is read; `name` (default: the path) is what messages show
        self.name = name or path
        self.field = field
        self.offsets = jsonl_index(path)
        self.num_rows = len(self.offsets) - 1
        self._mm: mmap.mmap | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_mm"] = None  # a map is per process; reopened on first read
        return state

    def _map(self) -> mmap.mmap | bytes:
        if self._mm is None:
            if os.path.getsize(self.path) == 0:
                return b""
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mm

    def groups(self) -> list[tuple[int, int]]:
        return [(0, self.num_rows)]

    def read(self, start: int, stop: int) -> list[Any]:
        if start >= stop:
            return []
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        block = self._map()[lo:hi]
        starts = self.offsets[start : stop + 1] - lo
        return [
            self._parse(block[int(a) : int(b)])
            for a, b in zip(starts[:-1], starts[1:], strict=True)
        ]

    def _parse(self, raw: bytes) -> Any:
        if not raw.strip():
            return None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return Bad(f"non-UTF-8 bytes at column {e.start + 1}")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            return Bad(f"malformed JSON ({e.msg} at column {e.colno})")
        if not isinstance(obj, dict):
            return Bad(f"a JSON {type(obj).__name__}, not an object")
        if self.field not in obj or obj[self.field] is None:
            return Bad(f"missing field {self.field!r}")
        return obj[self.field]

    def where(self, row: int) -> str:
        return f"{self.name}:{row + 1}"


def jsonl_index(path: str) -> np.ndarray:
    """Line-start offsets of a JSONL file, int64 `[num_lines + 1]`, memory-mapped from a cache
    file (`$CROSSDISTILL_CACHE`, default `~/.cache/crossdistill`) keyed by path, size and mtime.
    Writing it removes the indexes of the same path's earlier versions: they can no longer be
    read, and a corpus that grows would leave one behind each time (a process that has one
    mapped keeps reading it; the file goes when it unmaps). It also removes indexes under the
    earlier naming (32 hex digits of path, size and mtime together), which nothing reads."""
    source, state = _source_keys(path)
    cached = _index_path(source, state)
    if cached.is_file():
        try:
            return np.load(cached, mmap_mode="r")
        except (OSError, ValueError):
            pass  # a torn write; rebuild below
    offsets = _scan_line_starts(path, os.stat(path).st_size)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, offsets)

    if write_atomic(cached, write):
        for old in cached.parent.glob(f"{source}-*.npy"):
            if old != cached:
                old.unlink(missing_ok=True)
        for old in cached.parent.glob("*.npy"):
            if _OLD_INDEX_NAME.fullmatch(old.name):
                old.unlink(missing_ok=True)
        return np.load(cached, mmap_mode="r")
    return offsets  # read-only home: keep the index in memory


def _index_path(source: str, state: str) -> Path:
    """Where the line index of a file is cached, by the keys of its path and of its size and
    modification time (`_source_keys`)."""
    return cache_path("jsonl-index", f"{source}-{state}.npy")


def _scan_line_starts(path: str, size: int) -> np.ndarray:
    if size == 0:
        return np.zeros(1, dtype=np.int64)
    parts = [np.zeros(1, dtype=np.int64)]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for lo in range(0, size, _SCAN_BYTES):
            n = min(_SCAN_BYTES, size - lo)
            window = np.frombuffer(mm, dtype=np.uint8, count=n, offset=lo)
            parts.append(np.flatnonzero(window == 10).astype(np.int64) + (lo + 1))
            del window  # the map cannot close while a view is alive
    starts = np.concatenate(parts)
    if starts[-1] != size:  # no trailing newline: the last line ends at EOF
        starts = np.append(starts, size)
    return starts


class ParquetSource:
    """Parquet read one row group at a time (only `field`); the last group read stays cached."""

    def __init__(self, path: str, field: str, name: str | None = None):
        import pyarrow.parquet as pq

        self.path = path
        self.name = name or path
        self.field = field
        try:
            meta = pq.ParquetFile(path).metadata
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise UserError(f"cannot read {self.name} as Parquet: {e}") from None
        names = pq.ParquetFile(path).schema_arrow.names
        if field not in names:
            raise MissingField(self.name, field, names)
        sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        self._cache: tuple[int, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"] = None
        return state

    def groups(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self.starts[:-1], self.starts[1:]) if b > a]

    def _group(self, g: int) -> Any:
        import pyarrow.parquet as pq

        if self._cache is None or self._cache[0] != g:
            table = pq.ParquetFile(self.path).read_row_group(g, columns=[self.field])
            self._cache = (g, table.column(0))
        return self._cache[1]

    def read(self, start: int, stop: int) -> list[Any]:
        out: list[Any] = []
        row = start
        while row < stop:
            g = int(np.searchsorted(self.starts, row, side="right")) - 1
            end = min(stop, int(self.starts[g + 1]))
            col = self._group(g).slice(row - int(self.starts[g]), end - row)
            out.extend(_column_values(col.to_pylist(), self.field))
            row = end
        return out

    def where(self, row: int) -> str:
        return f"{self.name} row {row}"


class ArrowSource:
    """An Arrow IPC file or stream, or the arrow files of a `save_to_disk` folder, memory-mapped:
    slicing a row range touches only the pages of that range."""

    def __init__(self, path: str, field: str, name: str | None = None):
        p = Path(path)
        if p.is_dir():
            state = json.loads((p / "state.json").read_text())
            files = [str(p / f["filename"]) for f in state.get("_data_files", [])]
            if not files:
                raise UserError(f"{path}/state.json lists no arrow data files")
        else:
            files = [str(p)]
        self.path = path
        self.name = name or path
        self.field = field
        self.files = files
        sizes = [_arrow_table(f, self.name if name else f).num_rows for f in files]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])
        names = _arrow_table(files[0]).schema.names
        if field not in names:
            raise MissingField(self.name, field, names)
        self._tables: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tables"] = {}
        return state

    def groups(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self.starts[:-1], self.starts[1:]) if b > a]

    def read(self, start: int, stop: int) -> list[Any]:
        out: list[Any] = []
        row = start
        while row < stop:
            i = int(np.searchsorted(self.starts, row, side="right")) - 1
            end = min(stop, int(self.starts[i + 1]))
            if i not in self._tables:
                self._tables[i] = _arrow_table(self.files[i]).column(self.field)
            col = self._tables[i].slice(row - int(self.starts[i]), end - row)
            out.extend(_column_values(col.to_pylist(), self.field))
            row = end
        return out

    def where(self, row: int) -> str:
        i = int(np.searchsorted(self.starts, row, side="right")) - 1
        file = self.name if len(self.files) == 1 else self.files[i]
        return f"{file} row {row - int(self.starts[i])}"


def _arrow_table(path: str, name: str | None = None) -> Any:
    """The table of an Arrow file; `name` is the file a message names (default: `path`)."""
    import pyarrow as pa

    try:
        source = pa.memory_map(path, "r")
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source).read_all()  # `datasets` writes the stream format
    except (OSError, pa.ArrowInvalid) as e:
        raise UserError(f"cannot read {name or path} as an Arrow IPC file or stream: {e}") from None


def _column_values(values: list[Any], field: str) -> list[Any]:
    return [Bad(f"missing field {field!r} (null)") if v is None else v for v in values]

"""The teacher-target cache on disk: a teacher run once over a corpus, read by any student.

A cache folder holds what every loss needs from one teacher, per document of the corpus, at
every teacher position: its tokens and the bytes of text each covers, its top-k ids and
log-probs at the build's temperature with the log of the tail mass, and the log-prob (at τ = 1)
of the actual next token. Every chunk start of any student tokenizer is a teacher token
boundary, so one cache serves every student; packing and `seq_len` are the trainer's own.

Layout of a folder:

- `manifest.json` (written last): format, code version, teacher and tokenizer fingerprints,
  top_k, temperature, quantisation, the data settings that decide tokenization, the corpus
  files, totals, and each shard's name, size and checksum;
- `config.json` and the tokenizer files: the folder loads as the teacher's tokenizer and
  config (no weights), so `teachers[i].cache: DIR` needs nothing else;
- `shards/*.cdc`: per document one zstd-compressed record, then a JSON footer listing each
  record (document key, offset, sizes, CRC32) and the footer's length. A shard is renamed into
  place complete; a file without a valid footer is never read.

Documents are keyed by a hash of their text (a conversation: of its messages), so the
trainer finds a document's targets whatever order, split or packing it uses.

Record encoding (n teacher tokens, K = top_k): token ids (int32), text bytes per token
(uint32), next-token and tail log-probs (float16; float32 unquantised), top-k ids and log-probs.
Quantised (`int8`, the default), each row's top-k is stored in id order, ids as deltas split
into byte planes and log-probs as `round(−8·logp)` clipped to 255 (steps of 1/8 nat, down to
−31.9); the reader puts each row back in descending order and renormalises it with its tail.
Unquantised (`none`), ids and float32 log-probs are stored in the teacher's order and read back
bit for bit. zstd then packs each record (about 120 bytes per teacher token at top-64 on a
trained model; `crossdistill cache inspect` reports it).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crossdistill.config import Quantization
from crossdistill.errors import UserError
from crossdistill.losses.payload import QUANT_SCALE, renormalise_top_k

FORMAT = 1
MAGIC = b"CDCACHE1"
MANIFEST = "manifest.json"
SHARDS = "shards"
SHARD_SUFFIX = ".cdc"
_FOOTER_TAIL = struct.Struct("<Q8s")  # footer length, magic
_ZSTD_LEVEL = 6


def _codec():
    import pyarrow as pa

    return pa.Codec("zstd", compression_level=_ZSTD_LEVEL)


def document_key(doc: Any) -> str:
    """The cache key of a checked document (`data.documents.check_document`): a hash of its
    text, or of its messages' roles and contents."""
    if isinstance(doc, str):
        payload = doc.encode("utf-8")
    else:
        payload = json.dumps([[m.role, m.content] for m in doc], ensure_ascii=False).encode()
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


@dataclass
class DocTargets:
    """One document's cached targets (numpy, n teacher tokens, K = top_k).

    ids [n] int64 teacher tokens; text_bytes [n] int64; next_logprobs [n] float32 (position i:
    log-prob of token i + 1; 0 at the last); topk_ids [n, K] int32 and topk_logprobs [n, K]
    float32 by descending probability; tail_logprob [n] float32."""

    ids: np.ndarray
    text_bytes: np.ndarray
    next_logprobs: np.ndarray
    topk_ids: np.ndarray
    topk_logprobs: np.ndarray
    tail_logprob: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0])


def encode_record(t: DocTargets, quantization: Quantization) -> tuple[bytes, int]:
    """(compressed bytes, raw length) of one document's targets."""
    parts = [t.ids.astype(np.int32), t.text_bytes.astype(np.uint32)]
    if quantization == "none":
        parts += [
            t.next_logprobs.astype(np.float32),
            t.tail_logprob.astype(np.float32),
            t.topk_ids.astype(np.int32),
            t.topk_logprobs.astype(np.float32),
        ]
    else:
        order = np.argsort(t.topk_ids, axis=1, kind="stable")
        ids = np.take_along_axis(t.topk_ids.astype(np.int64), order, axis=1)
        lp = np.take_along_axis(t.topk_logprobs, order, axis=1)
        deltas = np.diff(ids, axis=1, prepend=0).astype(np.uint32)
        planes = deltas.reshape(-1).view(np.uint8).reshape(-1, 4).T  # byte planes
        codes = np.clip(np.rint(-lp.astype(np.float64) * QUANT_SCALE), 0, 255).astype(np.uint8)
        parts += [
            t.next_logprobs.astype(np.float16),
            t.tail_logprob.astype(np.float16),
            np.ascontiguousarray(planes),
            codes,
        ]
    raw = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
    return _codec().compress(raw, asbytes=True), len(raw)


def decode_record(
    blob: bytes | memoryview, raw_len: int, n: int, k: int, quantization: Quantization
) -> DocTargets:
    """The inverse of `encode_record`."""
    raw = _codec().decompress(blob, decompressed_size=raw_len, asbytes=True)
    buf = np.frombuffer(raw, dtype=np.uint8)
    at = 0

    def take(dtype, count: int) -> np.ndarray:
        nonlocal at
        size = np.dtype(dtype).itemsize * count
        out = buf[at : at + size].view(dtype)
        at += size
        return out

    ids = take(np.int32, n).astype(np.int64)
    text_bytes = take(np.uint32, n).astype(np.int64)
    if quantization == "none":
        next_lp = take(np.float32, n).copy()
        tail = take(np.float32, n).copy()
        top_ids = take(np.int32, n * k).reshape(n, k).copy()
        top_lp = take(np.float32, n * k).reshape(n, k).copy()
    else:
        next_lp = take(np.float16, n).astype(np.float32)
        tail = take(np.float16, n).astype(np.float32)
        planes = take(np.uint8, 4 * n * k).reshape(4, n * k)
        deltas = np.ascontiguousarray(planes.T).view(np.uint32).reshape(n, k)
        sorted_ids = np.cumsum(deltas.astype(np.int64), axis=1)
        lp = -take(np.uint8, n * k).reshape(n, k).astype(np.float32) / QUANT_SCALE
        order = np.argsort(-lp, axis=1, kind="stable")
        top_ids = np.take_along_axis(sorted_ids, order, axis=1).astype(np.int32)
        top_lp = np.take_along_axis(lp, order, axis=1)
        # each row renormalised with its tail, as a separate teacher's int8 payload is
        lp_t, tail_t = renormalise_top_k(torch.from_numpy(top_lp), torch.from_numpy(tail))
        top_lp, tail = lp_t.numpy(), tail_t.numpy()
    if at != raw_len:
        raise ValueError(f"record holds {raw_len} bytes, its layout {at}")
    return DocTargets(ids, text_bytes, next_lp, top_ids, top_lp, tail)


# ---------------------------------------------------------------- shards


@dataclass
class RecordEntry:
    """Where one document's record lives in a shard."""

    key: str
    offset: int
    size: int
    raw: int
    tokens: int
    crc: int


class ShardWriter:
    """Writes one shard: records appended to a temporary file, the footer, then an atomic
    rename. A build killed before `close` leaves only the temporary file, which no reader
    opens and the next build deletes. A full disk is one `UserError` naming the shard."""

    def __init__(self, path: Path, meta: dict[str, Any] | None = None):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp")
        self.meta = meta or {}
        self.entries: list[RecordEntry] = []
        self.offset = 0
        self.nll = 0.0  # Σ −log p(next token) over the shard's valid positions (nats)
        self.bytes = 0  # Σ text bytes those positions predict
        self._file = self._guard(lambda: open(self.tmp, "wb"))  # noqa: SIM115

    def add(self, key: str, blob: bytes, raw: int, tokens: int, nll: float, nbytes: int) -> None:
        self._guard(lambda: self._file.write(blob))
        self.entries.append(RecordEntry(key, self.offset, len(blob), raw, tokens, zlib.crc32(blob)))
        self.offset += len(blob)
        self.nll += nll
        self.bytes += nbytes

    @property
    def num_bytes(self) -> int:
        return self.offset

    def close(self) -> dict[str, Any]:
        """Finish the shard; returns its manifest entry."""
        footer = json.dumps(
            {
                **self.meta,
                "records": [
                    [e.key, e.offset, e.size, e.raw, e.tokens, e.crc] for e in self.entries
                ],
                "nll": self.nll,
                "bytes": self.bytes,
            },
            separators=(",", ":"),
        ).encode()

        def finish() -> None:
            self._file.write(footer)
            self._file.write(_FOOTER_TAIL.pack(len(footer), MAGIC))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.path)

        self._guard(finish)
        return shard_summary(self.path, read_footer(self.path))

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        self.tmp.unlink(missing_ok=True)

    def _guard(self, fn):
        try:
            return fn()
        except OSError as e:
            if hasattr(self, "_file"):  # not while opening it
                self.abort()
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(
                    f"disk full while writing {self.path}: the shards written before it are "
                    "intact; free space and run the same `crossdistill cache build` again to "
                    "go on from there"
                ) from None
            raise UserError(f"cannot write {self.path}: {e.strerror or e}") from None


def read_footer(path: Path) -> dict[str, Any]:
    """A shard's footer; `UserError` naming the file if it is truncated or not a shard."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size < _FOOTER_TAIL.size:
                raise ValueError("shorter than a footer")
            f.seek(size - _FOOTER_TAIL.size)
            length, magic = _FOOTER_TAIL.unpack(f.read(_FOOTER_TAIL.size))
            if magic != MAGIC or length > size - _FOOTER_TAIL.size:
                raise ValueError("no footer (truncated or not a cache shard)")
            f.seek(size - _FOOTER_TAIL.size - length)
            footer = json.loads(f.read(length))
    except (ValueError, json.JSONDecodeError) as e:
        raise UserError(
            f"teacher cache shard {path} is damaged ({e}); delete it and run "
            "`crossdistill cache build` again to rebuild it"
        ) from None
    return footer


def shard_summary(path: Path, footer: dict[str, Any]) -> dict[str, Any]:
    """A shard's manifest entry."""
    records = footer["records"]
    return {
        "file": path.name,
        "docs": len(records),
        "tokens": int(sum(r[4] for r in records)),
        "bytes": path.stat().st_size,
        "nll": footer["nll"],
        "text_bytes": footer["bytes"],
        "crc": file_crc(path),
    }


def file_crc(path: Path) -> int:
    """CRC32 of a whole file (what the manifest records per shard)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            crc = zlib.crc32(block, crc)
    return crc


# ---------------------------------------------------------------- manifest and reader


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """A finished cache's manifest; `UserError` naming what is missing or from another
    version."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        hint = (
            " (a build has started there but not finished: run `crossdistill cache build` again "
            "to complete it)"
            if (Path(folder) / SHARDS).is_dir()
            else ""
        )
        raise UserError(f"{folder} is not a teacher cache: it has no {MANIFEST}{hint}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); rebuild the cache") from None
    if manifest.get("format") != FORMAT:
        raise UserError(
            f"teacher cache {folder} has format {manifest.get('format')!r}, this crossdistill "
            f"reads format {FORMAT}: rebuild it with `crossdistill cache build`"
        )
    return manifest


class RecordIndex:
    """Where each document's record is, as sorted arrays (about 60 bytes per document, so that
    every loader worker can hold the index of a corpus of millions of documents)."""

    def __init__(self, shards: list[tuple[int, list[list]]]):
        keys = [bytes.fromhex(r[0]) for _, records in shards for r in records]
        rows = [[i, *r[1:]] for i, records in shards for r in records]
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 6)
        order = np.argsort(np.asarray(keys, dtype="S16"), kind="stable")
        self.keys = np.asarray(keys, dtype="S16")[order]
        self.table = table[order]

    def _find(self, key: str) -> int:
        k = np.asarray([bytes.fromhex(key)], dtype="S16")[0]  # stored as the keys are
        i = int(np.searchsorted(self.keys, k))
        return i if i < self.keys.size and self.keys[i] == k else -1

    def __contains__(self, key: str) -> bool:
        return self._find(key) >= 0

    def __getitem__(self, key: str) -> tuple[int, ...]:
        i = self._find(key)
        if i < 0:
            raise KeyError(key)
        return tuple(int(v) for v in self.table[i])

    def __iter__(self):
        return (k.ljust(16, b"\0").hex() for k in self.keys.tolist())  # numpy drops trailing NULs

    def __len__(self) -> int:
        return int(self.keys.size)


class CacheReader:
    """Random access to a finished cache by document key. Picklable (loader workers open their
    own memory maps on first use). Every record's CRC32 is checked on read: a damaged record is
    a `UserError` naming its shard, never wrong targets."""

    def __init__(self, folder: str | Path, keep: int = 8):
        self.folder = Path(folder)
        self.manifest = read_manifest(self.folder)
        self.top_k = int(self.manifest["top_k"])
        self.quantization: Quantization = self.manifest["quantization"]
        self.keep = keep
        self._index: RecordIndex | None = None
        self._maps: dict[int, mmap.mmap] = {}
        self._recent: OrderedDict[str, DocTargets] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        return {"folder": self.folder, "keep": self.keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["folder"], state["keep"])

    @property
    def index(self) -> RecordIndex:
        """key -> (shard number, offset, size, raw size, tokens, crc), read from the shards'
        footers on first use (in each loader worker)."""
        if self._index is None:
            self._index = RecordIndex(
                [
                    (i, read_footer(self.folder / SHARDS / shard["file"])["records"])
                    for i, shard in enumerate(self.manifest["shards"])
                ]
            )
        return self._index

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def get(self, key: str) -> DocTargets:
        hit = self._recent.get(key)
        if hit is not None:
            self._recent.move_to_end(key)
            return hit
        shard, off, size, raw, tokens, crc = self.index[key]
        name = self.folder / SHARDS / self.manifest["shards"][shard]["file"]
        view = memoryview(self._map(shard, name))[off : off + size]
        if len(view) != size or zlib.crc32(view) != crc:
            raise UserError(
                f"teacher cache shard {name} is damaged (record of document {key} fails its "
                "checksum); delete the shard and run `crossdistill cache build` again"
            )
        try:
            out = decode_record(view, raw, tokens, self.top_k, self.quantization)
        except (ValueError, OSError) as e:
            raise UserError(
                f"teacher cache shard {name}: record {key} does not decode ({e}); delete the "
                "shard and run `crossdistill cache build` again"
            ) from None
        self._recent[key] = out
        if len(self._recent) > self.keep:
            self._recent.popitem(last=False)
        return out

    def _map(self, shard: int, name: Path) -> mmap.mmap:
        if shard not in self._maps:
            try:
                with open(name, "rb") as f:
                    self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as e:
                raise UserError(f"cannot read teacher cache shard {name}: {e}") from None
        return self._maps[shard]


@dataclass(frozen=True, eq=False)
class CachedTeacher:
    """A configured teacher that reads its targets from a cache: the reader, the top-k its
    loss uses (at most the cache's), its name for messages, and the top-k rows per chunk its
    target reads where its tokenizer is not the student's (`losses.target_rows`: `depth`
    rows, and with `past_end` the row after the chunk; the cache holds every position's)."""

    reader: CacheReader
    top_k: int
    name: str
    depth: int = 1
    past_end: bool = False

    @property
    def temperature(self) -> float:
        return float(self.reader.manifest["temperature"])


def concat_docs(docs: list[DocTargets]) -> tuple[DocTargets, np.ndarray]:
    """The documents' targets end to end, and each one's first row in the result."""
    starts = np.cumsum([0] + [d.num_tokens for d in docs])[:-1].astype(np.int64)
    if not docs:
        empty = np.zeros(0, dtype=np.int64)
        return DocTargets(empty, empty, empty.astype(np.float32), *(None,) * 3), starts
    return (
        DocTargets(*(np.concatenate([getattr(d, f) for d in docs]) for f in _FIELDS)),
        starts,
    )


_FIELDS = ("ids", "text_bytes", "next_logprobs", "topk_ids", "topk_logprobs", "tail_logprob")


def truncate_top_k(ids: np.ndarray, lp: np.ndarray, tail: np.ndarray, k: int):
    """The first `k` of rows sorted by descending probability; the rest joins the tail."""
    if k >= ids.shape[1]:
        return ids, lp, tail
    rest = lp[:, k:].astype(np.float64)
    peak = np.maximum(rest.max(axis=1), tail)
    mass = np.exp(rest - peak[:, None]).sum(axis=1) + np.exp(tail - peak)
    return ids[:, :k], lp[:, :k], (peak + np.log(mass)).astype(np.float32)

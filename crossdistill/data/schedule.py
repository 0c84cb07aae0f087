"""Which rows each reader process sees, in what order: splitting, shuffling, sharding.

The corpus is cut into blocks of rows read together. Each epoch the blocks are permuted with
`(seed, epoch)` and dealt round-robin to the *consumers* (`rank * num_workers + worker`), so
ranks and workers see disjoint parts of the stream; inside a block the rows are permuted with
`(seed, epoch, block)`. A shuffled stream (training) takes blocks of one row while the block
table stays small (`MAX_BLOCKS`), so documents are shuffled across the whole corpus: with
large blocks a consumer reads long runs of neighbouring rows, and a corpus stored in some order
(by language, source, date) trains for hundreds of steps on one region of it, which makes the
model depend on the seed far more than on anything else. Past `MAX_BLOCKS` rows, blocks grow.
A Parquet row group stays one block (reading any of its rows decodes all of it), and an
unshuffled stream (validation) reads blocks of up to `MAX_BLOCK_ROWS` in order. Nothing is
stored per row: the train/validation split is a hash of `(seed, source, row)` compared with
`val_fraction`, so a 100 GB corpus needs no row list.

A position in a consumer's stream is a `Cursor`; positions only move forward, so the stream
from any cursor is the same as the uninterrupted stream from that point on.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from crossdistill.data.sources import ParquetSource, Source

MAX_BLOCK_ROWS = 1024
MAX_BLOCKS = 1 << 18  # a shuffled stream's block table: 6 MiB, pickled into every worker
_BLOCKS_PER_CONSUMER = 4  # enough Parquet blocks that every consumer gets work
_MIX = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True)
class Cursor:
    """A position in one consumer's stream: the row `row` (in shuffled order) of the
    `block`-th block this consumer reads in `epoch`, piece `piece` of that row's document."""

    epoch: int = 0
    block: int = 0
    row: int = 0
    piece: int = 0

    def as_list(self) -> list[int]:
        return [self.epoch, self.block, self.row, self.piece]


Split = Literal["train", "validation", "all"]


class Plan:
    """Blocks of a list of sources and the rule that splits rows into train / validation.

    blocks: [N, 3] int64 rows `(source, start, stop)`.
    """

    def __init__(
        self,
        sources: list[Source],
        split: Split,
        val_fraction: float,
        seed: int,
        num_consumers: int,
        shuffle: bool,
    ):
        self.sources = sources
        self.split = split
        self.val_fraction = float(val_fraction)
        self.seed = int(seed) % (1 << 63)  # numpy seeds must be non-negative
        self.num_consumers = int(num_consumers)
        self.shuffle = shuffle
        self.blocks = _make_blocks(sources, num_consumers, shuffle)
        # blocks of one row each: the split is applied to the table once, not per block read
        self._split_in_blocks = False
        sizes = self.blocks[:, 2] - self.blocks[:, 1]
        if split != "all" and self.blocks.shape[0] and bool((sizes == 1).all()):
            held = np.zeros(self.blocks.shape[0], dtype=bool)
            for src in np.unique(self.blocks[:, 0]).tolist():
                mine = self.blocks[:, 0] == src
                held[mine] = _unit_hash(self.seed, src, self.blocks[mine, 1]) < self.val_fraction
            self.blocks = self.blocks[held if split == "validation" else ~held]
            self._split_in_blocks = True

    def block_order(self, epoch: int, consumer: int) -> np.ndarray:
        """Indices into `blocks` that `consumer` reads in `epoch`, in reading order."""
        n = self.blocks.shape[0]
        order = (
            np.random.default_rng([self.seed, epoch]).permutation(n)
            if self.shuffle
            else np.arange(n)
        )
        return order[consumer :: self.num_consumers]

    def rows(self, epoch: int, block_id: int) -> np.ndarray:
        """Source row numbers of one block in `split`, in the epoch's order."""
        src, start, stop = (int(x) for x in self.blocks[block_id])
        rows = np.arange(start, stop, dtype=np.int64)
        if self.split != "all" and not self._split_in_blocks:
            is_val = _unit_hash(self.seed, src, rows) < self.val_fraction
            rows = rows[is_val] if self.split == "validation" else rows[~is_val]
        if self.shuffle and rows.size > 1:
            rows = np.random.default_rng([self.seed, epoch, block_id]).permutation(rows)
        return rows

    def stream(
        self, consumer: int, start: Cursor, repeat: bool
    ) -> Iterator[tuple[Cursor, Any, str]]:
        """`(cursor, value, where)` for each row from `start` on (piece 0 of each row; the
        caller handles pieces). `value` is the source's raw value or `Bad`. With `repeat`
        the epochs never end; a consumer that gets no row in a whole epoch raises."""
        epoch = start.epoch
        first = True
        while True:
            seen = 0
            order = self.block_order(epoch, consumer)
            b0 = start.block if first else 0
            for bi in range(b0, order.size):
                block_id = int(order[bi])
                rows = self.rows(epoch, block_id)
                r0 = start.row if first and bi == start.block else 0
                if r0 >= rows.size:
                    continue
                src = int(self.blocks[block_id, 0])
                values = _read_rows(self.sources[src], rows[r0:])
                for ri, (row, value) in enumerate(zip(rows[r0:].tolist(), values), start=r0):
                    seen += 1
                    yield Cursor(epoch, bi, ri, 0), value, self.sources[src].where(row)
            if not repeat:
                return
            if seen == 0 and not first:
                raise EmptyStream(consumer)
            first = False
            epoch += 1


class EmptyStream(Exception):
    """A consumer's share of the data holds no row (turned into a UserError upstream)."""

    def __init__(self, consumer: int):
        super().__init__(consumer)
        self.consumer = consumer


def _read_rows(source: Source, rows: np.ndarray) -> list[Any]:
    """Values of `rows` (any order): the covering range in one read when the rows are dense
    in it, else each run of consecutive rows on its own (a sparse validation split)."""
    if rows.size == 0:
        return []
    lo, hi = int(rows.min()), int(rows.max()) + 1
    if 2 * rows.size >= hi - lo or isinstance(source, ParquetSource):
        values = source.read(lo, hi)
        return [values[r - lo] for r in rows.tolist()]
    ordered = np.sort(rows)
    breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
    got: dict[int, Any] = {}
    for run in np.split(ordered, breaks):
        a = int(run[0])
        got.update(zip(range(a, a + run.size), source.read(a, a + run.size)))
    return [got[r] for r in rows.tolist()]


def _make_blocks(sources: list[Source], num_consumers: int, shuffle: bool) -> np.ndarray:
    """`[N, 3]` `(source, start, stop)`: one row a block for a shuffled stream up to
    `MAX_BLOCKS` rows, `MAX_BLOCK_ROWS` for an unshuffled one; Parquet row groups whole while
    there are enough of them to go round the consumers."""
    total = sum(s.num_rows for s in sources)
    want = max(1, _BLOCKS_PER_CONSUMER * num_consumers)
    if shuffle:
        block_rows = min(MAX_BLOCK_ROWS, max(1, math.ceil(total / MAX_BLOCKS)))
    else:
        block_rows = min(MAX_BLOCK_ROWS, max(1, math.ceil(total / want)))
    parts = []
    for i, src in enumerate(sources):
        groups = src.groups()
        for start, stop in groups:
            if isinstance(src, ParquetSource):
                step = max(1, math.ceil((stop - start) / math.ceil(want / max(1, len(groups)))))
            else:
                step = block_rows
            starts = np.arange(start, stop, step, dtype=np.int64)
            ends = np.minimum(starts + step, stop)
            parts.append(np.stack([np.full_like(starts, i), starts, ends], axis=1))
    return np.concatenate(parts) if parts else np.zeros((0, 3), dtype=np.int64)


def _unit_hash(seed: int, source: int, rows: np.ndarray) -> np.ndarray:
    """A uniform number in [0, 1) per row from (seed, source, row): splitmix64 finalizer."""
    with np.errstate(over="ignore"):
        x = rows.astype(np.uint64) * _MIX
        x ^= np.uint64((seed * 1_000_003 + source) & 0xFFFFFFFFFFFFFFFF) * np.uint64(
            0xBF58476D1CE4E5B9
        )
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)

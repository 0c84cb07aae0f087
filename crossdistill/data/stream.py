"""One consumer's batch stream: rows -> documents -> units -> packed rows -> batches.

This is what runs inside a DataLoader worker (or the main process with `num_workers=0`).
After every batch it reports its `WorkerState`; restarting from that state gives exactly the
batches that would have followed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import numpy as np

from crossdistill.data.batch import Batch
from crossdistill.data.documents import PIECE_CHARS, BadInputPolicy, check_document, text_pieces
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.packing import RowPacker, collate
from crossdistill.data.schedule import Cursor, EmptyStream, Plan
from crossdistill.data.sources import Bad
from crossdistill.data.teacher_cache import CachedTeacher, document_key
from crossdistill.data.units import Unit, chat_unit, text_unit


@dataclass(frozen=True)
class WorkerState:
    """Where a consumer's next batch starts: the unit at `cursor`, from common cut point `cut`
    (the partly packed document), and how many bad rows it has skipped so far."""

    cursor: Cursor = Cursor()
    cut: int = 0
    skipped: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            **dict(zip(("epoch", "block", "row", "piece"), self.cursor.as_list())),
            "cut": self.cut,
            "skipped": self.skipped,
        }

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> WorkerState:
        cursor = Cursor(int(d["epoch"]), int(d["block"]), int(d["row"]), int(d["piece"]))
        return cls(cursor, int(d["cut"]), int(d["skipped"]))


@dataclass(frozen=True)
class StreamSpec:
    """What a consumer needs besides the plan and the tokenizers."""

    kind: Literal["text", "chat"]
    field: str
    loss_on: Literal["assistant", "all"]
    seq_len: int
    batch_size: int
    pad_multiple: int
    bad_input: Literal["skip", "error"]
    slots: tuple[int, ...]  # per configured teacher: index among cross tokenizers, -1 = student's
    piece_chars: int = PIECE_CHARS
    # per configured teacher: where it reads its targets from a cache (None: it runs live)
    caches: tuple[CachedTeacher | None, ...] = ()


def batch_stream(
    plan: Plan,
    consumer: int,
    sides: list[TokenizerSide],
    spec: StreamSpec,
    start: WorkerState,
    repeat: bool,
) -> Iterator[tuple[Batch, WorkerState]]:
    """Batches of `consumer`'s share from `start`. Finite streams end with a last batch whose
    missing rows are padding."""
    policy = BadInputPolicy(spec.bad_input)
    policy.num_skipped = start.skipped
    packer = RowPacker(spec.seq_len, _head_size(sides))
    rows: list = []
    args = (spec.batch_size, spec.seq_len, spec.pad_multiple, sides, list(spec.slots), spec.caches)
    dropped: tuple[int, int, int] | None = None  # the row whose remaining pieces are dropped
    for cursor, unit, where in _units(plan, consumer, sides, spec, start, repeat, policy, packer):
        row_key = (cursor.epoch, cursor.block, cursor.row)
        if row_key == dropped:
            continue
        a = start.cut if cursor == start.cursor else 0
        while a < unit.cuts_s.size - 1:
            b, full = packer.place(unit, a)
            if b == a and not full:
                policy(where, _too_long(unit.cuts_s, a, spec.seq_len))
                packer.break_document()
                dropped = row_key
                break
            a = b
            if full:
                rows.append(packer.close())
                if len(rows) == spec.batch_size:
                    yield (
                        collate(rows, *args),
                        WorkerState(cursor, a, policy.num_skipped),
                    )
                    rows = []
    if packer.row:
        rows.append(packer.close())
    if rows:
        yield (
            collate(rows, *args),
            WorkerState(Cursor(-1), 0, policy.num_skipped),
        )


def empty_batch(sides: list[TokenizerSide], spec: StreamSpec) -> Batch:
    """A batch of padding rows only: it adds nothing to any sum (see `HeldOut`)."""
    return collate(
        [], spec.batch_size, spec.seq_len, spec.pad_multiple, sides, list(spec.slots), spec.caches
    )


def _head_size(sides: list[TokenizerSide]) -> int:
    """Start tokens the student side puts in front of a row that continues a document; none
    unless every side has some (the two sides' start tokens form a chunk of their own)."""
    return sides[0].start_ids.size if all(s.start_ids.size for s in sides) else 0


def _units(
    plan: Plan,
    consumer: int,
    sides: list[TokenizerSide],
    spec: StreamSpec,
    start: WorkerState,
    repeat: bool,
    policy: BadInputPolicy,
    packer: RowPacker,
) -> Iterator[tuple[Cursor, Unit, str]]:
    """`(cursor, unit, where)` for every piece of every good document from `start` on; bad
    rows go to `policy` (and break document continuity in `packer`)."""
    row_start = Cursor(start.cursor.epoch, start.cursor.block, start.cursor.row, 0)
    units_in_epoch: dict[int, int] = {}
    for where_row, value, where in plan.stream(consumer, row_start, repeat):
        _check_progress(units_in_epoch, where_row.epoch, start.cursor.epoch, consumer)
        doc = check_document(value, spec.kind, spec.field)
        if isinstance(doc, Bad):
            policy(where, doc.reason)
            packer.break_document()
            continue
        key = _cache_key(doc, spec.caches)
        if isinstance(key, Bad):
            policy(where, key.reason)
            packer.break_document()
            continue
        pieces = text_pieces(doc, spec.piece_chars) if isinstance(doc, str) else [doc]
        p0 = start.cursor.piece if where_row == row_start else 0
        offsets = [0] * len(sides)  # tokens of the document's earlier pieces, per side
        for pi in range(len(pieces)):
            if pi < p0 and not key:
                continue
            if isinstance(doc, str):
                unit = text_unit(pieces[pi], sides, first=pi == 0, last=pi == len(pieces) - 1)
            else:
                unit = chat_unit(doc, sides, spec.loss_on)
            if isinstance(unit, Bad):
                policy(where, unit.reason)
                packer.break_document()
                break
            if key:
                unit.key, unit.offsets = key, tuple(offsets)
                sizes = [unit.ids_s.size] + [t.ids.size for t in unit.teachers]
                offsets = [o + n for o, n in zip(offsets, sizes)]
            if pi < p0:  # packed before the resume point; counted for its offsets only
                continue
            units_in_epoch[where_row.epoch] = units_in_epoch.get(where_row.epoch, 0) + 1
            yield Cursor(where_row.epoch, where_row.block, where_row.row, pi), unit, where


def _cache_key(doc, caches: tuple[CachedTeacher | None, ...]) -> str | Bad:
    """The document's cache key when a teacher reads from a cache ("" when none does); `Bad`
    when a cache lacks the document."""
    readers = [c for c in caches if c is not None]
    if not readers:
        return ""
    key = document_key(doc)
    for c in readers:
        if key not in c.reader:
            return Bad(
                f"not in teacher {c.name}'s cache {c.reader.folder} (built over other data); "
                "rebuild the cache over this corpus, or set data.bad_input=skip to leave out the "
                "documents it lacks"
            )
    return key


def _check_progress(units: dict[int, int], epoch: int, start_epoch: int, consumer: int) -> None:
    # A full epoch (not the one a resume started in) that gave no usable unit would make an
    # endless stream spin forever on bad or missing data.
    prev = epoch - 1
    if prev > start_epoch and units.get(prev, 0) == 0:
        raise EmptyStream(consumer)


def _too_long(cuts: np.ndarray, a: int, seq_len: int) -> str:
    gap = int(cuts[a + 1] - cuts[a])
    return (
        f"{gap} student tokens with no token boundary shared by all tokenizers (more than "
        f"seq_len={seq_len}); the rest of this document was dropped"
    )

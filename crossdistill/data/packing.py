"""Packing units into rows of `seq_len` student tokens, cutting only at common cut points.

Rows are filled in stream order. A unit that does not fit the space left in a row is cut at
its last common cut point that fits, and the rest starts the next row (a document longer than
many rows is spread over as many rows as it needs; nothing is dropped). Chat documents that
fit a whole row are not cut: they start a new row instead, so a reply keeps its prompt. After
the last fitting cut point a row is padded: cut points are token ends of every tokenizer at
once, so a few student positions at the end of a row may stay empty.

Because rows are filled strictly in order, the packer's whole state at a batch boundary is
"the unit being packed and the cut point reached in it": that is what a checkpoint stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crossdistill.data.batch import (
    IGNORE,
    Batch,
    StudentBatch,
    TeacherBatch,
    identity_chunks,
    pack_tensors,
    real_segments,
    segments_from_docs,
    shifted_labels,
)
from crossdistill.data.units import Unit


@dataclass
class Segment:
    """Cut points `[a, b)` (indices into `unit.cuts_s`) of one unit placed in a row;
    `cont` says it continues the previous segment's document in the same row."""

    unit: Unit
    a: int
    b: int
    cont: bool


class RowPacker:
    """Fills rows of at most `seq_len` student tokens with unit segments."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.row: list[Segment] = []
        self.fill = 0
        self.open_doc = False  # the row's last segment ended at its unit's end, mid-document

    def place(self, unit: Unit, a: int) -> tuple[int, bool]:
        """Put as much of `unit` from cut point `a` into the current row as fits. Returns
        `(b, row_full)`: the cut point reached and whether the row must be closed now.
        `b == a` with an empty row means the next cut point is more than `seq_len` away."""
        cuts = unit.cuts_s
        room = self.seq_len - self.fill
        n_left = int(cuts[-1] - cuts[a])
        if unit.chat and a == 0 and self.fill and room < n_left <= self.seq_len:
            return a, True  # keep a conversation whole
        b = int(np.searchsorted(cuts, cuts[a] + room, side="right")) - 1
        if b <= a:
            return a, bool(self.fill)
        cont = bool(self.row) and a == 0 and not unit.first and self.open_doc
        self.row.append(Segment(unit, a, b, cont))
        self.fill += int(cuts[b] - cuts[a])
        self.open_doc = b == cuts.size - 1 and not unit.last
        return b, b < cuts.size - 1 or self.fill >= self.seq_len

    def close(self) -> list[Segment]:
        row, self.row, self.fill, self.open_doc = self.row, [], 0, False
        return row

    def break_document(self) -> None:
        """The next unit does not continue the last one (a piece was dropped)."""
        self.open_doc = False


def collate(
    rows: list[list[Segment]],
    batch_size: int,
    seq_len: int,
    pad_multiple: int,
    lengths_s: np.ndarray,
    pad_s: int,
    slots: list[int],
    pads_t: list[int],
) -> Batch:
    """Rows (at most `batch_size`; missing rows are all padding) -> `Batch`. `slots[i]` is the
    index of teacher `i` among the units' cross-tokenizer teachers, -1 for the student's own
    tokenizer; `pads_t[k]` the pad id of cross teacher `k`."""
    ids, target, doc, pos = _fill(
        [[(s.unit.ids_s, s.unit.target_s, s.unit.cuts_s, s) for s in r] for r in rows],
        batch_size,
        seq_len,
        pad_s,
    )
    labels = shifted_labels(ids, target, doc)
    target_bytes = np.where(labels >= 0, lengths_s[np.maximum(labels, 0)], 0).astype(np.int64)
    student = [ids, labels, pos, doc, target_bytes]
    teachers: dict[int, list[np.ndarray]] = {}
    for k in dict.fromkeys(slots):
        if k < 0:
            teachers[k] = [*identity_chunks(doc, labels)]
        else:
            teachers[k] = _cross_teacher(rows, k, batch_size, seq_len, pad_multiple, pads_t[k])
            teachers[k][-1] &= _has_kd_position(teachers[k][-2], doc, labels, teachers[k][3])
    # one buffer for the whole batch (see `pack_tensors`)
    # attention segments (documents) of each side, for varlen attention
    segs = {-1: segments_from_docs(doc)}
    for k, arrays in teachers.items():
        segs.setdefault(k, segments_from_docs(arrays[3]) if k >= 0 else segs[-1])
    cross = [k for k in teachers if k >= 0]
    real = {k: real_segments(teachers[k][3], segs[k][0]) for k in cross}
    arrays_all = student + [segs[-1][0]]
    arrays_all += [a for arrays in teachers.values() for a in arrays] + [segs[k][0] for k in cross]
    arrays_all += [a for k in cross for a in real[k][:2]]
    tensors = iter(pack_tensors(arrays_all))
    s_t = [next(tensors) for _ in student]
    cu_s = next(tensors)
    student_batch = StudentBatch(
        *s_t,
        num_target_tokens=int((labels != IGNORE).sum()),
        num_target_bytes=int(target_bytes.sum()),
        cu_seqlens=cu_s,
        max_seqlen=segs[-1][1],
    )
    built = {}
    for k, arrays in teachers.items():
        t = [next(tensors) for _ in arrays]
        kd = arrays[-1]
        if k < 0:
            built[k] = TeacherBatch(
                *s_t[:4], t[0], t[1], int(kd.sum()), same_as_student=True, cu_seqlens=cu_s,
                max_seqlen=segs[-1][1],
            )  # fmt: skip
        else:
            built[k] = TeacherBatch(*t, num_kd=int(kd.sum()), same_as_student=False)
    for k in cross:
        built[k].cu_seqlens, built[k].max_seqlen = next(tensors), segs[k][1]
    for k in cross:
        built[k].real_index, built[k].real_cu_seqlens = next(tensors), next(tensors)
        built[k].real_max_seqlen = real[k][2]
    return Batch(student=student_batch, teachers=[built[k] for k in slots])


def _fill(rows: list[list[tuple]], batch_size: int, width: int, pad: int) -> tuple[np.ndarray, ...]:
    """[B, width] ids, target, doc ids and positions from per-row lists of
    `(ids, target, cuts, segment)`."""
    ids = np.full((batch_size, width), pad, dtype=np.int64)
    target = np.zeros((batch_size, width), dtype=bool)
    doc = np.full((batch_size, width), -1, dtype=np.int64)
    pos = np.zeros((batch_size, width), dtype=np.int64)
    for r, row in enumerate(rows):
        off, d = 0, -1
        for u_ids, u_target, cuts, seg in row:
            lo, hi = int(cuts[seg.a]), int(cuts[seg.b])
            n = hi - lo
            p0 = int(pos[r, off - 1]) + 1 if seg.cont else 0
            d += 0 if seg.cont else 1
            ids[r, off : off + n] = u_ids[lo:hi]
            target[r, off : off + n] = u_target[lo:hi]
            doc[r, off : off + n] = d
            pos[r, off : off + n] = np.arange(p0, p0 + n)
            off += n
    return ids, target, doc, pos


def _cross_teacher(
    rows: list[list[Segment]],
    k: int,
    batch_size: int,
    seq_len: int,
    pad_multiple: int,
    pad_t: int,
) -> list[np.ndarray]:
    """Cross teacher `k`: `[ids, labels, positions, doc ids]` `[B, T_t]`, chunks `[C, 4]`
    flattened over the batch, and the chunks' content flags `[C]`."""
    views = [[(s.unit.teachers[k], s) for s in r] for r in rows]
    row_len = [sum(int(u.cuts[s.b] - u.cuts[s.a]) for u, s in r) for r in views]
    width = max(pad_multiple, -(-max(row_len, default=1) // pad_multiple) * pad_multiple)
    ids, target, doc, pos = _fill(
        [[(u.ids, u.target, u.cuts, s) for u, s in r] for r in views], batch_size, width, pad_t
    )
    chunks, kd = [], []
    for r, row in enumerate(views):
        off_s = off_t = 0
        for u, s in row:
            lo_s, hi_s = int(s.unit.cuts_s[s.a]), int(s.unit.cuts_s[s.b])
            lo_t, hi_t = int(u.cuts[s.a]), int(u.cuts[s.b])
            c0, c1 = np.searchsorted(u.chunks[:, 0], [lo_s, hi_s], side="left")
            shift = [r * seq_len + off_s - lo_s] * 2 + [r * width + off_t - lo_t] * 2
            chunks.append(u.chunks[c0:c1] + np.asarray(shift, dtype=np.int64))
            kd.append(u.kd[c0:c1])
            off_s, off_t = off_s + hi_s - lo_s, off_t + hi_t - lo_t
    chunks_np = np.concatenate(chunks) if chunks else np.zeros((0, 4), dtype=np.int64)
    kd_np = np.concatenate(kd) if kd else np.zeros(0, dtype=bool)
    return [ids, shifted_labels(ids, target, doc), pos, doc, chunks_np, kd_np]


def _has_kd_position(chunks: np.ndarray, doc_s: np.ndarray, labels_s: np.ndarray, doc_t):
    """[C] bool: positions `s0 - 1` and `t0 - 1` exist in the same document as the chunk, and
    the student's target there (token `s0`) is in the loss."""
    s0, t0 = chunks[:, 0], chunks[:, 2]
    seq_len, width = doc_s.shape[1], doc_t.shape[1]
    flat_s, flat_t, flat_labels = doc_s.reshape(-1), doc_t.reshape(-1), labels_s.reshape(-1)
    ps, pt = np.maximum(s0 - 1, 0), np.maximum(t0 - 1, 0)
    return (
        (s0 % seq_len != 0)
        & (t0 % width != 0)
        & (flat_s[ps] == flat_s[s0])
        & (flat_t[pt] == flat_t[t0])
        & (flat_labels[ps] != IGNORE)
    )

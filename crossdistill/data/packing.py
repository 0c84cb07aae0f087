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
import torch

from crossdistill.data.batch import (
    IGNORE,
    Batch,
    CachedTargets,
    StudentBatch,
    TeacherBatch,
    identity_chunks,
    pack_tensors,
    real_segments,
    segments_from_docs,
    shifted_labels,
)
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.teacher_cache import CachedTeacher, concat_docs, truncate_top_k
from crossdistill.data.units import Unit
from crossdistill.errors import UserError
from crossdistill.losses.targets import target_rows


@dataclass
class Segment:
    """Cut points `[a, b)` (indices into `unit.cuts_s`) of one unit placed in a row;
    `cont` says it continues the previous segment's document in the same row; `head` that it
    starts in the middle of a document with nothing of it before in the row, so each side's
    start tokens (`TokenizerSide.start_ids`) go in front of it: its first token is then
    predicted on every side, as a document's first token is."""

    unit: Unit
    a: int
    b: int
    cont: bool
    head: bool = False


class RowPacker:
    """Fills rows of at most `seq_len` student tokens with unit segments; `head_s`: the
    student's start tokens, which a segment with `head` takes in front."""

    def __init__(self, seq_len: int, head_s: int = 0):
        self.seq_len = seq_len
        self.head_s = head_s
        self.row: list[Segment] = []
        self.fill = 0
        self.open_doc = False  # the row's last segment ended at its unit's end, mid-document

    def place(self, unit: Unit, a: int) -> tuple[int, bool]:
        """Put as much of `unit` from cut point `a` into the current row as fits. Returns
        `(b, row_full)`: the cut point reached and whether the row must be closed now.
        `b == a` with an empty row means the next cut point is more than `seq_len` away."""
        cuts = unit.cuts_s
        cont = bool(self.row) and a == 0 and not unit.first and self.open_doc
        head = not cont and (a > 0 or not unit.first) and self.head_s > 0
        room = self.seq_len - self.fill - (self.head_s if head else 0)
        n_left = int(cuts[-1] - cuts[a])
        if unit.chat and a == 0 and self.fill and room < n_left <= self.seq_len:
            return a, True  # keep a conversation whole
        b = int(np.searchsorted(cuts, cuts[a] + room, side="right")) - 1
        if b <= a:
            return a, bool(self.fill)
        self.row.append(Segment(unit, a, b, cont, head))
        self.fill += int(cuts[b] - cuts[a]) + (self.head_s if head else 0)
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
    sides: list[TokenizerSide],
    slots: list[int],
    caches: tuple[CachedTeacher | None, ...] = (),
) -> Batch:
    """Rows (at most `batch_size`; missing rows are all padding) -> `Batch`. `sides`: the
    student's then each cross teacher's `TokenizerSide` (pad and start ids); `slots[i]` is the
    index of teacher `i` among the cross teachers, -1 for the student's own tokenizer;
    `caches[i]`: where teacher `i` reads its targets from a cache (`Batch.cached`)."""
    head_s = sides[0].start_ids
    ids, target, doc, pos, text_bytes = _fill(
        [[(s.unit.ids_s, s.unit.target_s, s.unit.text_bytes_s, s.unit.cuts_s, s) for s in r]
         for r in rows],
        batch_size, seq_len, sides[0].pad_id, head_s,
    )  # fmt: skip
    labels = shifted_labels(ids, target, doc)
    target_bytes = _target_bytes(text_bytes, labels)
    student = [ids, labels, pos, doc, target_bytes]
    teachers: dict[int, list[np.ndarray]] = {}
    for k in dict.fromkeys(slots):
        if k < 0:
            teachers[k] = [*identity_chunks(doc, labels)]
        else:
            teachers[k] = _cross_teacher(
                rows, k, batch_size, seq_len, pad_multiple, sides[1 + k], len(head_s)
            )
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
    cached = [
        None if c is None else _cached(rows, c, slots[i], teachers, labels, sides, len(head_s))
        for i, c in enumerate(caches)
    ]
    arrays_all += [a for c in cached if c is not None for a in c]
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
                max_seqlen=segs[-1][1], target_bytes=s_t[4],
            )  # fmt: skip
        else:
            built[k] = TeacherBatch(
                *t[:4], *t[5:7], num_kd=int(kd.sum()), same_as_student=False, target_bytes=t[4]
            )
    for k in cross:
        built[k].cu_seqlens, built[k].max_seqlen = next(tensors), segs[k][1]
    for k in cross:
        built[k].real_index, built[k].real_cu_seqlens = next(tensors), next(tensors)
        built[k].real_max_seqlen = real[k][2]
    targets = [
        None if c is None else CachedTargets(*(next(tensors) for _ in c), caches[i].temperature)
        for i, c in enumerate(cached)
    ]
    return Batch(student=student_batch, teachers=[built[k] for k in slots], cached=targets)


def _cached(
    rows: list[list[Segment]],
    cache: CachedTeacher,
    slot: int,
    teachers: dict[int, list[np.ndarray]],
    labels_s: np.ndarray,
    sides: list[TokenizerSide],
    head_s: int,
) -> list[np.ndarray]:
    """A cached teacher's targets for the batch, as `CachedTargets` arrays: each position's
    next-token log-prob and each chunk's top-k rows (at its KD position, and for a lookahead
    target at the rows after it, as `losses.target_rows` lays them out for a live teacher),
    read from the rows of the documents' cached targets that predict the same token."""
    if slot < 0:
        labels, (chunks, _), head = labels_s, teachers[-1], head_s
    else:
        labels, chunks = teachers[slot][1], teachers[slot][5]
        head = sides[1 + slot].start_ids.size
    src_doc = np.full(labels.shape, -1, dtype=np.int64)
    src_pos = np.full(labels.shape, -1, dtype=np.int64)
    keys: dict[str, int] = {}
    for r, row in enumerate(rows):
        off = 0
        for seg in row:
            unit = seg.unit
            cuts = unit.cuts_s if slot < 0 else unit.teachers[slot].cuts
            lo, hi = int(cuts[seg.a]), int(cuts[seg.b])
            d = keys.setdefault(unit.key, len(keys))
            first = unit.offsets[slot + 1] + lo  # the segment's first token in its document
            if seg.head and head:  # the last start token predicts the segment's first token
                src_doc[r, off + head - 1], src_pos[r, off + head - 1] = d, first - 1
                off += head
            src_doc[r, off : off + hi - lo] = d
            src_pos[r, off : off + hi - lo] = np.arange(first, first + hi - lo)
            off += hi - lo
    docs, starts = concat_docs([cache.reader.get(key) for key in keys])
    base = starts[src_doc.clip(min=0)] if starts.size else np.zeros_like(src_doc)
    src = np.where(src_doc >= 0, base + src_pos, -1).reshape(-1)
    flat_labels = labels.reshape(-1)
    valid = flat_labels >= 0
    rows_valid = src[valid]
    following = docs.ids[np.clip(rows_valid + 1, 0, max(docs.num_tokens - 1, 0))]
    if (rows_valid < 0).any() or not np.array_equal(following, flat_labels[valid]):
        raise UserError(
            f"teacher {cache.name}'s cache {cache.reader.folder} holds another tokenization of "
            "these documents (its tokenizer or data settings differ from this run's); rebuild it "
            "with this run's data section"
        )
    next_lp = np.zeros(flat_labels.shape, dtype=np.float32)
    next_lp[valid] = docs.next_logprobs[rows_valid]
    depth, past_end = (cache.depth, cache.past_end) if slot >= 0 else (1, False)
    at = target_rows(torch.from_numpy(chunks.reshape(-1, 4)), depth, past_end).numpy()
    kd = np.where(at >= 0, src[at.clip(min=0)], -1)
    k = cache.top_k
    if docs.topk_ids is None:
        top_ids = np.zeros((0, k), np.int32)
        top_lp = np.zeros((0, k), np.float32)
        tail = np.zeros(0, np.float32)
    else:
        pick = kd.clip(min=0)
        top_ids, top_lp, tail = truncate_top_k(
            docs.topk_ids[pick], docs.topk_logprobs[pick], docs.tail_logprob[pick], k
        )
    if (kd < 0).any():  # rows the loss masks out: any valid distribution (as a live teacher's)
        even = np.float32(-np.log(k + 1))
        top_ids[kd < 0], top_lp[kd < 0], tail[kd < 0] = np.arange(k, dtype=np.int32), even, even
    return [
        np.ascontiguousarray(top_ids, dtype=np.int32),
        np.ascontiguousarray(top_lp, dtype=np.float32),
        np.ascontiguousarray(tail, dtype=np.float32),
        next_lp,
        valid,
    ]


def _target_bytes(text_bytes: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """[B, T] bytes of the text the label at each position covers (0 where there is none)."""
    following = np.zeros_like(text_bytes)
    following[:, :-1] = text_bytes[:, 1:]
    return np.where(labels >= 0, following, 0).astype(np.int64)


def _fill(
    rows: list[list[tuple]], batch_size: int, width: int, pad: int, head: np.ndarray
) -> tuple[np.ndarray, ...]:
    """[B, width] ids, target, doc ids, positions and text bytes from per-row lists of
    `(ids, target, text_bytes, cuts, segment)`; a segment with `head` gets `head` in front."""
    ids = np.full((batch_size, width), pad, dtype=np.int64)
    target = np.zeros((batch_size, width), dtype=bool)
    doc = np.full((batch_size, width), -1, dtype=np.int64)
    pos = np.zeros((batch_size, width), dtype=np.int64)
    text_bytes = np.zeros((batch_size, width), dtype=np.int64)
    for r, row in enumerate(rows):
        off, d = 0, -1
        for u_ids, u_target, u_bytes, cuts, seg in row:
            lo, hi = int(cuts[seg.a]), int(cuts[seg.b])
            p0 = int(pos[r, off - 1]) + 1 if seg.cont else 0
            d += 0 if seg.cont else 1
            if seg.head and head.size:  # start tokens: no target, no text
                h = head.size
                ids[r, off : off + h], doc[r, off : off + h] = head, d
                pos[r, off : off + h] = np.arange(p0, p0 + h)
                off, p0 = off + h, p0 + h
            n = hi - lo
            ids[r, off : off + n] = u_ids[lo:hi]
            target[r, off : off + n] = u_target[lo:hi]
            text_bytes[r, off : off + n] = u_bytes[lo:hi]
            doc[r, off : off + n] = d
            pos[r, off : off + n] = np.arange(p0, p0 + n)
            off += n
    return ids, target, doc, pos, text_bytes


def _cross_teacher(
    rows: list[list[Segment]],
    k: int,
    batch_size: int,
    seq_len: int,
    pad_multiple: int,
    side: TokenizerSide,
    head_s: int,
) -> list[np.ndarray]:
    """Cross teacher `k`: `[ids, labels, positions, doc ids, target bytes]` `[B, T_t]`, chunks
    `[C, 4]` flattened over the batch, and the chunks' content flags `[C]`. A segment's start
    tokens (`head`) pair with the student's as one chunk of their own, never a KD position."""
    head_t = side.start_ids
    views = [[(s.unit.teachers[k], s) for s in r] for r in rows]
    row_len = [
        sum(int(u.cuts[s.b] - u.cuts[s.a]) + head_t.size * s.head for u, s in r) for r in views
    ]
    width = max(pad_multiple, -(-max(row_len, default=1) // pad_multiple) * pad_multiple)
    ids, target, doc, pos, text_bytes = _fill(
        [[(u.ids, u.target, u.text_bytes, u.cuts, s) for u, s in r] for r in views],
        batch_size, width, side.pad_id, head_t,
    )  # fmt: skip
    chunks, kd = [], []
    for r, row in enumerate(views):
        off_s = off_t = 0
        for u, s in row:
            if s.head:
                at_s, at_t = r * seq_len + off_s, r * width + off_t
                chunks.append(np.asarray([[at_s, at_s + head_s, at_t, at_t + head_t.size]]))
                kd.append(np.zeros(1, dtype=bool))
                off_s, off_t = off_s + head_s, off_t + head_t.size
            lo_s, hi_s = int(s.unit.cuts_s[s.a]), int(s.unit.cuts_s[s.b])
            lo_t, hi_t = int(u.cuts[s.a]), int(u.cuts[s.b])
            c0, c1 = np.searchsorted(u.chunks[:, 0], [lo_s, hi_s], side="left")
            shift = [r * seq_len + off_s - lo_s] * 2 + [r * width + off_t - lo_t] * 2
            chunks.append(u.chunks[c0:c1] + np.asarray(shift, dtype=np.int64))
            kd.append(u.kd[c0:c1])
            off_s, off_t = off_s + hi_s - lo_s, off_t + hi_t - lo_t
    chunks_np = np.concatenate(chunks).astype(np.int64) if chunks else np.zeros((0, 4), np.int64)
    kd_np = np.concatenate(kd) if kd else np.zeros(0, dtype=bool)
    labels = shifted_labels(ids, target, doc)
    return [ids, labels, pos, doc, _target_bytes(text_bytes, labels), chunks_np, kd_np]


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

"""Alignment when the two decoded byte strings differ.

Token ends are mapped from student to teacher offsets through the matching blocks of a byte
diff; an end that lands on a teacher end is a common boundary. Stretches between two such
boundaries that hold unmatched bytes on both sides (a replacement, such as NFD text against a
tokenizer that normalises to NFC) go to the dynamic-programming fallback, which looks for
boundaries where the texts agree up to NFKC and whitespace; its positions are counted.

A special-token string in the text is read as one zero-byte token by one tokenizer and as text
by the other. So that it lines up with that text, the diff runs on "surface" bytes: the bytes
each side covers with the names of its special tokens spliced in where they stand (those
before the first or after the last text byte, such as BOS and EOS, are left out). Chunks that
hold such a name are never exact.
"""

from __future__ import annotations

import numpy as np

from crossdistill.alignment.chunks import Alignment, Side, chunks_from_cuts, monotone_boundaries
from crossdistill.alignment.diff import matching_blocks
from crossdistill.alignment.dp import canonical_text, refine_boundaries

# Stretches larger than this (interior student cuts x teacher cuts) stay one chunk rather than
# going to the quadratic DP.
MAX_DP_CELLS = 1 << 20
# Matching blocks one unexplained gap may swallow before it counts as a real difference.
_MAX_ABSORBED = 32


def align_different_bytes(side_s: Side, side_t: Side, stream_s, stream_t) -> Alignment:
    """stream_s: [N_s] uint8, stream_t: [N_t] uint8, the bytes each side covers."""
    side_s, stream_s, named_s = _surface(side_s, stream_s)
    side_t, stream_t, named_t = _surface(side_t, stream_t)
    blocks = _agreeing_blocks(matching_blocks(stream_s, stream_t), stream_s, stream_t)
    ends_s, ends_t = side_s.positive_ends(), side_t.positive_ends()
    cand_s, cand_t = _block_candidates(blocks, ends_s, ends_t)
    bounds_s, bounds_t = monotone_boundaries(cand_s, cand_t, side_s.total, side_t.total)
    matched_s = _covered(blocks[:, 0], blocks[:, 2], side_s.total)
    matched_t = _covered(blocks[:, 1], blocks[:, 2], side_t.total)
    found_s, found_t, num_fallback = _refine(
        ends_s, ends_t, stream_s, stream_t, bounds_s, bounds_t, matched_s, matched_t
    )
    if found_s:
        bounds_s = np.concatenate((bounds_s, found_s))
        bounds_t = np.concatenate((bounds_t, found_t))
        order = np.argsort(bounds_s, kind="stable")
        bounds_s, bounds_t = bounds_s[order], bounds_t[order]
    cut_s = np.searchsorted(side_s.starts, bounds_s, side="left")
    cut_t = np.searchsorted(side_t.starts, bounds_t, side="left")
    chunks = chunks_from_cuts(side_s, side_t, cut_s, cut_t, bounds_s, bounds_t)
    # Exact: every byte matched on both sides, and no special-token name in it.
    spans_s, spans_t = chunks[:, :2], chunks[:, 2:]
    unnamed = _clean(spans_s, side_s, ~named_s) & _clean(spans_t, side_t, ~named_t)
    exact = unnamed & _clean(spans_s, side_s, matched_s) & _clean(spans_t, side_t, matched_t)
    if found_s:
        exact = _recheck(chunks, exact, unnamed, side_s, side_t, stream_s, stream_t, set(found_s))
    return Alignment(chunks, exact, num_fallback=num_fallback)


def _surface(side: Side, stream: np.ndarray):
    """The side with the names of its interior special tokens spliced into its bytes.

    Returns a `Side` whose lengths count those names, its surface bytes [N'] uint8, and [N']
    bool marking the bytes that came from names.
    """
    lens = side.lens
    positive = np.flatnonzero(lens)
    index = np.arange(side.size)
    interior = (lens == 0) & side.table.special[side.ids]
    interior &= (index > positive[0]) & (index < positive[-1])
    named = np.zeros(stream.shape[0], dtype=bool)
    if not interior.any():
        return side, stream, named
    lens = lens.astype(np.int64)
    parts, marks, last = [], [], 0
    for i in np.flatnonzero(interior).tolist():
        at = int(side.ends[i])
        name = np.frombuffer(side.table.special_text[int(side.ids[i])].encode(), dtype=np.uint8)
        parts += [stream[last:at], name]
        marks += [named[last:at], np.ones(name.shape[0], dtype=bool)]
        lens[i] = name.shape[0]
        last = at
    parts.append(stream[last:])
    marks.append(named[last:])
    ends = np.cumsum(lens)
    num_zero = side.size - int(np.count_nonzero(lens))
    surface = Side(side.ids, lens, ends, side.table, num_zero)
    return surface, np.concatenate(parts), np.concatenate(marks)


def _agreeing_blocks(blocks: np.ndarray, stream_s, stream_t) -> np.ndarray:
    """Keep a matching block only where the unmatched text before it (since the last kept
    block) agrees up to normalisation on both sides; otherwise its bytes join that gap.

    Byte matches alone can pair equal bytes at different places of the text (combining marks
    that NFC reorders, repeated words); the chunk after such a block would start after
    different text on the two sides. A gap that does not close within `_MAX_ABSORBED` blocks
    is a real difference, and the blocks are kept as they were.
    """
    kept: list[tuple[int, int, int]] = []
    pending: list[tuple[int, int, int]] = []
    gap_s = gap_t = 0
    for block in _whole_characters(blocks, stream_s, stream_t):
        i, j, n = block
        if len(pending) < _MAX_ABSORBED and not _agree(stream_s[gap_s:i], stream_t[gap_t:j]):
            pending.append(block)
            continue
        kept.extend(pending if len(pending) >= _MAX_ABSORBED else [])
        kept.append(block)
        pending = []
        gap_s, gap_t = i + n, j + n
    kept.extend(pending if not _agree(stream_s[gap_s:], stream_t[gap_t:]) else [])
    return np.asarray(kept, dtype=np.int64).reshape(-1, 3)


def _whole_characters(blocks: np.ndarray, stream_s, stream_t) -> list[tuple[int, int, int]]:
    """Blocks trimmed so that none starts or ends inside a UTF-8 character on either side."""
    inner_s = (stream_s & 0xC0) == 0x80  # continuation bytes
    inner_t = (stream_t & 0xC0) == 0x80
    end_s, end_t = stream_s.shape[0], stream_t.shape[0]
    out = []
    for i, j, n in blocks.tolist():
        while n and inner_s[i]:
            i, j, n = i + 1, j + 1, n - 1
        while n and ((i + n < end_s and inner_s[i + n]) or (j + n < end_t and inner_t[j + n])):
            n -= 1
        if n:
            out.append((i, j, n))
    return out


def _agree(gap_s: np.ndarray, gap_t: np.ndarray) -> bool:
    if gap_s.shape[0] == 0 and gap_t.shape[0] == 0:
        return True
    text_s = gap_s.tobytes().decode("utf-8", "surrogateescape")
    text_t = gap_t.tobytes().decode("utf-8", "surrogateescape")
    return canonical_text(text_s) == canonical_text(text_t)


def _block_candidates(blocks: np.ndarray, ends_s: np.ndarray, ends_t: np.ndarray):
    """Student ends lying on a matching block whose mapped teacher offset is a teacher end.
    At the edge between two blocks the earlier block wins (the smaller teacher offset)."""
    if blocks.shape[0] == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    bi, bj, bn = blocks[:, 0], blocks[:, 1], blocks[:, 2]
    k = np.searchsorted(bi + bn, ends_s, side="left")  # earliest block ending at or after e
    inside = k < bi.shape[0]
    k = np.minimum(k, bi.shape[0] - 1)
    inside &= bi[k] <= ends_s
    mapped = ends_s - bi[k] + bj[k]
    j = np.minimum(np.searchsorted(ends_t, mapped), ends_t.shape[0] - 1)
    hit = inside & (ends_t[j] == mapped)
    return ends_s[hit], mapped[hit]


def _covered(starts: np.ndarray, sizes: np.ndarray, total: int) -> np.ndarray:
    """[total] bool: bytes that a matching block covers."""
    delta = np.zeros(total + 1, dtype=np.int64)
    np.add.at(delta, starts, 1)
    np.add.at(delta, starts + sizes, -1)
    return np.cumsum(delta[:-1]) > 0


def _clean(spans: np.ndarray, side: Side, good: np.ndarray) -> np.ndarray:
    """[C] bool: for token spans [C, 2] of one side, whether all their bytes are `good`."""
    bad_before = np.zeros(good.shape[0] + 1, dtype=np.int64)
    np.cumsum(~good, out=bad_before[1:])
    start = side.starts[spans[:, 0]]
    end = side.ends[spans[:, 1] - 1]
    return bad_before[end] == bad_before[start]


def _refine(ends_s, ends_t, stream_s, stream_t, bounds_s, bounds_t, matched_s, matched_t):
    """DP fallback inside stretches with unmatched bytes on both sides and interior token
    ends on both sides. Returns the boundaries it found per side and the positions it used."""
    found_s: list[int] = []
    found_t: list[int] = []
    num_fallback = 0
    starts_s = np.concatenate(([0], bounds_s[:-1]))
    starts_t = np.concatenate(([0], bounds_t[:-1]))
    unmatched_s = np.concatenate(([0], np.cumsum(~matched_s)))
    unmatched_t = np.concatenate(([0], np.cumsum(~matched_t)))
    replaced = (unmatched_s[bounds_s] > unmatched_s[starts_s]) & (
        unmatched_t[bounds_t] > unmatched_t[starts_t]
    )
    for c in np.flatnonzero(replaced).tolist():
        x_s, y_s = int(starts_s[c]), int(bounds_s[c])
        x_t, y_t = int(starts_t[c]), int(bounds_t[c])
        cuts_s = ends_s[(ends_s > x_s) & (ends_s < y_s)] - x_s
        cuts_t = ends_t[(ends_t > x_t) & (ends_t < y_t)] - x_t
        if cuts_s.shape[0] == 0 or cuts_t.shape[0] == 0:
            continue  # one token on a side: the stretch cannot be split
        if cuts_s.shape[0] * cuts_t.shape[0] > MAX_DP_CELLS:
            continue
        num_fallback += cuts_s.shape[0] + cuts_t.shape[0] + 2
        pairs = refine_boundaries(
            stream_s[x_s:y_s].tobytes(),
            cuts_s.tolist(),
            stream_t[x_t:y_t].tobytes(),
            cuts_t.tolist(),
        )
        found_s.extend(x_s + a for a, _ in pairs)
        found_t.extend(x_t + b for _, b in pairs)
    return found_s, found_t, num_fallback


def _recheck(chunks, exact, unnamed, side_s: Side, side_t: Side, stream_s, stream_t, found):
    """Chunks bounded by a boundary the DP found are exact only if their bytes are equal."""
    starts_s, ends_s = side_s.starts, side_s.ends
    starts_t, ends_t = side_t.starts, side_t.ends
    for c, (s0, s1, t0, t1) in enumerate(chunks.tolist()):
        x_s, y_s = int(starts_s[s0]), int(ends_s[s1 - 1])
        if x_s in found or y_s in found:
            x_t, y_t = int(starts_t[t0]), int(ends_t[t1 - 1])
            exact[c] = unnamed[c] and np.array_equal(stream_s[x_s:y_s], stream_t[x_t:y_t])
    return exact

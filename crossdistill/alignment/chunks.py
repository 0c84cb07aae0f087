"""Chunk alignment of two tokenizations of one text.

Each side's token byte lengths give cumulative end offsets; an offset that is an end on both
sides is a common boundary, and the tokens between two consecutive common boundaries form a
chunk: student tokens `[s0, s1)` and teacher tokens `[t0, t1)` covering the same bytes. When
the two decoded byte strings are identical this is a merge of two sorted arrays, O(n + m)
(`pair.py`, which also tells that they are identical without building them: chunks of one
token per side compare canonical token ids, only the other chunks compare bytes). When they
differ (normalisation, stripped whitespace, a literal special-token string read as text by
one side only), offsets are mapped through a byte-level diff first (`diff.py`) and the
dynamic-programming aligner (`dp.py`) is used only inside stretches whose bytes differ on both
sides; the token positions it handled are counted in `Alignment.num_fallback`.

Conventions, so that every token index on both sides lies in exactly one chunk:
- SentencePiece's dummy prefix: the space a tokenizer with `prefix_space` puts before the text
  is dropped from its first text-bearing token before anything is compared.
- Zero-byte tokens (BOS, EOS, chat markers, specials) sitting at the same common boundary on
  both sides pair up 1:1, in order, as chunks of their own (so identical tokenizers give one
  chunk per token). Unpaired ones join the following chunk; at the end of the text they join
  the last chunk (and there the pairs are taken from the end).
- A text that covers no byte on either side (empty text, only BOS) has zero chunks; when one
  side covers bytes and the other none, the whole sequence is one inexact chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crossdistill.alignment.dp import lcs_pairs
from crossdistill.alignment.pair import arange, common_cuts, same_bytes
from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.errors import UserError


@dataclass(frozen=True, eq=False)
class Alignment:
    """Chunk alignment of one text.

    chunks: [C, 4] int64 rows `(s0, s1, t0, t1)`: student tokens `[s0, s1)` and teacher tokens
        `[t0, t1)` cover the same bytes. Rows are in text order and contiguous on both sides
        (`s1[c] == s0[c + 1]`, `t1[c] == t0[c + 1]`), every row has at least one token per side.
    exact: [C] bool, True where both sides' bytes are identical (a dummy prefix space not
        counted); False where they agree only up to normalisation (NFKC, whitespace,
        special-token strings read as text by one side) or, for mismatched input, not at all.
    num_fallback: number of token positions (student + teacher) aligned by the DP fallback.

    Zero-byte tokens (specials) belong to chunks as the module docstring says: paired 1:1 at a
    shared boundary, else with the following chunk (the last one at the end of the text).
    """

    chunks: np.ndarray
    exact: np.ndarray
    num_fallback: int = 0

    @property
    def num_chunks(self) -> int:
        return int(self.chunks.shape[0])

    def __len__(self) -> int:
        return self.num_chunks


@dataclass
class Side:
    """One tokenization of the text, as byte offsets.

    ids: [n] int64; lens: [n] int64 bytes per token; ends: [n] int64 cumulative ends;
    flat_at: [n] int64 where each token's bytes start in `table.flat`, or None (look up). A
    dummy-prefix space is already dropped: that token's `lens` is one less, `flat_at` one more.
    """

    ids: np.ndarray
    lens: np.ndarray
    ends: np.ndarray
    table: TokenBytes
    num_zero: int
    flat_at: np.ndarray | None = None

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    @property
    def total(self) -> int:
        total = self.__dict__.get("_total")
        if total is None:
            total = self.__dict__["_total"] = int(self.ends[-1]) if self.ends.shape[0] else 0
        return total

    @property
    def starts(self) -> np.ndarray:
        return self.ends - self.lens

    def positive_index(self) -> np.ndarray:
        """[p] indices of the tokens that cover at least one byte."""
        if not self.num_zero:
            return np.arange(self.size)
        cached = self.__dict__.get("_positive_index")
        if cached is None:
            cached = self.__dict__["_positive_index"] = np.flatnonzero(self.lens)
        return cached

    def positive_ends(self) -> np.ndarray:
        """Strictly increasing ends of the tokens that cover at least one byte."""
        return self.ends[self.positive_index()] if self.num_zero else self.ends

    def stream(self) -> np.ndarray:
        """[total] uint8: the bytes this side covers, dummy prefix removed."""
        flat_at = self.table.offsets[self.ids] if self.flat_at is None else self.flat_at
        # Byte k of token i sits at flat_at[i] + (k - start of i): one repeat, one add.
        index = np.repeat(flat_at - (self.ends - self.lens), self.lens)
        index += arange(index.shape[0])
        return self.table.flat[index]


def as_ids(ids, table: TokenBytes) -> np.ndarray:
    """[n] int64 ids of `table` from any 1-D int sequence; a clear error for anything else."""
    ids = np.asarray(ids)
    if ids.ndim != 1:
        raise UserError(f"token ids must be a 1-D sequence, got shape {tuple(ids.shape)}")
    if ids.dtype != np.int64:
        ids = ids.astype(np.int64)
    # One reduction checks both ends: negative ids are huge as unsigned.
    if ids.shape[0] and ids.view(np.uint64).max() >= table.vocab_size:
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise UserError(
            f"token id {bad} is outside this tokenizer's vocabulary of {table.vocab_size}; "
            "align ids with the tokenizer that produced them"
        )
    return ids


def make_side(ids, table: TokenBytes, doc_starts: np.ndarray | None = None) -> Side:
    """Byte offsets of one token sequence. ids: any 1-D int sequence of ids of `table`;
    doc_starts: [B] first token of each text when `ids` concatenates several (default: one)."""
    ids = as_ids(ids, table)
    meta = table.meta[ids]  # one gather for offset and length
    lens = meta & 0xFFFF
    flat_at = meta >> 16
    if table.prefix_space and ids.shape[0]:
        _drop_dummy_prefix(table, lens, flat_at, doc_starts)
    num_zero = ids.shape[0] - int(np.count_nonzero(lens))
    return Side(ids, lens, np.cumsum(lens), table, num_zero, flat_at)


def _drop_dummy_prefix(table: TokenBytes, lens, flat_at, doc_starts) -> None:
    """In place: the first text-bearing token of each text loses its leading space."""
    text = np.flatnonzero(lens)
    starts = np.zeros(1, dtype=np.int64) if doc_starts is None else doc_starts
    first = np.searchsorted(text, starts)
    first = text[first[first < text.shape[0]]]
    first = first[table.flat[flat_at[first]] == 0x20]
    lens[first] -= 1
    flat_at[first] += 1


def exact_alignment(pair, j, ids_s, ids_t, bytes_s, bytes_t) -> Alignment | None:
    """The alignment of `Joint` j when both sides' bytes are identical, else None."""
    cuts, hit = common_cuts(j)
    if not same_bytes(pair, j, cuts, hit):
        return None
    n, m = j.n, j.m
    chunks = rows_from_cuts(cuts, n, m)
    if j.zero_s and j.zero_t:
        leading_s, leading_t = j.leading()
        if leading_s and leading_t:  # the common case, BOS on both sides: pair them up front
            chunks = pair_leading(chunks, min(j.zero_s, j.zero_t))
        else:
            ends_s, ends_t = j.ends[:n], j.ends[n:] - j.total_s
            side_s = Side(ids_s, j.lens[:n], ends_s, bytes_s, j.zero_s)
            side_t = Side(ids_t, j.lens[n:], ends_t, bytes_t, j.zero_t)
            bounds = ends_s[cuts[: cuts.shape[0] // 2]]
            chunks = _pair_zero_byte_tokens(chunks, side_s, side_t, bounds, bounds)
    return Alignment(chunks, np.ones(chunks.shape[0], dtype=bool))


def rows_from_cuts(cuts: np.ndarray, n: int, m: int) -> np.ndarray:
    """[C, 4] chunk rows from the [2C] cuts of `common_cuts` (n student, m teacher tokens);
    zero-byte tokens go with the following chunk, at the end with the last one."""
    num = cuts.shape[0] // 2
    chunks = np.empty((num, 4), dtype=np.int64)
    np.add(cuts[:num], 1, out=chunks[:, 1])
    np.subtract(cuts[num:], n - 1, out=chunks[:, 3])
    chunks[1:, 0::2] = chunks[:-1, 1::2]  # each chunk starts where the one before ends
    chunks[0, 0] = chunks[0, 2] = 0
    chunks[-1, 1], chunks[-1, 3] = n, m
    return chunks


def pair_leading(chunks: np.ndarray, pairs: int) -> np.ndarray:
    """`pairs` zero-byte tokens before the text on both sides become 1:1 chunks up front."""
    out = np.empty((pairs + chunks.shape[0], 4), dtype=np.int64)
    out[:pairs] = arange(pairs)[:, None] + np.array([0, 1, 0, 1])
    out[pairs:] = chunks
    out[pairs, 0] = out[pairs, 2] = pairs
    return out


def align_dp(ids_s, ids_t, bytes_s: TokenBytes, bytes_t: TokenBytes) -> Alignment:
    """The alignment `align` gives for texts both sides decode to identical bytes, computed by
    the O(n * m) dynamic program over token end offsets: the fallback, kept as a baseline."""
    side_s, side_t = make_side(ids_s, bytes_s), make_side(ids_t, bytes_t)
    trivial = trivial_alignment(side_s.size, side_t.size, side_s.total, side_t.total)
    if trivial is not None:
        return trivial
    ends_s, ends_t = side_s.positive_ends(), side_t.positive_ends()
    pairs = np.asarray(lcs_pairs(ends_s.tolist(), ends_t.tolist()), dtype=np.int64).reshape(-1, 2)
    bounds_s, bounds_t = monotone_boundaries(
        ends_s[pairs[:, 0]], ends_t[pairs[:, 1]], side_s.total, side_t.total
    )
    cut_s = np.searchsorted(side_s.starts, bounds_s, side="left")
    cut_t = np.searchsorted(side_t.starts, bounds_t, side="left")
    chunks = chunks_from_cuts(side_s, side_t, cut_s, cut_t, bounds_s, bounds_t)
    exact = np.ones(chunks.shape[0], dtype=bool)
    return Alignment(chunks, exact, num_fallback=side_s.size + side_t.size)


def trivial_alignment(n_s: int, n_t: int, total_s: int, total_t: int) -> Alignment | None:
    """Texts with no bytes on a side: zero chunks, or one inexact chunk if only one is empty.
    n_*: tokens per side, total_*: bytes per side."""
    if n_s == 0 or n_t == 0 or (total_s == 0 and total_t == 0):
        return Alignment(np.zeros((0, 4), dtype=np.int64), np.zeros(0, dtype=bool))
    if total_s == 0 or total_t == 0:
        return Alignment(np.asarray([[0, n_s, 0, n_t]], dtype=np.int64), np.zeros(1, dtype=bool))
    return None


def chunks_from_cuts(side_s: Side, side_t: Side, cut_s, cut_t, bounds_s, bounds_t) -> np.ndarray:
    """[C, 4] chunks from the common boundaries after the start of the text.

    cut_s / cut_t: [B] tokens before each boundary (tokens starting before it); bounds_s /
    bounds_t: [B] its byte offsets; the last boundary is the end of the text on both sides.
    Applies the zero-byte-token conventions of the module docstring.
    """
    num = cut_s.shape[0]
    chunks = np.empty((num, 4), dtype=np.int64)
    chunks[0, 0] = chunks[0, 2] = 0
    chunks[1:, 0], chunks[:, 1] = cut_s[:-1], cut_s
    chunks[1:, 2], chunks[:, 3] = cut_t[:-1], cut_t
    chunks[-1, 1], chunks[-1, 3] = side_s.size, side_t.size  # trailing zero-byte tokens
    if side_s.num_zero and side_t.num_zero:
        chunks = _pair_zero_byte_tokens(chunks, side_s, side_t, bounds_s, bounds_t)
    return chunks


def _zero_runs(side: Side, bounds: np.ndarray) -> dict[int, tuple[int, int]]:
    """Runs of zero-byte tokens at common boundaries: boundary index (-1 for the start of the
    text) -> (first token, count)."""
    zero = np.flatnonzero(side.lens == 0)
    where, first, count = np.unique(side.ends[zero], return_index=True, return_counts=True)
    k = np.searchsorted(bounds, where)
    runs = {}
    for w, f, c, b in zip(where.tolist(), first.tolist(), count.tolist(), k.tolist()):
        if w == 0:
            runs[-1] = (int(zero[f]), c)
        elif b < bounds.shape[0] and bounds[b] == w:
            runs[b] = (int(zero[f]), c)
    return runs


def _pair_zero_byte_tokens(chunks, side_s, side_t, bounds_s, bounds_t) -> np.ndarray:
    """Zero-byte tokens at the same boundary on both sides become 1:1 chunks of their own."""
    runs_s, runs_t = _zero_runs(side_s, bounds_s), _zero_runs(side_t, bounds_t)
    last = chunks.shape[0] - 1
    extra = []
    for k in sorted(runs_s.keys() & runs_t.keys()):
        (first_s, count_s), (first_t, count_t) = runs_s[k], runs_t[k]
        pairs = min(count_s, count_t)
        if k == last:  # end of text: pair from the end, leftovers stay in the last chunk
            first_s, first_t = side_s.size - pairs, side_t.size - pairs
            chunks[last, 1], chunks[last, 3] = first_s, first_t
        else:  # leftovers join the chunk that follows
            chunks[k + 1, 0], chunks[k + 1, 2] = first_s + pairs, first_t + pairs
        extra.extend(
            (first_s + i, first_s + i + 1, first_t + i, first_t + i + 1) for i in range(pairs)
        )
    if not extra:
        return chunks
    rows = np.concatenate((chunks, np.asarray(extra, dtype=np.int64)))
    return rows[np.argsort(rows[:, 0], kind="stable")]


def monotone_boundaries(cand_s, cand_t, total_s: int, total_t: int):
    """Boundary pairs from candidates increasing (not strictly) on both sides: keep those that
    advance on both sides, so no chunk has an empty side; ties keep the earliest, so unmatched
    tokens join the following chunk. Returns [B] offsets per side, ending at the totals."""
    keep_s, keep_t = [0], [0]
    for x_s, x_t in zip(cand_s.tolist(), cand_t.tolist()):
        if x_s > keep_s[-1] and x_t > keep_t[-1]:
            keep_s.append(x_s)
            keep_t.append(x_t)
    while len(keep_s) > 1 and (keep_s[-1] >= total_s or keep_t[-1] >= total_t):
        keep_s.pop()
        keep_t.pop()
    keep_s.append(total_s)
    keep_t.append(total_t)
    return np.asarray(keep_s[1:], dtype=np.int64), np.asarray(keep_t[1:], dtype=np.int64)

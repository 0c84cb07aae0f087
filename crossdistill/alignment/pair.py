"""Both vocabularies of a (student, teacher) pair in one table: the fast path of alignment.

Per token, one gather from the joint table fetches its byte length, where its bytes start and a
canonical id (two ids, of either vocabulary, have the same canonical id iff they cover the same
bytes). The two sides' tokens sit in one array, student first, so each step is one NumPy call
for both sides: at a few thousand tokens a call's fixed cost (microseconds) outweighs its work.

Whether the two decodings are identical is decided chunk by chunk once the common boundaries
are known: a chunk whose last tokens have the same canonical id is one token per side with the
same bytes (equal length and equal end make its start a common boundary too). Only the bytes of
the other chunks are gathered, on both sides, and compared with one memcmp.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.errors import UserError

_LEN_BITS = 16
# The first text-bearing token of a text is looked for among this many tokens first.
_SCAN = 8

_ARANGE = np.arange(1 << 16, dtype=np.int64)


def arange(n: int) -> np.ndarray:
    """A read-only view of 0..n-1, shared between calls (kept, never rebuilt per call)."""
    global _ARANGE
    if n > _ARANGE.shape[0]:
        _ARANGE = np.arange(max(n, 2 * _ARANGE.shape[0]), dtype=np.int64)
    return _ARANGE[:n]


@dataclass(frozen=True, eq=False)
class PairTable:
    """The byte tables of a student and a teacher vocabulary, joined. Get with `pair_table`.

    meta: [V_s + V_t] int64 per id, the teacher's ids after the student's: byte length in bits
        0-15, where the bytes start in `flat` in bits 16 to `canon_shift - 1`, canonical id
        above.
    flat: [F_s + F_t] uint8, the student's token bytes, then the teacher's.
    """

    meta: np.ndarray
    flat: np.ndarray
    vocab_s: int
    canon_shift: int
    prefix_s: bool
    prefix_t: bool

    @property
    def offset_mask(self) -> int:
        return (1 << (self.canon_shift - _LEN_BITS)) - 1

    def gather(self, ids_s: np.ndarray, ids_t: np.ndarray) -> np.ndarray:
        """[n + m] int64 meta of valid student ids [n], then of teacher ids [m]."""
        n = ids_s.shape[0]
        meta = np.empty(n + ids_t.shape[0], dtype=np.int64)
        # mode="clip": the ids are checked already, and "raise" would buffer the output.
        self.meta.take(ids_s, out=meta[:n], mode="clip")
        self.meta[self.vocab_s :].take(ids_t, out=meta[n:], mode="clip")
        return meta


@functools.lru_cache(maxsize=16)
def pair_table(bytes_s: TokenBytes, bytes_t: TokenBytes) -> PairTable:
    """The joint table of two vocabularies; built on first use (~0.1 s for 150k-id ones), then
    kept for the last 16 pairs."""
    num_t = bytes_t.vocab_size
    index: dict[bytes, int] = {}
    canon_t = [index.setdefault(piece, j) for j, piece in enumerate(bytes_t.pieces())]
    canon_s = [index.get(piece, num_t + i) for i, piece in enumerate(bytes_s.pieces())]
    flat = np.concatenate((bytes_s.flat, bytes_t.flat))
    offsets = np.concatenate((bytes_s.offsets[:-1], bytes_t.offsets[:-1] + bytes_s.flat.shape[0]))
    lengths = np.concatenate((bytes_s.lengths, bytes_t.lengths)).astype(np.int64)
    if int(lengths.max(initial=0)) >= 1 << _LEN_BITS:
        raise UserError("a token longer than 65535 bytes is not supported")
    canon_shift = _LEN_BITS + max(1, int(flat.shape[0]).bit_length())
    if canon_shift + int(bytes_s.vocab_size + num_t).bit_length() > 63:
        raise UserError(
            "these two vocabularies are too large to align: their byte offsets and ids do not "
            "fit one 64-bit table"
        )
    canon = np.asarray(canon_s + canon_t, dtype=np.int64)
    meta = (canon << canon_shift) | (offsets << _LEN_BITS) | lengths
    return PairTable(
        meta, flat, bytes_s.vocab_size, canon_shift, bytes_s.prefix_space, bytes_t.prefix_space
    )


@dataclass(slots=True)
class Joint:
    """Both tokenizations of one text (or of a batch of texts, concatenated per side), in
    one array each: student tokens first, then teacher tokens.

    meta: [n + m] int64 from `PairTable.meta`, dummy-prefix space already dropped;
    lens: [n + m] int64 bytes per token; ends: [n + m] int64 cumulative ends (the teacher's
    counted on from the student's total); zero_s / zero_t: zero-byte tokens per side.
    """

    meta: np.ndarray
    lens: np.ndarray
    ends: np.ndarray
    n: int
    m: int
    total_s: int
    total_t: int
    zero_s: int
    zero_t: int

    def leading(self) -> tuple[bool, bool]:
        """Per side: whether all its zero-byte tokens come before its text (a BOS)."""
        n, ends = self.n, self.ends
        return (
            not self.zero_s or ends[self.zero_s - 1] == 0,
            not self.zero_t or ends[n + self.zero_t - 1] == self.total_s,
        )


def joint(
    pair: PairTable,
    ids_s: np.ndarray,
    ids_t: np.ndarray,
    docs_s: np.ndarray | None = None,
    docs_t: np.ndarray | None = None,
) -> Joint:
    """`Joint` of valid ids [n] and [m]; docs_*: [B] first token of each text on that side
    when the ids concatenate several texts (default: one)."""
    n, m = ids_s.shape[0], ids_t.shape[0]
    meta = pair.gather(ids_s, ids_t)
    if pair.prefix_s and n:
        _drop_dummy_prefix(pair, meta, 0, n, docs_s)
    if pair.prefix_t and m:
        _drop_dummy_prefix(pair, meta, n, n + m, docs_t)
    lens = meta & 0xFFFF
    ends = lens.cumsum()
    total_s = int(ends[n - 1]) if n else 0
    total_t = int(ends[-1]) - total_s if m else 0
    num_zero = n + m - int(np.count_nonzero(lens))
    zero_s = n - int(np.count_nonzero(lens[:n])) if num_zero else 0
    return Joint(meta, lens, ends, n, m, total_s, total_t, zero_s, num_zero - zero_s)


def _drop_dummy_prefix(pair: PairTable, meta: np.ndarray, lo: int, hi: int, doc_starts) -> None:
    """In place on meta[lo:hi]: the first text-bearing token of each text (one text, or one
    starting at each of `doc_starts`, relative to lo) loses its leading space."""
    if doc_starts is None:
        for k in range(lo, min(hi, lo + _SCAN)):
            word = int(meta[k])
            if word & 0xFFFF:
                if pair.flat[(word >> _LEN_BITS) & pair.offset_mask] == 0x20:
                    meta[k] = word + (1 << _LEN_BITS) - 1  # start one byte later, one shorter
                return
        doc_starts = np.zeros(1, dtype=np.int64)
    text = (meta[lo:hi] & 0xFFFF).nonzero()[0]
    first = text.searchsorted(doc_starts)
    first = lo + text[first[first < text.shape[0]]]
    first = first[pair.flat[(meta[first] >> _LEN_BITS) & pair.offset_mask] == 0x20]
    meta[first] += (1 << _LEN_BITS) - 1


def common_cuts(j: Joint) -> tuple[np.ndarray, np.ndarray]:
    """The last token of each chunk, when both sides cover the same number of bytes.

    Returns cuts [2C] int64, C student token indices then C teacher ones (offset by n), each
    the last text-bearing token before the same common boundary, and hit [n + m] bool, True
    exactly at the cuts. O(n + m) with one byte-indexed mark array, no sorting.
    """
    n, total, ends = j.n, j.total_s, j.ends
    # Student ends at 0..total, teacher ends at total..2 total: one scatter marks both.
    is_end = np.zeros(2 * total + 1, dtype=bool)
    is_end[ends] = True
    hit = np.empty(ends.shape[0], dtype=bool)
    is_end[total:].take(ends[:n], out=hit[:n], mode="clip")  # a teacher token ends there too
    is_end.take(ends[n:] - total, out=hit[n:], mode="clip")  # a student token ends there too
    # A zero-byte token shares the end of the token before it (0 before the text), so it
    # hits wrongly there, or twice at a boundary: only text-bearing tokens count.
    leading_s, leading_t = j.leading()
    if leading_s:
        hit[: j.zero_s] = False
    else:
        hit[:n] &= j.lens[:n] != 0
    if leading_t:
        hit[n : n + j.zero_t] = False
    else:
        hit[n:] &= j.lens[n:] != 0
    return hit.nonzero()[0], hit


def same_bytes(pair: PairTable, j: Joint, cuts: np.ndarray, hit: np.ndarray) -> bool:
    """Whether both sides' bytes are identical, given `common_cuts` (hit is overwritten)."""
    num = cuts.shape[0] // 2
    last = j.meta.take(cuts)
    # Same canonical id (the bits from canon_shift up): one token per side, the same bytes.
    other = (last[:num] ^ last[num:]) >= (1 << pair.canon_shift)
    if not other.any():
        return True
    # The tokens of the other chunks (hit then marks those checked): their bytes, the
    # student's then the teacher's.
    hit[cuts[:num][other]] = False
    hit[cuts[num:][other]] = False
    rest = np.invert(hit, out=hit).nonzero()[0]
    meta = j.meta.take(rest)
    lens = meta & 0xFFFF
    stop = lens.cumsum()
    # Byte k of what is left sits at flat[start of its token in flat + k - start of its token].
    base = (meta >> _LEN_BITS) & pair.offset_mask
    base -= stop
    base += lens
    index = base.repeat(lens)
    index += arange(index.shape[0])
    data = pair.flat.take(index)
    split = int(stop[rest.searchsorted(j.n) - 1])
    return data[:split].tobytes() == data[split:].tobytes()

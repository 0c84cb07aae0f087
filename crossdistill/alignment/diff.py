"""Byte-level diff of two decodings of one text, fast where they mostly agree.

The two tokenizers of a pair decode the same text to byte strings that differ only in a few
places (Unicode normalisation, a dummy prefix space, whitespace absorbed by an added token, a
special-token literal read as text by one side only). `difflib` on whole documents is far too
slow, and its longest-block-first matching can skew repetitive text, so the differences are
narrowed first: strip the common prefix and suffix with NumPy, then split what is left at an
anchor (a window of one side found once, near the same relative place, in the other) and
recurse; small leftovers get an exact longest common subsequence (`dp.lcs_codes`).

Every returned block is a run of equal bytes and the blocks are increasing on both sides, so
any boundary read off them is correct; a missed match only makes chunks coarser.
"""

from __future__ import annotations

import numpy as np

from crossdistill.alignment.dp import lcs_codes

# Leftovers this small (product of the two lengths) get an exact longest common subsequence;
# larger ones are split at an anchor first.
_LCS_MAX_CELLS = 1 << 20
_ANCHOR_WIDTHS = (32, 8)
_ANCHOR_PLACES = (0.5, 0.25, 0.75, 0.125, 0.875)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _common_suffix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    diff = np.flatnonzero(a[a.shape[0] - n :][::-1] != b[b.shape[0] - n :][::-1])
    return int(diff[0]) if diff.size else n


def _find_anchor(a: bytes, b: bytes) -> tuple[int, int] | None:
    """A position in `a` and one in `b` where the same window of bytes starts: a window found
    exactly once in each if there is one, else the occurrence nearest the same relative place;
    None when no window of `a` is found in `b`."""
    fallback = None
    for width in _ANCHOR_WIDTHS:
        if len(a) < 2 * width:
            continue
        for place in _ANCHOR_PLACES:
            pa = int((len(a) - width) * place)
            window = a[pa : pa + width]
            hit = b.find(window)
            if hit >= 0 and hit == b.rfind(window) and a.find(window) == a.rfind(window):
                return pa, hit
            if fallback is None and hit >= 0:
                expected = int(pa * len(b) / len(a))
                after = b.find(window, expected)
                before = b.rfind(window, 0, expected + width)
                near = [p for p in (after, before) if p >= 0]
                fallback = (pa, min(near, key=lambda p: abs(p - expected)))
    return fallback


def _characters(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Code points [k] of a UTF-8 byte array (stray bytes as surrogates) and the byte offset
    [k + 1] where each starts."""
    text = data.tobytes().decode("utf-8", "surrogateescape")
    codes = np.fromiter(map(ord, text), dtype=np.int64, count=len(text))
    # UTF-8 length of each code point; an escaped stray byte (U+DC80..U+DCFF) is one byte.
    sizes = 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000)
    sizes[(codes >= 0xDC80) & (codes <= 0xDCFF)] = 1
    offsets = np.zeros(codes.shape[0] + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return codes, offsets


def _lcs_blocks(a: np.ndarray, b: np.ndarray, i0: int, j0: int) -> list[tuple[int, int, int]]:
    """Runs of a longest common subsequence of two byte arrays, taken over characters so that
    no match splits one, as (i, j, n) byte blocks."""
    codes_a, offsets_a = _characters(a)
    codes_b, offsets_b = _characters(b)
    idx_a, idx_b = lcs_codes(codes_a, codes_b)
    if idx_a.shape[0] == 0:
        return []
    # A new block starts wherever either index jumps.
    starts = np.flatnonzero((np.diff(idx_a, prepend=-2) != 1) | (np.diff(idx_b, prepend=-2) != 1))
    stops = np.append(starts[1:], idx_a.shape[0]) - 1
    first_a, last_a = idx_a[starts], idx_a[stops]
    sizes = offsets_a[last_a + 1] - offsets_a[first_a]
    begin_a = offsets_a[first_a] + i0
    begin_b = offsets_b[idx_b[starts]] + j0
    return list(zip(begin_a.tolist(), begin_b.tolist(), sizes.tolist()))


def matching_blocks(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """[K, 3] int64 rows `(i, j, n)`: `a[i:i+n] == b[j:j+n]`, increasing in `i` and in `j`.

    a, b: [N_a], [N_b] uint8, the student's and the teacher's bytes of one text.
    """
    out: list[tuple[int, int, int]] = []
    # Work items (a-offset, b-offset, a-length, b-length); blocks are sorted at the end.
    stack = [(0, 0, a.shape[0], b.shape[0])]
    while stack:
        i0, j0, la, lb = stack.pop()
        sub_a, sub_b = a[i0 : i0 + la], b[j0 : j0 + lb]
        p = _common_prefix(sub_a, sub_b)
        s = _common_suffix(sub_a[p:], sub_b[p:])
        out.append((i0, j0, p))
        out.append((i0 + la - s, j0 + lb - s, s))
        ma, mb = la - p - s, lb - p - s
        if ma == 0 or mb == 0:
            continue  # a pure insertion on one side: nothing in it can match
        if ma * mb <= _LCS_MAX_CELLS:
            out.extend(_lcs_blocks(sub_a[p : p + ma], sub_b[p : p + mb], i0 + p, j0 + p))
            continue
        anchor = _find_anchor(sub_a[p : p + ma].tobytes(), sub_b[p : p + mb].tobytes())
        if anchor is not None:  # else the leftover stays unmatched: coarser chunks, still exact
            ka, kb = anchor
            stack.append((i0 + p, j0 + p, ka, kb))
            stack.append((i0 + p + ka, j0 + p + kb, ma - ka, mb - kb))
    blocks = np.asarray([blk for blk in out if blk[2] > 0], dtype=np.int64).reshape(-1, 3)
    return blocks[np.argsort(blocks[:, 0], kind="stable")]

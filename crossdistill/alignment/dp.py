"""The dynamic-programming aligner: the last resort, and the baseline the fast path is measured by.

It finds a longest common subsequence of two sequences of boundary keys, one key per token
end. With byte offsets as keys (`align_dp`) it returns exactly the common boundaries that the
O(n + m) merge finds, at O(n * m) cost. With canonical text keys (`refine_boundaries`) it
recovers boundaries inside a stretch whose bytes differ, e.g. NFD text against a tokenizer that
normalises to NFC: a student and a teacher boundary match when the text before them is the
same after NFKC normalisation and with whitespace removed.
"""

from __future__ import annotations

import unicodedata

import numpy as np


def lcs_pairs(keys_s: list, keys_t: list) -> list[tuple[int, int]]:
    """Index pairs `(i, j)`, increasing in both, of a longest common subsequence of two key
    lists (keys compared with `==`). O(len(keys_s) * len(keys_t)) time and memory."""
    codes: dict = {}
    code_s = np.asarray([codes.setdefault(k, len(codes)) for k in keys_s], dtype=np.int64)
    code_t = np.asarray([codes.get(k, -1) for k in keys_t], dtype=np.int64)
    idx_s, idx_t = lcs_codes(code_s, code_t)
    return list(zip(idx_s.tolist(), idx_t.tolist()))


def lcs_codes(code_s: np.ndarray, code_t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A longest common subsequence of two integer arrays [p], [q]: matched indices [L] per
    side, increasing. Row by row in NumPy: O(p * q) time and memory."""
    p, q = code_s.shape[0], code_t.shape[0]
    if p == 0 or q == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    dtype = np.uint16 if min(p, q) < np.iinfo(np.uint16).max else np.int32
    # table[i, j] = LCS length of code_s[:i] and code_t[:j]; a row is a running maximum of
    # "take the row above" and "extend the diagonal where the codes match".
    table = np.zeros((p + 1, q + 1), dtype=dtype)
    for i in range(1, p + 1):
        above = table[i - 1]
        row = above.copy()
        diag = above[:-1] + 1
        np.maximum(
            row[1:], np.where(code_t == code_s[i - 1], diag, 0), out=row[1:], casting="unsafe"
        )
        np.maximum.accumulate(row, out=table[i])
    out_s, out_t = [], []
    i, j = p, q
    cs, ct = code_s.tolist(), code_t.tolist()
    while i > 0 and j > 0:
        here = table[i, j]
        if cs[i - 1] == ct[j - 1] and here == table[i - 1, j - 1] + 1:
            out_s.append(i - 1)
            out_t.append(j - 1)
            i -= 1
            j -= 1
        elif table[i - 1, j] == here:
            i -= 1
        else:
            j -= 1
    return np.asarray(out_s[::-1], dtype=np.int64), np.asarray(out_t[::-1], dtype=np.int64)


def canonical_text(text: str) -> str:
    """The normalisation alignment tolerates where bytes differ: NFKC, whitespace removed,
    and SentencePiece's visible space U+2581 taken as a space (such tokenizers read it so)."""
    return "".join(unicodedata.normalize("NFKC", text).replace("\u2581", " ").split())


def canonical_keys(stream: bytes, cuts: list[int]) -> list[str | None]:
    """For each cut offset in `stream`, the canonical text before it, or None where the cut
    splits a UTF-8 character or changes how the text around it normalises."""
    try:
        whole = canonical_text(stream.decode("utf-8"))
    except UnicodeDecodeError:
        return [None] * len(cuts)
    keys: list[str | None] = []
    for cut in cuts:
        try:
            head = canonical_text(stream[:cut].decode("utf-8"))
            rest = canonical_text(stream[cut:].decode("utf-8"))
        except UnicodeDecodeError:
            keys.append(None)
            continue
        keys.append(head if head + rest == whole else None)
    return keys


def refine_boundaries(
    stream_s: bytes, cuts_s: list[int], stream_t: bytes, cuts_t: list[int]
) -> list[tuple[int, int]]:
    """Pairs `(cut_s, cut_t)` of interior offsets where both texts agree up to normalisation.

    stream_s / stream_t: the bytes of one chunk on each side; cuts_*: its interior token ends.
    Between two such pairs, a stretch whose bytes are identical is also cut at every offset
    that ends a token on both sides.
    """
    keys_s = canonical_keys(stream_s, cuts_s)
    keys_t = canonical_keys(stream_t, cuts_t)
    # A cut with no usable key must never match: give each its own unmatched placeholder.
    keys_s = [k if k is not None else ("s", n) for n, k in enumerate(keys_s)]
    keys_t = [k if k is not None else ("t", n) for n, k in enumerate(keys_t)]
    found = [(cuts_s[i], cuts_t[j]) for i, j in lcs_pairs(keys_s, keys_t)]
    edges = [(0, 0), *found, (len(stream_s), len(stream_t))]
    extra = []
    for (x_s, x_t), (y_s, y_t) in zip(edges, edges[1:]):
        if stream_s[x_s:y_s] == stream_t[x_t:y_t]:
            inside_t = {c - x_t for c in cuts_t if x_t < c < y_t}
            extra += [(c, x_t + c - x_s) for c in cuts_s if x_s < c < y_s and c - x_s in inside_t]
    return sorted(found + extra)

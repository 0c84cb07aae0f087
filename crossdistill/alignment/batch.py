"""`align_batch`: many texts in one pass of NumPy calls.

The texts of a batch are concatenated per side; where every text decodes to the same bytes on
both sides, each text's end is a common boundary of the concatenation, so one merge finds every
text's chunks and they only need cutting apart. This amortises the fixed cost of each NumPy
call (a few microseconds, against well under a nanosecond per element) over the batch; batches
past `GROUP_TOKENS` go in groups of consecutive texts, to bound memory. Texts the shortcut does
not cover (bytes that differ somewhere, texts with no bytes, zero-byte tokens on both sides
other than before each text) go text by text through `align`, with identical results.
"""

from __future__ import annotations

import numpy as np

from crossdistill.alignment.align import align
from crossdistill.alignment.chunks import Alignment, as_ids, pair_leading, rows_from_cuts
from crossdistill.alignment.pair import common_cuts, joint, pair_table, same_bytes
from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.errors import UserError

# Student + teacher tokens per group (about 16 texts of 4k tokens): bounds each array to ~1 MB.
GROUP_TOKENS = 1 << 17


def align_batch(
    list_of_ids_s, list_of_ids_t, bytes_s: TokenBytes, bytes_t: TokenBytes
) -> list[Alignment]:
    """`align` over a batch of texts (for collators): one `Alignment` per text.

    list_of_ids_s / list_of_ids_t: B sequences of student / teacher ids, one of each per text.
    """
    if len(list_of_ids_s) != len(list_of_ids_t):
        raise UserError(
            f"align_batch got {len(list_of_ids_s)} student and {len(list_of_ids_t)} teacher "
            "sequences; give one of each per text"
        )
    out: list[Alignment] = []
    first, size = 0, 0
    for k, (ids_s, ids_t) in enumerate(zip(list_of_ids_s, list_of_ids_t)):
        size += len(ids_s) + len(ids_t)
        if size >= GROUP_TOKENS or k == len(list_of_ids_s) - 1:
            out += _align_group(
                list_of_ids_s[first : k + 1], list_of_ids_t[first : k + 1], bytes_s, bytes_t
            )
            first, size = k + 1, 0
    return out


def _align_group(list_of_ids_s, list_of_ids_t, bytes_s, bytes_t) -> list[Alignment]:
    batched = _align_together(list_of_ids_s, list_of_ids_t, bytes_s, bytes_t)
    if batched is not None:
        return batched
    return [align(s, t, bytes_s, bytes_t) for s, t in zip(list_of_ids_s, list_of_ids_t)]


def _concat(list_of_ids, table: TokenBytes) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ids [N] int64 and each text's first token [B + 1] (the last is N)."""
    arrays = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in list_of_ids]
    starts = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.shape[0] for a in arrays], out=starts[1:])
    return as_ids(np.concatenate(arrays), table), starts


def _align_together(list_of_ids_s, list_of_ids_t, bytes_s, bytes_t) -> list[Alignment] | None:
    """The texts in one merge, or None where the shortcut does not apply."""
    if len(list_of_ids_s) < 2:
        return None
    ids_s, docs_s = _concat(list_of_ids_s, bytes_s)
    ids_t, docs_t = _concat(list_of_ids_t, bytes_t)
    if not ((docs_s[1:] > docs_s[:-1]).all() and (docs_t[1:] > docs_t[:-1]).all()):
        return None  # an empty text
    pair = pair_table(bytes_s, bytes_t)
    j = joint(pair, ids_s, ids_t, docs_s[:-1], docs_t[:-1])
    n, m = j.n, j.m
    # [B] byte offset where each text ends, per side: the same, and increasing.
    end_s = j.ends[docs_s[1:] - 1]
    end_t = j.ends[n - 1 + docs_t[1:]] - j.total_s
    if not ((end_s == end_t).all() and end_s[0] > 0 and (end_s[1:] > end_s[:-1]).all()):
        return None
    pairs = None
    if j.zero_s and j.zero_t:  # zero-byte tokens pair up within each text
        start = np.concatenate(([0], end_s[:-1]))  # [B] byte offset where each text starts
        zero_s = _leading_zeros(j.lens[:n], j.ends[:n], docs_s, start)
        zero_t = _leading_zeros(j.lens[n:], j.ends[n:] - j.total_s, docs_t, start)
        if zero_s is None or zero_t is None:
            return None
        pairs = np.minimum(zero_s, zero_t).tolist()
    cuts, hit = common_cuts(j)
    if not same_bytes(pair, j, cuts, hit):
        return None
    chunks = rows_from_cuts(cuts, n, m)
    # Each text ends at a common boundary: its last chunk takes the text's trailing zero-byte
    # tokens, and the next text's first chunk starts at that text's first token.
    last = j.ends[cuts[: chunks.shape[0]]].searchsorted(end_s)  # [B] each text's last chunk
    chunks[last, 1], chunks[last, 3] = docs_s[1:], docs_t[1:]
    chunks[last[:-1] + 1, 0], chunks[last[:-1] + 1, 2] = docs_s[1:-1], docs_t[1:-1]
    # Back to each text's own token indices.
    per_text = np.empty_like(last)
    per_text[0] = last[0] + 1
    np.subtract(last[1:], last[:-1], out=per_text[1:])
    shift_s, shift_t = docs_s[:-1].repeat(per_text), docs_t[:-1].repeat(per_text)
    for col, shift in enumerate((shift_s, shift_s, shift_t, shift_t)):
        chunks[:, col] -= shift  # column by column: a [C, 2] broadcast runs 2 at a time
    exact = np.ones(chunks.shape[0], dtype=bool)
    stops = (last + 1).tolist()
    out = [Alignment(chunks[a:b], exact[a:b]) for a, b in zip([0, *stops[:-1]], stops)]
    for k, num in enumerate(pairs or ()):
        if num:  # as `align` does for zero-byte tokens before the text on both sides
            rows = pair_leading(out[k].chunks, num)
            out[k] = Alignment(rows, np.ones(rows.shape[0], dtype=bool))
    return out


def _leading_zeros(lens, ends, docs, start) -> np.ndarray | None:
    """[B] per text, its zero-byte tokens; None if one comes after text in its text.

    lens / ends: [N] one side's byte lengths and cumulative ends; docs: [B + 1] first token of
    each text; start: [B] byte offset where each text starts."""
    zero = (lens == 0).nonzero()[0]
    text = docs.searchsorted(zero, side="right") - 1  # the text each is in
    if not (ends[zero] == start[text]).all():  # some text-bearing token comes before it
        return None
    return np.bincount(text, minlength=start.shape[0])

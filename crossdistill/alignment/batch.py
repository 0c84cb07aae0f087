"""`align_batch`: many texts in one pass of NumPy calls.

The texts of a batch are concatenated on each side; where every text decodes to the same bytes
on both sides, each text's end is a common boundary of the concatenation, so one merge finds
every text's chunks and they only need cutting apart. This amortises the fixed cost of each
NumPy call over the batch. Batches the shortcut does not cover (bytes that differ somewhere,
texts with no bytes, zero-byte tokens on both sides, which pair up per text) go text by text
through `align`, with identical results.
"""

from __future__ import annotations

import numpy as np

from crossdistill.alignment.chunks import Alignment, align, common_ends, make_side
from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.errors import UserError


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
    batched = _align_together(list_of_ids_s, list_of_ids_t, bytes_s, bytes_t)
    if batched is not None:
        return batched
    return [align(s, t, bytes_s, bytes_t) for s, t in zip(list_of_ids_s, list_of_ids_t)]


def _concat(list_of_ids) -> tuple[np.ndarray, np.ndarray]:
    """Concatenated ids [N] int64 and each text's first token [B + 1] (the last is N)."""
    arrays = [np.asarray(ids, dtype=np.int64).reshape(-1) for ids in list_of_ids]
    starts = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([a.shape[0] for a in arrays], out=starts[1:])
    return np.concatenate(arrays), starts


def _align_together(list_of_ids_s, list_of_ids_t, bytes_s, bytes_t) -> list[Alignment] | None:
    """The whole batch in one merge, or None where the shortcut does not apply."""
    if len(list_of_ids_s) < 2 or bytes_s is bytes_t:
        return None
    ids_s, docs_s = _concat(list_of_ids_s)
    ids_t, docs_t = _concat(list_of_ids_t)
    side_s = make_side(ids_s, bytes_s, docs_s[:-1])
    side_t = make_side(ids_t, bytes_t, docs_t[:-1])
    if side_s.num_zero and side_t.num_zero:
        return None  # zero-byte tokens pair up text by text
    # [B + 1] byte offset where each text starts, per side.
    at_s = np.concatenate(([0], side_s.ends))[docs_s]
    at_t = np.concatenate(([0], side_t.ends))[docs_t]
    if not np.array_equal(at_s, at_t) or not (at_s[1:] > at_s[:-1]).all():
        return None
    if not np.array_equal(side_s.stream(), side_t.stream()):
        return None
    last_s, last_t = common_ends(side_s, side_t)
    cut_s = (side_s.positive_index()[last_s] if side_s.num_zero else last_s) + 1
    cut_t = (side_t.positive_index()[last_t] if side_t.num_zero else last_t) + 1
    chunks = np.empty((cut_s.shape[0], 4), dtype=np.int64)
    chunks[0, 0] = chunks[0, 2] = 0
    chunks[1:, 0], chunks[:, 1] = cut_s[:-1], cut_s
    chunks[1:, 2], chunks[:, 3] = cut_t[:-1], cut_t
    # Each text ends at a common boundary: its last chunk takes the text's trailing zero-byte
    # tokens, and the next text's first chunk starts at that text's first token.
    last = np.searchsorted(side_s.ends[cut_s - 1], at_s[1:])  # [B] each text's last chunk
    chunks[last, 1], chunks[last, 3] = docs_s[1:], docs_t[1:]
    chunks[last[:-1] + 1, 0], chunks[last[:-1] + 1, 2] = docs_s[1:-1], docs_t[1:-1]
    # Back to each text's own token indices.
    per_text = np.diff(last, prepend=-1)
    chunks -= np.repeat(
        np.stack((docs_s[:-1], docs_s[:-1], docs_t[:-1], docs_t[:-1]), 1), per_text, 0
    )
    return [
        Alignment(rows, np.ones(rows.shape[0], dtype=bool))
        for rows in np.split(chunks, last[:-1] + 1)
    ]

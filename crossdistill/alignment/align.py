"""`align`: the entry point of alignment. Two tokenizations of the same bytes (the common
case) are aligned exactly from their cumulative byte offsets (`chunks.exact_alignment`); texts
whose decoded bytes differ go through the byte diff (`align_diff`)."""

from __future__ import annotations

from crossdistill.alignment.align_diff import align_different_bytes
from crossdistill.alignment.chunks import (
    Alignment,
    as_ids,
    exact_alignment,
    make_side,
    trivial_alignment,
)
from crossdistill.alignment.pair import joint, pair_table
from crossdistill.alignment.token_bytes import TokenBytes


def align(ids_s, ids_t, bytes_s: TokenBytes, bytes_t: TokenBytes) -> Alignment:
    """Align a student and a teacher tokenization of the same text.

    ids_s: [n] student token ids, ids_t: [m] teacher token ids (any 1-D int sequence);
    bytes_s / bytes_t: the two tokenizers' `TokenBytes`. Returns an `Alignment`.
    """
    ids_s, ids_t = as_ids(ids_s, bytes_s), as_ids(ids_t, bytes_t)
    pair = pair_table(bytes_s, bytes_t)
    j = joint(pair, ids_s, ids_t)
    trivial = trivial_alignment(j.n, j.m, j.total_s, j.total_t)
    if trivial is not None:
        return trivial
    if j.total_s == j.total_t:
        exact = exact_alignment(pair, j, ids_s, ids_t, bytes_s, bytes_t)
        if exact is not None:
            return exact
    side_s, side_t = make_side(ids_s, bytes_s), make_side(ids_t, bytes_t)
    return align_different_bytes(side_s, side_t, side_s.stream(), side_t.stream())

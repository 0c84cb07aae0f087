"""How many bytes of the text each token covers: the denominator of bits per byte.

A token's decoded bytes are the text's bytes except where a tokenizer changed the text before
cutting it: SentencePiece's dummy-prefix space (no byte of the text), Unicode normalisation
(Qwen's NFC turns the 3 bytes of `e` + combining acute into the 2 of `é`). Bits per byte must
divide every model's NLL by the same number, the text's own UTF-8 bytes, whatever its
tokenizer; so each token is credited with the text bytes up to its end, read through a
byte-level diff of its decoding against the text where the two differ.
"""

from __future__ import annotations

import numpy as np

from crossdistill.alignment.chunks import make_side
from crossdistill.alignment.diff import matching_blocks
from crossdistill.alignment.token_bytes import TokenBytes


def token_text_bytes(ids, table: TokenBytes, text: bytes) -> np.ndarray:
    """[n] int64 bytes of `text` covered by each of `ids` (its tokenization, any 1-D int
    sequence): they sum to `len(text)`, a zero-byte token (BOS, specials) covers 0, and where
    the decoding equals the text each token covers its own decoded bytes."""
    side = make_side(ids, table)  # the dummy prefix already dropped
    data = np.frombuffer(text, dtype=np.uint8)
    if side.total == data.shape[0] and np.array_equal(side.stream(), data):
        return side.lens.astype(np.int64)
    ends = _map_offsets(side.ends, side.stream(), data)
    return np.diff(ends, prepend=0).astype(np.int64)


def _map_offsets(ends: np.ndarray, decoded: np.ndarray, text: np.ndarray) -> np.ndarray:
    """Offsets into `decoded` -> offsets into `text`, monotone, through the matching blocks of
    the two: inside (or at the end of) a block an offset moves with it; in a gap it goes to the
    end of the text's side of that gap, so a token ending there takes the whole gap; the end of
    `decoded` maps to the end of `text`."""
    blocks = matching_blocks(decoded, text)  # [k, 3] rows (a, b, size), increasing
    a0, b0, size = blocks[:, 0], blocks[:, 1], blocks[:, 2]
    a_end = np.append(a0 + size, decoded.shape[0])
    a_start, b_start = np.append(a0, decoded.shape[0]), np.append(b0, text.shape[0])
    # the first block (or the final sentinel) that ends at or after each offset
    k = np.searchsorted(a_end, ends, side="left")
    inside = ends >= a_start[k]
    out = np.where(inside, b_start[k] + (ends - a_start[k]), b_start[k])
    out[ends >= decoded.shape[0]] = text.shape[0]
    return np.maximum.accumulate(np.minimum(out, text.shape[0]))

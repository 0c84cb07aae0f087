"""`teachers.N.boundary: condition`: the first bytes each token rules out after it, counted at
load on the run's training text (`losses.boundaries` says what the loss does with them).

Over a sample of the text encoded as training encodes it, every pair of consecutive tokens (u,
v) that both cover text is counted by u and the first byte b of v. A byte b is blocked after u
when the pair never occurs although u is seen at least `MIN_COUNT` times and b starts
`EXPECTED_COUNT` or more of u's next tokens had it followed u as often as it starts a token
anywhere: a rate after u that the sample bounds to a few percent of b's rate elsewhere. The
counts are per token, on both tokenizers, so that a rule of one tokenizer (Llama-3's line end
that swallows every line end after it) shows as blocked pairs on its side only. The sample is
the same on every rank, so every process builds the same table.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

# the text read for the counts: a token needs MIN_COUNT sightings, so a larger sample blocks
# pairs of more tokens; tokenizing it takes about a second per tokenizer and megabyte
SAMPLE_BYTES = 4 << 20
# documents read per training file for the sample (the cpu scale of `bench quality` writes
# pieces of 1 kB, so 4 MB is 4096 of them)
SAMPLE_ROWS = 4096
# a token seen fewer times than this after which nothing is blocked: a pair it never showed
# could still follow it at a few percent
MIN_COUNT = 100
# a pair never seen is blocked where at least this many were expected from the byte's rate at
# the start of every token (its chance of never showing when it is as common after the token
# as elsewhere: e^-10)
EXPECTED_COUNT = 10.0


def first_byte_of_ids(table: Any, rows: int) -> np.ndarray:
    """`[rows]` int64: the first byte of each id of the `TokenBytes` `table`, −1 for an id that
    covers no text and for rows past the vocabulary."""
    out = np.full(rows, -1, dtype=np.int64)
    n = min(rows, table.vocab_size)
    has = table.lengths[:n] > 0
    at = np.minimum(table.offsets[:n], max(table.flat.shape[0] - 1, 0))
    out[:n] = np.where(has, table.flat[at].astype(np.int64) if table.flat.size else -1, -1)
    return out


def blocked_keys(
    sequences: Iterable[np.ndarray], first: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted int64 keys `u·256 + b`: the pairs (token u, first byte b of the next token) that
    `sequences` (token ids) never show where they are expected `EXPECTED_COUNT` times or more
    after a token seen `MIN_COUNT` times or more (module docstring); and how often each token
    is followed by one that covers text."""
    pairs = []
    for ids in sequences:
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < first.shape[0])]
        if ids.size < 2:
            continue
        u, b = ids[:-1], first[ids[1:]]
        ok = (first[u] >= 0) & (b >= 0)
        pairs.append(u[ok] * 256 + b[ok])
    if not pairs or not sum(p.size for p in pairs):
        return np.zeros(0, dtype=np.int64), np.zeros(first.shape[0], dtype=np.int64)
    keys = np.concatenate(pairs)
    seen = np.unique(keys)
    per_token = np.bincount(keys // 256, minlength=first.shape[0])
    rate = np.bincount(keys % 256, minlength=256) / keys.size
    tokens = np.nonzero(per_token >= MIN_COUNT)[0]
    expected = per_token[tokens, None] * rate[None, :] >= EXPECTED_COUNT
    u, b = np.nonzero(expected)
    candidates = tokens[u] * 256 + b
    return np.setdiff1d(candidates, seen), per_token


def build_boundaries(tok_s: Any, tok_t: Any, texts: list[str], rows_s: int, rows_t: int):
    """(`losses.Boundaries` on the CPU, a line for the run's log) from `texts`, encoded as
    training encodes a document, for models of `rows_s` and `rows_t` embedding rows."""
    import torch

    from crossdistill.losses.boundaries import Boundaries
    from crossdistill.train.auto_target import encoded_sample

    pipe, ids_s, ids_t = encoded_sample(tok_s, tok_t, texts)
    first_s = first_byte_of_ids(pipe.bytes_s, rows_s)
    first_t = first_byte_of_ids(pipe.bytes_t, rows_t)
    (blocked_s, seen_s), (blocked_t, _) = blocked_keys(ids_s, first_s), blocked_keys(ids_t, first_t)
    out = Boundaries(
        torch.from_numpy(first_t), torch.from_numpy(blocked_s), torch.from_numpy(blocked_t)
    )
    n = sum(map(len, ids_s))
    return out, describe(pipe.bytes_s, blocked_s, blocked_t, seen_s, n)


def describe(
    bytes_s: Any, blocked_s: np.ndarray, blocked_t: np.ndarray, seen_s: np.ndarray, n: int
) -> str:
    """One line for the run's log: what the counts blocked, with the student's three most
    frequent tokens (`seen_s`: how often each was seen) after which a line end never comes."""
    tokens = np.unique(blocked_s // 256).size
    line = (
        f"boundary: the student's tokenizer rules out {blocked_s.size:,} next first bytes after "
        f"{tokens:,} of its tokens, the teacher's {blocked_t.size:,}, counted on {n:,} student "
        "tokens of the training text"
    )
    if blocked_s.size == 0:
        return line + " (none: give the run more training text, or leave boundary at ignore)"
    newline = blocked_s[blocked_s % 256 == 10] // 256
    if newline.size:
        top = newline[np.argsort(-seen_s[newline], kind="stable")[:3]]
        examples = ", ".join(repr(bytes_s.token_bytes(int(u)).decode("utf-8", "replace"))
                             for u in top.tolist())  # fmt: skip
        line += f"; a line end never after {examples}, ..."
    return line

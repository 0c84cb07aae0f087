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

`boundary: marginal` adds a table of the teacher's vocabulary alone (`extension_table`): which ids
spell another id and then more, and the teacher id that starts the rest.
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


def extension_table(table: Any, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted int64 keys `t·rows + v`, int64 ids r) over the `TokenBytes` `table` of a model of
    `rows` embedding rows: every id v that spells id t and then more, and r the id that starts
    what v spells past t (the longest id spelling a prefix of it, one that is not a byte-fallback
    piece where both spell it; a pair whose rest starts with no id is left out). Ids that cover
    no text take no part."""
    pieces = table.pieces()[: min(rows, table.vocab_size)]
    by_bytes: dict[bytes, list[int]] = {}
    for i, p in enumerate(pieces):
        if p:
            by_bytes.setdefault(p, []).append(i)
    byte_piece = table.byte_piece
    first = {p: min(ids, key=lambda i: (bool(byte_piece[i]), i)) for p, ids in by_bytes.items()}
    longest = max(map(len, by_bytes), default=0)
    keys, out = [], []
    for v, p in enumerate(pieces):
        for cut in range(1, len(p)):
            owners = by_bytes.get(p[:cut])
            if owners is None:
                continue
            rest = p[cut:]
            cuts = range(min(len(rest), longest), 0, -1)
            start = next((first[rest[:n]] for n in cuts if rest[:n] in first), None)
            if start is None:  # no id spells the rest's start (a vocabulary without its bytes)
                continue
            for t in owners:
                keys.append(t * rows + v)
                out.append(start)
    keys_a, ids_a = np.asarray(keys, dtype=np.int64), np.asarray(out, dtype=np.int64)
    order = np.argsort(keys_a, kind="stable")
    return keys_a[order], ids_a[order]


def build_boundaries(
    tok_s: Any, tok_t: Any, texts: list[str], rows_s: int, rows_t: int, marginal: bool = False
):
    """(`losses.Boundaries` on the CPU, a line for the run's log) from `texts`, encoded as
    training encodes a document, for models of `rows_s` and `rows_t` embedding rows; with
    `marginal`, the teacher's `extension_table` too."""
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
    line = describe(pipe.bytes_s, blocked_s, blocked_t, seen_s, n)
    if marginal:
        keys, starts = extension_table(pipe.bytes_t, rows_t)
        out.extend_keys, out.extend_ids = torch.from_numpy(keys), torch.from_numpy(starts)
        line += f"; {keys.size:,} pairs of teacher tokens where one spells the other and more"
    return out, line


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

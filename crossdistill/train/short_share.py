"""`teachers.N.target: lookahead_split`: how a teacher token's mass splits between the student
token that spells it exactly and the student's longer tokens that start with it, counted at load
on the run's training text.

Where the text has teacher token x at a boundary of both tokenizations, the student's token there
is either x's exact student token `e(x)` (a chunk of one token on each side) or a longer one whose
first teacher piece is x (one student token over several teacher tokens). `π_x` is the share of
the first, over the same sample of the text `target: auto` reads (`auto_target.SAMPLE_BYTES`).
A token the sample holds a few times would get a share of 0 or 1 from chance alone, so each
count is drawn toward the share over all tokens: `PRIOR_COUNT` pseudo-boundaries at that share.
With `teachers.N.split_context: wide` the shares are counted on the larger sample `boundary:
condition` counts on; with `previous`, also per pair of x and the student's token before the
boundary (`pair_shares`) on that sample, each pair drawn toward x's own share. The student's last
token says much about whether the text stops after x (measured on the text alone, at the
boundaries of held-out documents, by `benchmarks/split_context.py`).
The sample is the same on every rank, so every process builds the same target.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from crossdistill.config import SplitPrior
from crossdistill.train.auto_target import aligned_sample

# pseudo-boundaries at the share over all tokens added to each token's own count: a token seen
# this often sits halfway between its own share and the overall one
PRIOR_COUNT = 4.0


def boundary_events(
    tok_s: Any,
    tok_t: Any,
    texts: list[str],
    first_piece: np.ndarray,
    teacher_of_student: np.ndarray,
) -> np.ndarray:
    """`[n, 3]` int64, one row per boundary where a teacher token x starts a chunk of one
    student token that is x's exact student token or a longer one starting with x: (x, the
    student's token before the chunk (−1: none), 1 for the exact one and 0 for a longer one),
    over `texts`. `first_piece [V_t]`: each teacher id's exact student token (−1: none);
    `teacher_of_student [V_s]`: each student id's first teacher piece (−1: none)."""
    v_t, v_s = first_piece.shape[0], teacher_of_student.shape[0]
    out = [np.zeros((0, 3), dtype=np.int64)]
    for ids_s, ids_t, chunks in aligned_sample(tok_s, tok_t, texts):
        c = np.asarray(chunks)
        if c.size == 0:
            continue
        x, s = ids_t[c[:, 2]], ids_s[c[:, 0]]
        prev = np.where(c[:, 0] > 0, ids_s[np.maximum(c[:, 0] - 1, 0)], -1)
        one_s, one_t = c[:, 1] - c[:, 0] == 1, c[:, 3] - c[:, 2] == 1
        inside = (x >= 0) & (x < v_t) & (s >= 0) & (s < v_s)
        x, s, prev, one_s, one_t = x[inside], s[inside], prev[inside], one_s[inside], one_t[inside]
        is_short = one_s & one_t & (first_piece[x] == s)
        is_longer = one_s & ~one_t & (teacher_of_student[s] == x)
        keep = is_short | is_longer
        out.append(np.stack([x[keep], prev[keep], is_short[keep]], 1).astype(np.int64))
    return np.concatenate(out)


def boundary_counts(
    tok_s: Any,
    tok_t: Any,
    texts: list[str],
    first_piece: np.ndarray,
    teacher_of_student: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Per teacher id `[V_t]`: (boundaries where the student's token is its exact one, those
    where it is a longer one starting with it), over `texts` (`boundary_events`)."""
    return counts_of(
        boundary_events(tok_s, tok_t, texts, first_piece, teacher_of_student), first_piece.shape[0]
    )


def counts_of(events: np.ndarray, v_t: int) -> tuple[np.ndarray, np.ndarray]:
    """`boundary_events`' rows as (exact, longer) counts per teacher id `[V_t]`."""
    x, short = events[:, 0], events[:, 2] == 1
    return (
        np.bincount(x[short], minlength=v_t).astype(np.int64),
        np.bincount(x[~short], minlength=v_t).astype(np.int64),
    )


def pair_shares(events: np.ndarray, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`split_context: previous`: per (student token before the chunk u, teacher token x) pair
    that `events` (`boundary_events`) hold, the sorted keys `u·V_t + x` and each pair's share
    of exact-token boundaries, drawn by `PRIOR_COUNT` boundaries toward x's own share in
    `shares [V_t]` (`short_shares`), so that a pair seen a few times keeps near it."""
    v_t = shares.shape[0]
    keys, total, short = pair_counts(events, v_t)
    toward = shares[keys % v_t] if keys.size else np.zeros(0)
    return keys, (short + PRIOR_COUNT * toward) / (total + PRIOR_COUNT)


def pair_counts(events: np.ndarray, v_t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (student token before the chunk u, teacher token x) pair that `events` hold: the
    sorted keys `u·V_t + x`, the boundaries counted and those where the student's token is x's
    exact one."""
    seen = events[events[:, 1] >= 0]
    keys, at = np.unique(seen[:, 1] * v_t + seen[:, 0], return_inverse=True)
    total = np.bincount(at, minlength=keys.shape[0])
    short = np.bincount(at, weights=seen[:, 2], minlength=keys.shape[0])
    return keys.astype(np.int64), total, short


def short_shares(
    short: np.ndarray, longer: np.ndarray, prior: SplitPrior = "boundaries"
) -> np.ndarray:
    """`π [V_t]` from `boundary_counts`: each token's share of exact-token boundaries, drawn
    by `PRIOR_COUNT` boundaries toward a share over all tokens (0.5 where the sample has none
    at all): `prior` "boundaries", the share over every boundary counted; "tokens", the mean of
    the shares of the tokens seen, each token once, so that a few frequent tokens that split
    unlike the rest (Qwen3's digits, one per token where Llama-3 writes up to three, 14% of the
    boundaries of Perl's library and nearly all of its longer ones) do not set the share of
    every token seen rarely or never (`teachers.N.split_prior`)."""
    seen = short.sum() + longer.sum()
    if not seen:
        overall = 0.5
    elif prior == "tokens":
        counted = (short + longer) > 0
        overall = float((short[counted] / (short + longer)[counted]).mean())
    else:
        overall = short.sum() / seen
    return (short + PRIOR_COUNT * overall) / (short + longer + PRIOR_COUNT)


def describe_counts(teacher: str, short: np.ndarray, longer: np.ndarray, sample_bytes: int) -> str:
    """One line for the run's log: what teacher `teacher`'s shares were counted on, so that a
    sample too small to say much shows."""
    seen = int(short.sum() + longer.sum())
    if seen == 0:
        return (
            f"warning: teacher {teacher!r}: lookahead_split found no chunk of its "
            f"{sample_bytes:,}-byte sample of the training text that a teacher token starts, so "
            "every token splits its mass 0.5 / 0.5 (give the run more training text, or name "
            "another target)"
        )
    tokens = int(((short + longer) > 0).sum())
    return (
        f"teacher {teacher!r}: lookahead_split shares counted on {seen:,} chunks of "
        f"{tokens:,} teacher tokens in a {sample_bytes:,}-byte sample of the training text; "
        f"the student's token is the exact one in {short.sum() / seen:.0%} of them"
    )

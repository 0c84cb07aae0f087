"""`teachers.N.boundary: condition`: the teacher's distribution at a KD position, conditioned on
what the student's token boundary there says about the next byte.

A KD position is a boundary of both tokenizations, but the two sides know different things
there. The teacher has read the text's bytes; the student has also read where its own last token
ends, and its tokenizer ends some tokens only where the text cannot go on in some ways. Llama-3
writes a line end after `;` as one token `;\n` (two line ends as `;\n\n`), so after its token
`;\n` the text never goes on with a line end; Mistral writes the same bytes as `;` and `<0x0A>`,
and after its `<0x0A>` a second one (a blank line) is common. The teacher's probability of a
blank line there is mass on an event the student's context rules out: a target that keeps it
teaches the student to expect a line end where its tokenizer never writes one, and the right
target is the teacher's distribution given that the next byte is not one the student's token
rules out.

Which bytes a student token rules out is counted on the training text (`train.boundaries`): the
first byte of the token after each student token u, and a byte b that never follows u where u is
seen often enough to expect it many times is blocked after u. At a KD position after student
token u and teacher token t, a top-k entry x of the teacher is dropped when x's first byte is
blocked after u and not after t (what the teacher's own tokenizer rules out, its distribution
already gives nearly nothing, and with identical tokenizers u = t, so nothing is dropped), and
never when x is the text's own next teacher token. The rest of the row, top-k and tail, is
divided by what is left: Bayes' rule for "the next byte is not a blocked one". The rows past the
KD position that the lookahead targets read (inside the chunk, and one past its end) are read as
they are: the step past the end asks exactly whether the text goes on with a longer student
token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

NEG_INF = float("-inf")
# a row keeps its teacher distribution as it is where less than this is left once the blocked
# entries are dropped (division by nearly nothing)
MIN_KEPT = 1e-6


@dataclass
class Boundaries:
    """`first_byte [V_t]` the first text byte of each teacher id (−1: none, a special token);
    `blocked_s [B_s]` sorted keys `u·256 + b`: student token u is never followed by a token whose
    first byte is b; `blocked_t [B_t]` the same over the teacher's tokenizer (`t·256 + b`)."""

    first_byte: Tensor
    blocked_s: Tensor
    blocked_t: Tensor

    def to(self, device: torch.device | str) -> Boundaries:
        return Boundaries(
            self.first_byte.to(device), self.blocked_s.to(device), self.blocked_t.to(device)
        )

    def dropped(self, before_s: Tensor, before_t: Tensor, first_t: Tensor, ids: Tensor) -> Tensor:
        """`[C, K]` bool: the teacher's top-k entries `ids [C, K]` that the student's token
        `before_s [C]` rules out after the teacher's token `before_t [C]` (−1: none), other than
        the chunk's own first teacher token `first_t [C]`."""
        ids = ids.long()
        b = self.first_byte[ids.clamp(min=0)]
        ok = (ids >= 0) & (b >= 0) & (ids != first_t.long().unsqueeze(-1))
        after_s = _has(self.blocked_s, before_s.long().unsqueeze(-1) * 256 + b)
        after_t = _has(self.blocked_t, before_t.long().unsqueeze(-1) * 256 + b)
        known = ((before_s >= 0) & (before_t >= 0)).unsqueeze(-1)
        return ok & known & after_s & ~after_t


def _has(keys: Tensor, query: Tensor) -> Tensor:
    """Whether each of `query` is one of the sorted `keys`."""
    if keys.numel() == 0:
        return torch.zeros(query.shape, dtype=torch.bool, device=query.device)
    at = torch.searchsorted(keys, query.clamp(min=0)).clamp(max=keys.numel() - 1)
    return (keys[at] == query) & (query >= 0)


def condition(
    topk_ids: Tensor, topk_logprobs: Tensor, tail_logprob: Tensor, dropped: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Rows `[C, K]` (ids, log-probs) and tails `[C]` with the `dropped [C, K]` entries taken out
    and the rest divided by what is left, re-sorted by descending probability (the top-k order
    the losses read). A dropped entry keeps a place in the row at probability 0 under the id of
    the row's first entry, so that it adds to that entry's bucket and names none of its own (a
    bucket of no teacher mass would make reverse KL infinite). A row with nothing dropped comes
    back as it was; so does one where no top-k entry would be left, or less than `MIN_KEPT` of
    the mass."""
    gone = torch.where(dropped, topk_logprobs, NEG_INF).logsumexp(-1)
    left = torch.log1p(-gone.exp().clamp(max=1.0))
    kept = (~dropped & (topk_logprobs > NEG_INF)).any(-1)
    use = dropped.any(-1) & kept & (left > math.log(MIN_KEPT))
    drop = dropped & use.unsqueeze(-1)
    shift = torch.where(use, left, 0.0)
    lp = torch.where(drop, NEG_INF, topk_logprobs - shift.unsqueeze(-1))
    tail = tail_logprob - shift
    order = lp.sort(dim=-1, descending=True, stable=True).indices
    keep = torch.arange(lp.shape[-1], device=lp.device).expand_as(order)
    order = torch.where(use.unsqueeze(-1), order, keep)
    ids, lp = topk_ids.gather(-1, order), lp.gather(-1, order)
    ids = torch.where(drop.gather(-1, order), ids[:, :1], ids)
    return ids, lp, tail


def tokens_before(chunks: Tensor, ids_s: Tensor, ids_t: Tensor) -> Tensor:
    """`[C, 3]` per chunk `(s0, s1, t0, t1)` of flattened rows: the student's token before it,
    the teacher's token before it and the teacher's first token of it, from the flattened inputs
    `ids_s [N_s]`, `ids_t [N_t]` (−1 where the chunk starts its side's rows)."""
    s0, t0 = chunks[:, 0].long(), chunks[:, 2].long()
    ok = (s0 > 0) & (t0 > 0) & (t0 < ids_t.shape[0])
    prev_s = ids_s.long()[(s0 - 1).clamp(min=0, max=ids_s.shape[0] - 1)]
    prev_t = ids_t.long()[(t0 - 1).clamp(min=0, max=ids_t.shape[0] - 1)]
    first = ids_t.long()[t0.clamp(max=ids_t.shape[0] - 1)]
    return torch.stack([prev_s, prev_t, first], -1).masked_fill(~ok.unsqueeze(-1), -1)

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

`teachers.N.boundary: marginal` also undoes what the teacher's own boundary says. The teacher's
row at a KD position is its distribution given that its last token t ended there; the student's
context does not say that. Where the text goes on with bytes that t would have swallowed (the
teacher writes `ENTRY` as one token, so after its token `ENT` an `R` never comes, while after the
student's `ENT` it may), the teacher's row has nothing for them. They are in the teacher's row
before t, the one that predicted t: each of its top-k entries v that spells t and then more is
the text going on past the KD position without a teacher boundary there. With a the probability
of t in that row and e_v those of such v, the teacher's distribution of the text after the KD
position, given the bytes and not its boundary, is the KD row times a / (a + Σ e_v) plus each
v's remainder at e_v / (a + Σ e_v); a remainder enters the row as the teacher token that starts
it (`extend_ids`), added to that token's entry when the row has one. Other ways the teacher
could have written the bytes of t (over several shorter tokens) are left out. What the
student's token u rules out is left out of the continuations before they are weighed: a
remainder whose first byte is blocked after u, and one that the student would have written
together with u (a student token spells u then the remainder's first teacher token: after the
student's `G` the text does not go on as `GET`, which the student writes as one token). The
student's condition then applies to the row as under `condition`.
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
# `marginal`: the most continuations past the teacher's token that enter a KD row; the row before
# gives the rest, if any, to the tail
MAX_EXTENSIONS = 8


@dataclass
class Boundaries:
    """`first_byte [V_t]` the first text byte of each teacher id (−1: none, a special token);
    `blocked_s [B_s]` sorted keys `u·256 + b`: student token u is never followed by a token whose
    first byte is b; `blocked_t [B_t]` the same over the teacher's tokenizer (`t·256 + b`).
    `marginal`: `extend_keys [E]` sorted keys `t·V_t + v` (V_t = `first_byte`'s length) of the
    teacher ids v that spell teacher id t and then more, and `extend_ids [E]` the teacher id
    that starts each one's remainder; None under `condition`."""

    first_byte: Tensor
    blocked_s: Tensor
    blocked_t: Tensor
    extend_keys: Tensor | None = None
    extend_ids: Tensor | None = None

    @property
    def marginal(self) -> bool:
        """Whether the KD rows take in the teacher's continuations past its token (`marginal`)."""
        return self.extend_keys is not None

    def to(self, device: torch.device | str) -> Boundaries:
        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return Boundaries(
            self.first_byte.to(device),
            self.blocked_s.to(device),
            self.blocked_t.to(device),
            move(self.extend_keys),
            move(self.extend_ids),
        )

    def dropped(self, before_s: Tensor, before_t: Tensor, first_t: Tensor, ids: Tensor) -> Tensor:
        """`[C, K]` bool: the teacher's top-k entries `ids [C, K]` that the student's token
        `before_s [C]` rules out after the teacher's token `before_t [C]` (−1: none), other than
        the chunk's own first teacher token `first_t [C]`."""
        ids = ids.long()
        b = self.first_byte[ids.clamp(min=0)]
        ok = (ids >= 0) & (b >= 0) & (ids != first_t.long().unsqueeze(-1))
        after_s = self.blocked_after(before_s, ids)
        after_t = _has(self.blocked_t, before_t.long().unsqueeze(-1) * 256 + b)
        known = ((before_s >= 0) & (before_t >= 0)).unsqueeze(-1)
        return ok & known & after_s & ~after_t

    def blocked_after(self, before_s: Tensor, ids: Tensor) -> Tensor:
        """`[C, K]` bool: whether the first byte of teacher id `ids [C, K]` is blocked after
        the student's token `before_s [C]`."""
        b = self.first_byte[ids.long().clamp(min=0)]
        return _has(self.blocked_s, before_s.long().unsqueeze(-1) * 256 + b) & (b >= 0)

    def extension_ids(self, before_t: Tensor, ids: Tensor) -> Tensor:
        """`[C, K]` for the entries `ids [C, K]` of the row that predicted the teacher's token
        `before_t [C]`: the teacher id that starts what an entry spells past that token, where it
        spells the token and then more; −1 elsewhere."""
        assert self.extend_keys is not None and self.extend_ids is not None
        ids = ids.long()
        if self.extend_keys.numel() == 0:
            return torch.full_like(ids, -1)
        query = before_t.long().unsqueeze(-1) * self.first_byte.shape[0] + ids
        query = torch.where((ids >= 0) & (before_t >= 0).unsqueeze(-1), query, -1)
        at = torch.searchsorted(self.extend_keys, query.clamp(min=0))
        at = at.clamp(max=self.extend_keys.numel() - 1)
        return torch.where(_has(self.extend_keys, query), self.extend_ids[at].long(), -1)


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


def marginalise(
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    tail_logprob: Tensor,
    extension: Tensor,
    prior_logprobs: Tensor,
    before_logprob: Tensor,
    first_t: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """KD rows `[C, K]` (ids, log-probs) and tails `[C]` that take in the teacher's
    continuations past its token before the chunk (module docstring, `marginal`): `extension
    [C, K]` the teacher id that starts each continuation of the row before, −1 for an entry that
    is none (`Boundaries.extension_ids`); `prior_logprobs [C, K]` that row's log-probs;
    `before_logprob [C]` the log-prob there of the token before the chunk (−inf: unknown, the
    row is left as it is). The `MAX_EXTENSIONS` largest continuations enter the row, each added
    to the entry of its id where the row has one, else in a slot of its own; the smallest
    entries that no longer fit in K go to the tail, never the chunk's own first teacher token
    `first_t [C]`. Rows come back sorted by descending probability; a row with no continuation
    comes back as it was."""
    c, k = topk_ids.shape
    m = min(MAX_EXTENSIONS, k)
    ext = torch.where(extension >= 0, prior_logprobs, NEG_INF)
    e_all = ext.logsumexp(-1)
    e_top, at = ext.topk(m, dim=-1)
    e_ids = extension.gather(-1, at).long()
    # what the continuations past the `m` largest hold goes to the tail
    rest = e_all + torch.log1p(-(e_top.logsumexp(-1) - e_all).exp().clamp(max=1.0))
    use = (e_all > NEG_INF) & (before_logprob > NEG_INF)
    z = torch.logaddexp(before_logprob, e_all)
    scale = torch.where(use, before_logprob - z, 0.0).unsqueeze(-1)
    lp, tail = topk_logprobs + scale, tail_logprob + scale.squeeze(-1)
    e_top = torch.where(e_top > NEG_INF, e_top - z.unsqueeze(-1), NEG_INF)
    # continuations with the same id add up in the first of them
    same = e_ids.unsqueeze(-1) == e_ids.unsqueeze(-2)  # [C, m, m]
    owner = same.int().argmax(-1)  # the first continuation with each one's id
    mine = owner.unsqueeze(-2) == torch.arange(m, device=lp.device).view(1, m, 1)
    e_top = torch.where(mine, e_top.unsqueeze(-2), NEG_INF).logsumexp(-1)
    # ... and into the row's entry of that id
    ids = topk_ids.long()
    match = (e_ids.unsqueeze(-1) == ids.unsqueeze(-2)) & (lp.unsqueeze(-2) > NEG_INF)
    lp = torch.logaddexp(lp, torch.where(match, e_top.unsqueeze(-1), NEG_INF).logsumexp(-2))
    e_top = torch.where(match.any(-1), NEG_INF, e_top)
    e_ids = torch.where(e_top > NEG_INF, e_ids, ids[:, :1])
    # the K most likely of both, the text's own token kept; the rest to the tail
    all_lp, all_ids = torch.cat([lp, e_top], -1), torch.cat([ids, e_ids], -1)
    own = all_ids == first_t.long().unsqueeze(-1)
    key = torch.where(own & (all_lp > NEG_INF), math.inf, all_lp)
    keep = key.topk(k, dim=-1).indices
    gone = torch.ones_like(all_lp, dtype=torch.bool).scatter_(-1, keep, False)
    rest = torch.where(e_all > NEG_INF, rest - z, NEG_INF)
    out_tail = torch.stack(
        [tail, rest, torch.where(gone, all_lp, NEG_INF).logsumexp(-1)], -1
    ).logsumexp(-1)
    kept_lp, kept_ids = all_lp.gather(-1, keep), all_ids.gather(-1, keep)
    order = kept_lp.sort(dim=-1, descending=True, stable=True).indices
    kept_lp, kept_ids = kept_lp.gather(-1, order), kept_ids.gather(-1, order)
    u = use.unsqueeze(-1)
    return (
        torch.where(u, kept_ids, ids).to(topk_ids.dtype),
        torch.where(u, kept_lp, topk_logprobs),
        torch.where(use, out_tail, tail_logprob),
    )


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

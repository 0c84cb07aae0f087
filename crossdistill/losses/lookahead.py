"""The lookahead target: what the teacher says at its later positions inside a student token.

Where a chunk is one student token over m > 1 teacher tokens `t_0 … t_{m−1}` (the student's
token runs past the teacher's first one), the first-piece target gives the teacher's mass of
`t_0` to `t_0`'s first student piece, and the context target gives the part that continues to
the student's observed token to that token. Both ignore what the teacher predicts at positions
1 … m − 1 along the observed path, where it says how the text goes on after `t_0`: after Llama-2's
`.`, how likely `append`, `get`, `items` are — which are Llama-3's `.append`, `.get`, `.items`.

The lookahead target follows the observed path for up to D − 1 more teacher positions. With
`a_d` the student token spelling `t_0 … t_{d−1}` (`a_1` the exact student match of `t_0`,
`a_{d+1}` the join of `a_d` and `t_d`; the path stops where there is none) and `M_d` the
teacher's probability of that prefix, depth d's top-k entry x ≠ `t_d` gets `M_d·p_d(x)` on the
student token spelling `a_d` then x (`Joins`), or on `a_d` where the student has none; its tail
`M_d·tail_d` joins the tail; `t_d` carries `M_{d+1}` to the next depth. Where the path ends at
the chunk's end, `M_m` goes to the student's observed token; where it stops earlier (depth
limit, no student prefix token), `M_S` splits as the context target does: `M_S·r` to the
observed token (r: the teacher's τ = 1 probability of the rest of the chunk), `M_S·(1 − r)` to
the last prefix token. Depth 0 keeps the first-piece entries for every x ≠ `t_0`. Nothing is
dropped: the buckets and the tail still sum to the teacher's total. A chunk that does not
expand (one teacher token, or no student token for `t_0`) gets the context target.

`lookahead_end` also reads one teacher position past the student token's end, at chunks of one
or more teacher tokens alike, where the path reaches the student's observed token s before the
depth limit. The mass `M` that reached s is the teacher's probability of s's bytes, and part of
it is text the student would spell with a longer token: after Llama-2's ` get`, the teacher's
`attr` makes Llama-3's ` getattr`. That part, `M·p(x)` for every top-k entry x where the student
has a token spelling s then x (the text's own next token included), goes to that token; s keeps
the rest (the other entries and the tail). Without it, every student token that extends a
teacher token is short of that mass at every position.

Under `teachers.N.past_end: canonical` the end step moves nothing for an x that the teacher's
own tokenizer joins with the chunk's last teacher token t into one token (`teacher_joins`): the
teacher writes t·x as one token, so where it reads t then x it is on a split it never saw, and
its `p(x)` there is not the text going on. A small teacher gives such splits mass all the same
(Qwen3's teachers of `bench quality`'s cpu scale: `benchmarks/target_fidelity.py`), which the
plain end step hands to the student's longer token: 1.7% of the mass after a one-to-one chunk
of Perl's text, too little to move its students (under 0.03%; benchmarks/README.md, "The step
past the end on a split the teacher never writes"), so it is an option, off by default. With
identical tokenizers every such x is one the teacher joins, so the step moves nothing.

Under `teachers.N.many_chunks: path` a chunk of several tokens on both sides is read the same
way up to where its first student token ends. There the two sides' first tokens end at
different bytes: the student's first token s ends inside some teacher token `t_j`, and the
text says that the student wrote s where the teacher wrote `t_0 … t_j`. Where j ≥ 1 (s runs
past the teacher's first token, as Llama-3's `_color` over Mistral's `_` and `colors`) the path
goes down `t_0 … t_j` as for a chunk of one student token over j + 1 teacher tokens, and the
mass that reaches `t_j` goes to s. Where j = 0 (s is shorter than `t_0`, as Llama-3's ` allo`
under Mistral's ` alloc`) `t_0`'s whole mass goes to s (the context target's split with
nothing left to read). The first-piece buckets this replaces give `t_0`'s mass to the student
token spelling `t_0` or its first piece (`_`, ` alloc`), which the text does not have there,
and leave s in the tail. No step past the end follows: the teacher's next position is past
`t_j`, inside the student's next token. `plan.first_token_ends` finds j from the tokens' byte
lengths.

Under `teachers.N.deep_alternatives: longest` an alternative x ≠ `t_d` at depth d ≥ 1 whose
bytes after `a_d`'s make no student token goes to the longest student token spelling `a_d` then
the start of x (`Extensions`), where there is one, instead of to `a_d`: where the text is `a_d`
then x, longest-match tokenisation would write such a token first. After ` set` (a token of
both Llama-3 and Mistral), Mistral's `Types` makes no Llama-3 token ` setTypes`; `join` gives
its mass to ` set`, `longest` to ` setType`. Where `a_d` then the whole of x is a student token,
both give it that token. Llama-3's own BPE writes ` set` + `Types`, and on C headers `longest`
moved the target away from a same-tokenizer teacher (`benchmarks/README.md`, "A lookahead
alternative past the first teacher token to the student's longest token"), so `join` is the
default and `longest` an option to rerun that comparison.

`lookahead_prefix` keeps the lookahead target along the observed path and changes where the
KD position's other entries go. The first piece gives an alternative x ≠ `t_0` whole to the
student token spelling x, though `p(x)` also covers the student's longer tokens that start with
x (Llama-2's ` get` covers Llama-3's ` getattr`, ` getter`, …), and the teacher never read the
text after x to say how it splits. Here x's mass goes to the group of student tokens whose
first teacher piece is x (`PrefixGroups`, as the prefix target), compared with the student's
total over that group: the teacher sets the group's share and the student keeps its own split
inside it. A group never holds the row's single-token buckets; an alternative whose group
would (its event is one of theirs) sends its mass to the tail, so buckets stay disjoint.

`lookahead_prefix_end` is both: the KD position's alternatives in their groups, and the mass
that reached the observed token split past its end. The end step's longer tokens are
single-token buckets of the row, so a group that holds one of them sends its mass to the tail.

`lookahead_longer` is `lookahead_prefix_end` where the chunk is one student token over several
teacher tokens, and `lookahead` everywhere else. The groups and the step past the end change
the target at one-to-one chunks too: there the student's token is the teacher's, the first
piece is exact, and the groups only widen the other entries' buckets and the end step only
moves the observed token's mass to longer student tokens. This target keeps them where the
student's token is the longer one, which the first piece and `lookahead` serve worst. It did not
do better than `lookahead_prefix_end` (`benchmarks/README.md`, "`lookahead_longer`"): the
student's mass is shared between its short and long tokens, so what a target does at one kind of
chunk moves its predictions at the other. It stays to rerun that comparison.

`lookahead_mix` is the two targets past the end side by side: the `lookahead_end` divergence and
the `lookahead_prefix_end` divergence, each at half the teacher's weight, from one teacher pass.
The first gives each alternative x ≠ `t_0` whole to the student token spelling x; the second to
x's group, where the student keeps its own split. At half weight each, the student's split of
that mass between x and the longer tokens that start with it settles between the two. On the far pair `lookahead_end` closed more of the one-to-one chunks and
`lookahead_prefix_end` more of the longer ones, and both at once (as two teacher terms) did
better in total than either (`benchmarks/README.md`, "Both targets at once").

`lookahead_split` is `lookahead_prefix_end` with the split set from the text instead of left to
the student. An alternative x ≠ `t_0` with an exact student token `e(x)` gives `π_x·p(x)` to
`e(x)` and `(1 − π_x)·p(x)` to the group of the student's longer tokens that start with x
(`e(x)` left out). `π_x` is how often, where the training text has the teacher token x at a
boundary of both tokenizations, the student's token there is `e(x)` rather than a longer one of
x's group (`train.short_share`, counted at load, each token's count drawn toward the share over
all tokens where it is seen little). `lookahead_end` gives all of x's mass to `e(x)` and
`lookahead_prefix_end` lets the student split it; on the far pair the first closed more of the
one-to-one chunks and the second more of the longer ones, and no fixed mix of the two was better
on every corpus (`benchmarks/README.md`, "`lookahead_mix` where the bench accepts the far
pair"). An x whose exact token starts no longer student token has no group and goes whole to
`e(x)`; one without an exact token goes whole to its group. On the far pair it was ahead of
`lookahead_prefix_end` in the one-to-one chunks, and at the quality bar on three corpora where
`lookahead_prefix_end` was not (`benchmarks/README.md`, "`lookahead_split`" and "`lookahead_split`
on a third corpus"), so `target: auto` takes it for far pairs.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from crossdistill.errors import UserError
from crossdistill.losses.projection import (
    Buckets,
    Continuation,
    PrefixGroups,
    VocabProjection,
    merge_buckets,
    topk_entries,
)

NEG_INF = float("-inf")


def _log_add(a: Tensor, b: Tensor) -> Tensor:
    """log(e^a + e^b), −inf when both are (logaddexp of two −inf is nan on some builds)."""
    both = (a == NEG_INF) & (b == NEG_INF)
    return torch.where(both, NEG_INF, torch.logaddexp(a, b))


def _log1m_exp(x: Tensor) -> Tensor:
    """log(1 − e^x) for x ≤ 0 (−inf at x = 0)."""
    return torch.log1p(-x.clamp(max=0.0).exp())


def prefix_chain(observed: Tensor, projection: VocabProjection, depth: int) -> Tensor:
    """`[C, depth + 1]` the student token spelling the first d observed teacher tokens of each
    chunk (column d; column 0 is −1), −1 from where there is none."""
    if projection.exact is None or projection.joins is None:
        raise UserError(
            "the lookahead target needs the projection's exact matches and its join table; "
            "build the projection with train.build.build_projection_for (target lookahead)"
        )
    obs = observed.long()
    t0 = obs[:, 0].clamp(min=0)
    a = torch.where((obs[:, 0] >= 0) & projection.exact[t0], projection.first_piece[t0], -1)
    chain = [torch.full_like(a, -1), a]
    for d in range(1, depth):
        x = obs[:, d] if d < obs.shape[1] else torch.full_like(a, -1)
        chain.append(projection.joins.lookup(chain[-1], x))
    return torch.stack(chain, -1)


def project_lookahead(
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    tail_logprob: Tensor,
    projection: VocabProjection,
    continuation: Continuation,
    observed: Tensor,
    length: Tensor,
    log_rest: Tensor,
    single: Tensor | None = None,
    groups: PrefixGroups | None = None,
    only: Tensor | None = None,
    previous: Tensor | None = None,
) -> Buckets:
    """The lookahead target's buckets `[C, L]` (module docstring).

    `topk_* [C, D, K]`, `tail_logprob [C, D]`: the teacher's top-k at each chunk's KD position
    (depth 0) and the D − 1 positions after it; `observed [C, D]` the chunk's teacher tokens
    (−1 past its end or where the target does not apply); `length [C]` its teacher tokens, at
    a chunk of several student tokens those up to the one crossing the end of the first
    (`plan.first_token_ends`);
    `log_rest [C, D + 1]` at τ = 1, column d: the log-probability of the chunk's teacher tokens
    from `t_d` to its end (0 past it); `continuation` as for the context target. `single [C]`
    (`lookahead_end`, `lookahead_prefix_end`): chunks of one student token; the rows past a
    chunk's last teacher token then hold the teacher's top-k at the position after it. `groups`
    (`lookahead_prefix`, `lookahead_prefix_end`): the KD position's entries other than the
    chunk's first teacher token go to their groups, from column `group_from` of the buckets on.
    `only [C]` (`lookahead_longer`): the chunks that take `single` and `groups`; the others get
    the lookahead target. `previous [C]` (`split_context: previous`): the student's token before
    each chunk (−1: none), which picks `lookahead_split`'s share from the groups' pair table."""
    depth = topk_ids.shape[1]
    ids, lp, obs = topk_ids.long(), topk_logprobs, observed.long()
    chain = prefix_chain(obs, projection, depth)
    label = continuation.label.long()
    ok = (label >= 0) & (chain[:, 1] >= 0) & (depth > 1)
    start = continuation.active & ok & (length > 1)
    past_end = single is not None
    if past_end and only is not None:
        single = single & only
    if past_end:  # a chunk of one token on each side starts its path at its end
        start = start | (single & ok & (length == 1) & (chain[:, 1] == label))
    hit0 = (ids[:, 0] == obs[:, :1]) & start.unsqueeze(-1)
    expand = hit0.any(-1)
    cont0 = dataclasses.replace(continuation, active=continuation.active & ~expand)
    grouped, drop, short = None, hit0, ([], [])
    if groups is not None:
        grouped, alt = _alternatives(ids[:, 0], lp[:, 0], obs[:, :1], groups, only)
        drop = hit0 | alt
        if groups.short_logshare is not None:  # lookahead_split
            grouped, short_ids, short_logq = _split_off_short(
                ids[:, 0], alt, grouped, projection, groups, previous
            )
            short = ([short_ids], [short_logq])
    flat, flat_logq, tail = topk_entries(
        ids[:, 0], lp[:, 0], tail_logprob[:, 0], projection, cont0, drop=drop
    )
    entries, values = [flat, *short[0]], [flat_logq, *short[1]]
    mass = torch.where(expand, torch.where(hit0, lp[:, 0], NEG_INF).logsumexp(-1), NEG_INF)
    ending = torch.where(expand & (length == 1), mass, NEG_INF)  # at the token's end
    live = expand & (length > 1)
    mass = torch.where(live, mass, NEG_INF)
    deeper = projection.joins if projection.extensions is None else projection.extensions
    for d in range(1, depth):
        if past_end:
            last = obs[:, d - 1]  # the chunk's last teacher token, where `ending` holds mass
            ending = _end_step(
                ending, label, last, ids[:, d], lp[:, d], projection, entries, values
            )
        a_d, a_next = chain[:, d], chain[:, d + 1]
        is_obs = (ids[:, d] == obs[:, d : d + 1]) & (obs[:, d : d + 1] >= 0)
        joined = deeper.lookup(a_d.unsqueeze(-1), ids[:, d])
        alt = torch.where(live.unsqueeze(-1) & ~is_obs, mass.unsqueeze(-1) + lp[:, d], NEG_INF)
        entries.append(
            torch.where(alt > NEG_INF, torch.where(joined >= 0, joined, a_d[:, None]), -1)
        )
        values.append(alt)
        tail = _log_add(tail, torch.where(live, mass + tail_logprob[:, d], NEG_INF))
        reached = torch.where(is_obs, lp[:, d], NEG_INF).logsumexp(-1) + mass
        reached = torch.where(live, reached, NEG_INF)
        at_end = length <= d + 1
        go_on = (reached > NEG_INF) & ~at_end & (d + 1 < depth) & (a_next >= 0)
        stop = (reached > NEG_INF) & ~go_on
        # ends at the next depth: a chunk of one student token, whose end is the teacher's
        wait = stop & at_end & past_end & (d + 1 < depth)
        if past_end:
            wait = wait & single
        ending = torch.where(wait, reached, ending)
        stop = stop & ~wait
        rest = torch.where(at_end, 0.0, log_rest[:, d + 1].to(lp.dtype).clamp(max=0.0))
        to_label = torch.where(stop, reached + rest, NEG_INF)
        to_prefix = torch.where(stop & ~at_end, reached + _log1m_exp(rest), NEG_INF)
        prefix = torch.where(a_next >= 0, a_next, a_d)
        entries += [torch.where(to_label > NEG_INF, label, -1).unsqueeze(-1)]
        entries += [torch.where(to_prefix > NEG_INF, prefix, -1).unsqueeze(-1)]
        values += [to_label.unsqueeze(-1), to_prefix.unsqueeze(-1)]
        mass, live = torch.where(go_on, reached, NEG_INF), go_on
    entries, values = torch.cat(entries, -1), torch.cat(values, -1)
    # an entry without mass (the observed token's, moved along the path) names no bucket: a
    # bucket of zero teacher mass would make reverse KL infinite where the student's token has
    # any, and would take that token out of its group or the tail
    entries = torch.where(values > NEG_INF, entries, -1)
    if grouped is None:
        return merge_buckets(entries, values, tail, projection.num_student)
    singles = merge_buckets(entries, values, tail, projection.num_student)
    return _with_groups(singles, entries, *grouped, groups)


def _alternatives(
    ids: Tensor, lp: Tensor, first: Tensor, groups: PrefixGroups, only: Tensor | None
) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """The KD position's top-k entries `ids [C, K]` other than the chunk's first teacher token
    `first [C, 1]` that have an event, at the chunks `only [C]` (None: all): (their events, −1
    elsewhere; their log-probs), and the mask of those entries."""
    event = groups.teacher_event.first_piece[ids.clamp(min=0)]
    alt = (ids != first) & (ids >= 0) & (event >= 0)
    if only is not None:
        alt = alt & only.unsqueeze(-1)
    return (torch.where(alt, event, -1), torch.where(alt, lp, NEG_INF)), alt


def _split_off_short(
    ids: Tensor,
    alt: Tensor,
    grouped: tuple[Tensor, Tensor],
    projection: VocabProjection,
    groups: PrefixGroups,
    previous: Tensor | None = None,
) -> tuple[tuple[Tensor, Tensor], Tensor, Tensor]:
    """`lookahead_split`: of each alternative's mass (`grouped`: its event and log-probability,
    at the entries `alt [C, K]`), the share of its teacher id (`groups.logshare`, after the
    student's token `previous [C]` where given) goes to the student token spelling it exactly,
    the rest stays with its group. Returns the groups' (events, −1 where no mass is left;
    log-probabilities), the exact tokens `[C, K]` and their log-probabilities (−1 and −inf
    where an alternative has none)."""
    event, logq = grouped
    x = ids.long().clamp(min=0)
    exact = alt & projection.exact[x]
    share = groups.logshare(x, previous).to(logq.dtype)
    to_short = torch.where(exact, logq + share, NEG_INF)
    to_group = torch.where(exact, logq + _log1m_exp(share), logq)
    event = torch.where(to_group > NEG_INF, event, -1)
    short_ids = torch.where(to_short > NEG_INF, projection.first_piece[x], -1)
    return (event, to_group), short_ids, to_short


def _with_groups(
    singles: Buckets, entries: Tensor, event: Tensor, logq: Tensor, groups: PrefixGroups
) -> Buckets:
    """`singles` followed by group buckets of the entries `event [C, K]` (−1: none) with mass
    `logq`; an entry whose event is that of one of the row's single-token `entries [C, L]`
    (−1: none) joins the tail instead, so that no group holds a single."""
    n = groups.num_events
    own = groups.student_event[entries.clamp(min=0)]
    own = torch.where(entries >= 0, own, n + 1).sort(-1).values
    at = torch.searchsorted(own, event.clamp(min=0)).clamp(max=own.shape[-1] - 1)
    clash = (own.gather(-1, at) == event) & (event >= 0)
    tail = _log_add(singles.logq_tail, torch.where(clash, logq, NEG_INF).logsumexp(-1))
    group = merge_buckets(torch.where(clash, -1, event), logq, tail, n)
    return Buckets(
        ids=torch.cat([singles.ids, group.ids], -1),
        logq=torch.cat([singles.logq, group.logq], -1),
        valid=torch.cat([singles.valid, group.valid], -1),
        logq_tail=tail,
        group_from=singles.ids.shape[-1],
    )


def _end_step(
    ending: Tensor,
    label: Tensor,
    last: Tensor,
    ids: Tensor,
    lp: Tensor,
    projection: VocabProjection,
    entries: list[Tensor],
    values: list[Tensor],
) -> Tensor:
    """`lookahead_end` at one depth: the mass `ending [C]` that reached the observed student
    token `label` one position earlier moves `ending·p(x)` to the student token spelling label
    then x, for every top-k entry x `[C, K]` with one; the label keeps the rest. With the
    projection's `teacher_joins` (`past_end: canonical`), an x that the teacher's tokenizer
    joins with the chunk's last teacher token `last [C]` into one token does not move: the
    teacher never writes that split, so its mass there is not the text going on. Appends the
    entries and returns a fresh `ending` (nothing waits past this depth)."""
    joined = projection.joins.lookup(label.unsqueeze(-1), ids)
    move = (ending > NEG_INF).unsqueeze(-1) & (joined >= 0) & (lp > NEG_INF)
    if projection.teacher_joins is not None:
        move = move & (projection.teacher_joins.lookup(last.unsqueeze(-1), ids) < 0)
    entries.append(torch.where(move, joined, -1))
    values.append(torch.where(move, ending.unsqueeze(-1) + lp, NEG_INF))
    kept = ending + _log1m_exp(torch.where(move, lp, NEG_INF).logsumexp(-1))
    entries.append(torch.where(kept > NEG_INF, label, -1).unsqueeze(-1))
    values.append(kept.unsqueeze(-1))
    return torch.full_like(ending, NEG_INF)

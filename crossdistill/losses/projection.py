"""Teacher top-k targets projected onto the student vocabulary, as buckets.

A `VocabProjection` is the sparse `[V_t, V_s]` matrix of the design, stored as a padded table:
each teacher id has up to P student pieces with weights that sum to 1. The default first-piece
projection has P = 1; a teacher id without any student piece (−1) sends its probability to the
**tail** bucket, so the projected target stays a proper distribution (nothing is dropped).

`project_topk` turns `[M, K]` teacher top-k log-probs into `[M, B]` student buckets (B = K·P),
merging teacher ids that land on the same student id, plus the tail `[M]`.

`PrefixGroups` is the byte-prefix target's view instead: every student token belongs to the
teacher token its bytes start with (its first teacher piece), so a teacher token is an event,
"the text goes on with these bytes", that a group of student tokens shares. A bucket is then a
group of student tokens; the student's probability of it is the group's total.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from crossdistill.errors import UserError
from crossdistill.losses.boundaries import Boundaries

NEG_INF = float("-inf")


@dataclass
class VocabProjection:
    """Teacher → student vocabulary map: `pieces [V_t, P]` student ids (−1 = none) with
    `weights [V_t, P]` (rows sum to 1 over their pieces); `exact [V_t]` marks teacher tokens whose
    first piece is the whole token (needed by `gold` only); `matched [V_t]` is the `hkl` loss's
    one-to-one pairing of teacher and student tokens (student id, −1 = none;
    `alignment.projection.relaxed_matches`)."""

    pieces: Tensor
    weights: Tensor
    num_student: int
    exact: Tensor | None = None
    groups: PrefixGroups | None = None  # the byte-prefix target's groups (`teachers.N.target`)
    joins: Joins | None = None  # the lookahead target's table (`teachers.N.target`)
    matched: Tensor | None = None
    # `teachers.N.past_end: canonical`: the teacher tokens that join into one teacher token
    # (`Joins` over the teacher's vocabulary on both sides); the step past a student token's end
    # moves no mass of a continuation the teacher's tokenizer would have joined to its last token
    teacher_joins: Joins | None = None
    # `teachers.N.many_chunks: path`: the bytes each token covers, to find the teacher token that
    # crosses the end of the student's first token in a chunk of several tokens on both sides
    byte_lengths: ByteLengths | None = None
    # `teachers.N.deep_alternatives: longest`: where the lookahead target's alternatives past the
    # first teacher token go, the student's longest token over the path so far and their start
    extensions: Extensions | None = None
    # `teachers.N.boundary: condition`: the next first bytes each student and teacher token rules
    # out after it, and each teacher token's first byte (`losses.boundaries`)
    boundaries: Boundaries | None = None

    @classmethod
    def identity(cls, vocab: int, device: torch.device | str | None = None) -> VocabProjection:
        """Identical tokenizers: every token maps to itself, exactly."""
        ids = torch.arange(vocab, device=device)
        out = cls.from_first_piece(
            ids, vocab, exact=torch.ones(vocab, dtype=torch.bool, device=device)
        )
        out.matched = ids
        return out

    @classmethod
    def from_first_piece(
        cls, first_piece: Tensor, num_student: int, exact: Tensor | None = None
    ) -> VocabProjection:
        """The default projection: `first_piece [V_t]` student id per teacher id, −1 = none."""
        pieces = first_piece.long().unsqueeze(1)
        return cls(pieces, (pieces >= 0).float(), num_student, exact)

    @classmethod
    def from_sparse(
        cls,
        rows: Tensor,
        cols: Tensor,
        weights: Tensor,
        num_teacher: int,
        num_student: int,
        exact: Tensor | None = None,
    ) -> VocabProjection:
        """A multi-piece projection from COO entries `(rows, cols, weights)` `[E]`. Built once
        per run: finding the widest row reads one number back from the device."""
        rows, cols = rows.long(), cols.long()
        order = torch.argsort(rows * num_student + cols)
        rows, cols, weights = rows[order], cols[order], weights[order].float()
        counts = torch.bincount(rows, minlength=num_teacher)
        width = max(int(counts.max()), 1) if rows.numel() else 1
        start = torch.cumsum(counts, 0) - counts
        slot = torch.arange(rows.numel(), device=rows.device) - start[rows]
        pieces = torch.full((num_teacher, width), -1, dtype=torch.long, device=rows.device)
        table = torch.zeros(num_teacher, width, device=rows.device)
        pieces[rows, slot] = cols
        table[rows, slot] = weights
        return cls(pieces, table, num_student, exact)

    @property
    def first_piece(self) -> Tensor:
        """`[V_t]` the first student piece of each teacher id (−1 = none)."""
        return self.pieces[:, 0]

    def exact_only(self) -> VocabProjection:
        """Only the exact-string matches, each to its single student token (for `gold`)."""
        if self.exact is None:
            raise UserError(
                "the gold loss needs to know which teacher tokens match a student token exactly; "
                "build the vocabulary projection with its `exact` flags"
            )
        first = torch.where(self.exact, self.first_piece, -1)
        return VocabProjection.from_first_piece(first, self.num_student, self.exact)

    def matched_only(self) -> VocabProjection:
        """Only the `hkl` loss's pairs, each teacher token to its one student token; `exact`
        marks the paired teacher tokens."""
        if self.matched is None:
            raise UserError(
                "the hkl loss pairs teacher and student tokens one to one; build the vocabulary "
                "projection with its `matched` pairs (alignment.projection.relaxed_matches)"
            )
        return VocabProjection.from_first_piece(self.matched, self.num_student, self.matched >= 0)

    def images(self) -> Tensor:
        """`[V_s]` bool: student tokens that are the first piece of some teacher token (of a
        one-piece map such as `exact_only()` or `matched_only()`: the common vocabulary)."""
        first = self.first_piece
        marks = torch.zeros(self.num_student + 1, dtype=torch.bool, device=first.device)
        marks[torch.where(first >= 0, first, self.num_student)] = True
        return marks[: self.num_student]

    def common_student(self) -> Tensor:
        """`[V_s]` bool: student tokens that are the exact image of some teacher token."""
        return self.exact_only().images()

    def to(self, device: torch.device | str) -> VocabProjection:
        def move(x):
            return None if x is None else x.to(device)

        return VocabProjection(
            self.pieces.to(device),
            self.weights.to(device),
            self.num_student,
            move(self.exact),
            move(self.groups),
            move(self.joins),
            move(self.matched),
            move(self.teacher_joins),
            move(self.byte_lengths),
            move(self.extensions),
            move(self.boundaries),
        )


@dataclass
class ByteLengths:
    """The number of text bytes each token id covers, `teacher [V_t]` and `student [V_s]` (0 for
    special tokens and rows a tokenizer never produces)."""

    teacher: Tensor
    student: Tensor

    def to(self, device: torch.device | str) -> ByteLengths:
        return ByteLengths(self.teacher.to(device), self.student.to(device))


@dataclass
class Joins:
    """Student tokens as a known student token followed by a teacher token, for the lookahead
    target: `keys [J]` sorted `a·num_teacher + x`, `values [J]` the student token whose bytes are
    student token a's followed by teacher token x's."""

    keys: Tensor
    values: Tensor
    num_teacher: int

    @classmethod
    def from_rows(cls, rows: Tensor, num_teacher: int, num_student: int) -> Joins:
        """From `(a, x, v)` rows `[J, 3]` (`alignment.projection.build_joins`); rows naming ids
        the models do not have (`a`, `v` ≥ `num_student`, `x` ≥ `num_teacher`) are dropped."""
        a, x, v = rows.long().unbind(-1)
        keep = (a < num_student) & (v < num_student) & (x < num_teacher)
        keys = a[keep] * num_teacher + x[keep]
        keys, order = keys.sort(stable=True)
        return cls(keys, v[keep][order], num_teacher)

    def lookup(self, a: Tensor, x: Tensor) -> Tensor:
        """The student token spelling `a` then `x` (broadcast), −1 where there is none."""
        if self.keys.numel() == 0:
            return torch.full(torch.broadcast_shapes(a.shape, x.shape), -1, device=a.device)
        key = a.long() * self.num_teacher + x.long()
        at = torch.searchsorted(self.keys, key).clamp(max=self.keys.numel() - 1)
        found = (self.keys[at] == key) & (a >= 0) & (x >= 0)
        return torch.where(found, self.values[at], -1)

    def to(self, device: torch.device | str) -> Joins:
        return Joins(self.keys.to(device), self.values.to(device), self.num_teacher)


@dataclass
class Extensions:
    """The student token the student writes first where the text is a known student token a
    followed by a teacher token x, for `teachers.N.deep_alternatives: longest`: the longest one
    whose bytes are a's then a prefix of x's (x's whole bytes where the student has that token,
    as `Joins`). `keys [E]` sorted `a·num_rests + r` and `values [E]` the student token a then
    rest r spell; `prefixes [V_t, L]` the rest id of each teacher token's first l + 1 bytes
    (−1: none) (`alignment.projection.build_extensions`)."""

    keys: Tensor
    values: Tensor
    prefixes: Tensor
    num_rests: int

    @classmethod
    def from_rows(
        cls, rows: Tensor, prefixes: Tensor, num_teacher: int, num_student: int
    ) -> Extensions:
        """From `(a, r, v)` rows `[E, 3]` and the teacher tokens' rest ids `[V_t', L]`, padded or
        cut to the model's `num_teacher` rows; rows naming student ids the model does not have
        are dropped."""
        a, r, v = rows.long().unbind(-1)
        keep = (a < num_student) & (v < num_student)
        num_rests = int(r.max()) + 1 if r.numel() else 1
        keys, order = (a[keep] * num_rests + r[keep]).sort(stable=True)
        table = torch.full(
            (num_teacher, prefixes.shape[1]), -1, dtype=torch.long, device=prefixes.device
        )
        n = min(num_teacher, prefixes.shape[0])
        table[:n] = prefixes[:n].long()
        return cls(keys, v[keep][order], table, num_rests)

    def lookup(self, a: Tensor, x: Tensor) -> Tensor:
        """The longest student token spelling `a` then a prefix of `x` (broadcast), −1 where
        there is none."""
        shape = torch.broadcast_shapes(a.shape, x.shape)
        if self.keys.numel() == 0:
            return torch.full(shape, -1, dtype=torch.long, device=a.device)
        a, x = a.long().expand(shape), x.long().expand(shape)
        rest = self.prefixes[x.clamp(min=0)]  # [..., L]
        key = a.unsqueeze(-1) * self.num_rests + rest
        at = torch.searchsorted(self.keys, key).clamp(max=self.keys.numel() - 1)
        found = (self.keys[at] == key) & (rest >= 0) & (a >= 0).unsqueeze(-1)
        found = found & (x >= 0).unsqueeze(-1)
        width = torch.arange(1, rest.shape[-1] + 1, device=a.device)
        longest = torch.where(found, width, 0).max(-1)  # the last prefix that is a token
        value = self.values[at.gather(-1, (longest.indices).unsqueeze(-1)).squeeze(-1)]
        return torch.where(longest.values > 0, value, -1)

    def to(self, device: torch.device | str) -> Extensions:
        return Extensions(
            self.keys.to(device), self.values.to(device), self.prefixes.to(device), self.num_rests
        )


@dataclass
class PrefixGroups:
    """Student and teacher tokens as events of the next bytes, for the byte-prefix target.

    `student_event [V_s]`: the event of each student token, its first teacher piece (the teacher
    token its bytes start with); `num_events` (= the teacher's rows) for a token without one,
    which belongs to the tail. `teacher_event`: each teacher id's event as a one-piece
    projection onto `num_events` ids: the teacher id itself where some student token starts
    with it, else the event of its first student piece (a teacher token longer than every
    student token that starts it shares the event of the shorter one), else none (tail)."""

    student_event: Tensor
    teacher_event: VocabProjection
    num_events: int
    # `lookahead_split`: per teacher id `[V_t]`, the log of the share of its mass, as an
    # alternative at a KD position, that goes to its exact student token (the rest goes to its
    # group, which then leaves that token out: `split_from_first_pieces`); None: the group takes
    # all of it
    short_logshare: Tensor | None = None
    # `split_context: previous`: sorted keys `u·V_t + x` of (student token before the KD
    # position u, teacher id x) pairs `[P]` and the log of each pair's share `[P]`, which
    # replaces x's own share after u; None: x's own share everywhere
    pair_keys: Tensor | None = None
    pair_logshare: Tensor | None = None

    @classmethod
    def from_first_pieces(
        cls, teacher_of_student: Tensor, student_of_teacher: Tensor
    ) -> PrefixGroups:
        """From the first teacher piece of every student id `[V_s]` and the first student piece
        of every teacher id `[V_t]` (−1: none)."""
        num_events = int(student_of_teacher.shape[0])
        g = teacher_of_student.long()
        g = torch.where((g >= 0) & (g < num_events), g, -1)
        hit = torch.zeros(num_events + 1, dtype=torch.bool, device=g.device)
        hit[torch.where(g >= 0, g, num_events)] = True
        hit = hit[:num_events]
        fp = student_of_teacher.long().to(g.device)
        via = torch.where(fp >= 0, g[fp.clamp(min=0)], -1)
        own = torch.arange(num_events, device=g.device)
        event_t = torch.where(hit, own, via)
        return cls(
            torch.where(g >= 0, g, num_events),
            VocabProjection.from_first_piece(event_t, num_events),
            num_events,
        )

    @classmethod
    def split_from_first_pieces(
        cls,
        teacher_of_student: Tensor,
        student_of_teacher: Tensor,
        exact: Tensor,
        short_share: Tensor,
    ) -> PrefixGroups:
        """The groups of `lookahead_split`: as `from_first_pieces`, less every student token
        that spells a teacher token exactly (`exact [V_t]` marks the teacher ids whose first
        student piece does), which is a bucket of its own. `short_share [V_t]` in [0, 1]: the
        share of a teacher token's mass that its exact student token takes."""
        first = student_of_teacher.long()
        spelled = torch.where(exact.bool() & (first >= 0), first, -1)
        g = teacher_of_student.long().clone()
        g[spelled[spelled >= 0]] = -1
        groups = cls.from_first_pieces(g, student_of_teacher)
        share = short_share.to(torch.float64).clamp(0.0, 1.0)
        return replace(groups, short_logshare=share.log())

    def with_pairs(self, keys: Tensor, shares: Tensor) -> PrefixGroups:
        """These groups with `split_context: previous`'s pair shares: sorted keys `u·V_t + x`
        `[P]` (V_t: the rows of `short_logshare`) and each pair's share in [0, 1] `[P]`."""
        share = shares.to(torch.float64).clamp(0.0, 1.0)
        return replace(self, pair_keys=keys.long(), pair_logshare=share.log())

    def logshare(self, ids: Tensor, previous: Tensor | None) -> Tensor:
        """`[C, K]` the log of the share of each teacher id `ids [C, K]` (clamped to ≥ 0) for
        its exact student token: the pair's share after the student's token `previous [C]`
        (−1: none) where the pair table holds it, else the id's own."""
        share = self.short_logshare[ids]
        keys = self.pair_keys
        if keys is None or previous is None or keys.numel() == 0:
            return share
        prev = previous.long().unsqueeze(-1)
        query = torch.where(prev >= 0, prev * self.short_logshare.shape[0] + ids, -1)
        at = torch.searchsorted(keys, query.clamp(min=0)).clamp(max=keys.numel() - 1)
        found = (keys[at] == query) & (query >= 0)
        return torch.where(found, self.pair_logshare[at], share)

    def to(self, device: torch.device | str) -> PrefixGroups:
        def moved(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(device)

        return PrefixGroups(
            self.student_event.to(device),
            self.teacher_event.to(device),
            self.num_events,
            moved(self.short_logshare),
            moved(self.pair_keys),
            moved(self.pair_logshare),
        )


@dataclass
class Buckets:
    """Sparse targets on the student vocabulary: `[M, B]` slots and one tail bucket `[M]`.

    Valid slots hold distinct student ids. An invalid slot carries `logq = −inf` and repeats an
    id of a valid slot of the same row (id 0 if the row has none), so scattering into a row by
    `ids` never writes to a token that is not one of the row's buckets — except id 0 in rows with
    no valid slot, where every write is the same value.

    `group_from` (the `lookahead_prefix` target): slots from that column on are groups of
    student tokens (`PrefixGroups` events, the same slot rules among themselves), those before
    it single student tokens; no group holds one of the row's singles."""

    ids: Tensor  # [M, B] int64
    logq: Tensor  # [M, B]
    valid: Tensor  # [M, B] bool
    logq_tail: Tensor  # [M]
    group_from: int | None = None

    @property
    def has_ids(self) -> Tensor:
        return self.valid.any(-1)


def _segment_logsumexp(x: Tensor, seg: Tensor, width: int) -> Tensor:
    """Per row, logsumexp of `x [M, L]` grouped by segment index `seg [M, L]` into `[M, width]`;
    −inf for empty segments. Exact for a segment of one element."""
    top = torch.full(x.shape[:-1] + (width,), NEG_INF, dtype=x.dtype, device=x.device)
    top = top.scatter_reduce(-1, seg, x, reduce="amax", include_self=True)
    shift = top.gather(-1, seg)
    finite = x > NEG_INF
    contrib = torch.where(finite, (x - torch.where(finite, shift, 0.0)).exp(), 0.0)
    total = torch.zeros_like(top).scatter_add(-1, seg, contrib)
    return torch.where(total > 0, top + total.log(), NEG_INF)


def merge_buckets(ids: Tensor, logq: Tensor, logq_tail: Tensor, num_student: int) -> Buckets:
    """Merge duplicate student ids of `ids [M, L]` (−1 = none, its mass must already be in
    `logq_tail`) into distinct buckets, summing their probabilities in log space."""
    key = torch.where(ids >= 0, ids, num_student)  # invalid entries sort last
    key, order = key.sort(dim=-1, stable=True)
    logq = logq.gather(-1, order)
    prev = torch.nn.functional.pad(key[..., :-1], (1, 0), value=-1)
    first = (key != prev) & (key < num_student)
    slot = (torch.cumsum(first.long(), -1) - 1).clamp(min=0)
    width = ids.shape[-1]
    merged = _segment_logsumexp(torch.where(key < num_student, logq, NEG_INF), slot, width)
    # the id of each slot: written only by the first entry of its run
    dump = torch.where(first, slot, width)
    slot_ids = torch.zeros(ids.shape[:-1] + (width + 1,), dtype=torch.long, device=ids.device)
    slot_ids = slot_ids.scatter(-1, dump, torch.where(first, key, 0))[..., :width]
    count = first.sum(-1, keepdim=True)
    valid = torch.arange(width, device=ids.device) < count
    filler = torch.where(count > 0, slot_ids[..., :1], 0)
    return Buckets(
        ids=torch.where(valid, slot_ids, filler),
        logq=torch.where(valid, merged, NEG_INF),
        valid=valid,
        logq_tail=logq_tail,
    )


@dataclass
class Continuation:
    """What the text says at each KD position, for the context-aware target (`[M]` each): the
    teacher's observed next token `first_t`, the student's observed next token `label` (−1:
    none), and `log_rest`, the teacher's log-probability of the rest of the chunk after
    `first_t` along the observed path; `active` marks chunks of one student token and several
    teacher tokens, where that student token runs past the teacher's first one."""

    first_t: Tensor
    label: Tensor
    log_rest: Tensor
    active: Tensor


def project_topk(
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    tail_logprob: Tensor,
    projection: VocabProjection,
    continuation: Continuation | None = None,
) -> Buckets:
    """Project teacher top-k `[M, K]` (+ tail `[M]`) onto student buckets `[M, K·P]` + tail.

    With `continuation` (the context-aware target), `[M, K·P + 1]`: where a chunk is one student
    token over several teacher tokens and the observed teacher token is in the top-k, its mass
    q is split: q·r goes to the student's observed token, whose bytes the teacher continues to
    with probability r = exp(log_rest) after it, and q·(1 − r) to its pieces as before. At τ = 1
    that is the teacher's exact probability of the student token's bytes along the observed
    path. The distribution keeps its total; where no chunk is active the buckets are those of the
    first-piece target."""
    flat, flat_logq, tail = topk_entries(
        topk_ids, topk_logprobs, tail_logprob, projection, continuation
    )
    return merge_buckets(flat, flat_logq, tail, projection.num_student)


def topk_entries(
    topk_ids: Tensor,
    topk_logprobs: Tensor,
    tail_logprob: Tensor,
    projection: VocabProjection,
    continuation: Continuation | None = None,
    drop: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`project_topk` before merging: student ids `[M, L]` (−1: none), their log-probs, and the
    tail `[M]`. `drop [M, K]`: top-k entries whose mass goes elsewhere (left out here)."""
    teacher_ids = topk_ids.long()
    pieces = projection.pieces[teacher_ids]  # [M, K, P]
    log_w = projection.weights[teacher_ids].to(topk_logprobs.dtype).log()
    logq = torch.where(pieces >= 0, topk_logprobs.unsqueeze(-1) + log_w, NEG_INF)
    unmapped = ~(pieces >= 0).any(-1)  # [M, K]: the whole entry goes to the tail
    if drop is not None:
        logq = torch.where(drop.unsqueeze(-1), NEG_INF, logq)
        unmapped = unmapped & ~drop
    lost = torch.where(unmapped, topk_logprobs, NEG_INF).logsumexp(-1)
    tail = torch.logaddexp(tail_logprob, lost)
    # logaddexp(-inf, -inf) is nan on some builds: keep an empty tail empty
    tail = torch.where((tail_logprob == NEG_INF) & (lost == NEG_INF), NEG_INF, tail)
    if continuation is not None:
        return _split_observed(
            teacher_ids, topk_logprobs, unmapped, logq, pieces, tail, continuation
        )
    return pieces.flatten(-2), logq.flatten(-2), tail


def _split_observed(teacher_ids, topk_logprobs, unmapped, logq, pieces, tail, c: Continuation):
    """The context-aware split of `project_topk`: entries `[M, K·P + 1]` and the tail."""
    dtype = topk_logprobs.dtype
    hit = (teacher_ids == c.first_t.long().unsqueeze(-1)) & c.active.unsqueeze(-1)
    hit = hit & (c.label >= 0).unsqueeze(-1)  # [M, K]: at most one per row (distinct top-k ids)
    log_r = c.log_rest.to(dtype).clamp(max=0.0).unsqueeze(-1)  # [M, 1]
    keep = torch.log1p(-log_r.exp())  # log(1 − r); −inf when r = 1
    moved_from = torch.where(hit, topk_logprobs, NEG_INF)  # [M, K] the observed token's mass
    moved = moved_from.logsumexp(-1, keepdim=True) + log_r  # [M, 1]
    moved = torch.where(hit.any(-1, keepdim=True), moved, NEG_INF)
    # the observed token's pieces keep q·(1 − r); an unmapped one's tail share shrinks likewise
    logq = torch.where(hit.unsqueeze(-1), logq + keep.unsqueeze(-1), logq)
    tail_drop = torch.where(hit & unmapped, topk_logprobs, NEG_INF).logsumexp(-1)  # [M]
    gone = tail_drop + log_r.squeeze(-1)
    safe = torch.where(gone > NEG_INF, gone, tail)
    less = tail + torch.log1p(-torch.exp(safe - tail).clamp(max=1.0))
    tail = torch.where((gone > NEG_INF) & (tail > NEG_INF), less, tail)
    to = torch.where(moved > NEG_INF, c.label.long().unsqueeze(-1), -1)
    return torch.cat([pieces.flatten(-2), to], -1), torch.cat([logq.flatten(-2), moved], -1), tail

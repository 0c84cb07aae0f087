"""What one student pass needs, laid out per student row.

`KDTerm` is one teacher's contribution as the trainer describes it (targets, projection, chunk
alignment, loss). `build_plan` turns the terms into dense `[N, ...]` arrays indexed by student
row — targets scattered from KD positions to the rows that predict them, with a weight of 0 on
rows without KD — so that a sequence chunk is a plain slice `[r0:r1]` and nothing needs the
number of valid positions on the host. Both the chunked pass and the reference path consume it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import get_args

import torch
from torch import Tensor

from crossdistill.config import DISTRIBUTION_LOSSES, LOSSES, CEWithoutKD
from crossdistill.errors import UserError
from crossdistill.losses import divergences as div
from crossdistill.losses.boundaries import condition
from crossdistill.losses.lookahead import project_lookahead
from crossdistill.losses.projection import (
    Buckets,
    Continuation,
    PrefixGroups,
    VocabProjection,
    project_topk,
)
from crossdistill.losses.targets import TeacherTargets

NEG_INF = float("-inf")
# the one parameter a divergence takes (`KDTerm.params`); the others take none
LOSS_PARAM = {"jsd": "beta", "skew_kl": "alpha"}


@dataclass
class KDTerm:
    """One teacher's distillation term for a flattened batch.

    `chunks [C, 4]` rows `(s0, s1, t0, t1)` in flattened row coordinates (sequence b offset by
    its start row on each side), in order; row c of `targets` holds the teacher's top-k at the
    KD position of chunk c (`teacher_targets(..., kd_index_t=kd_positions(chunks)[1])`).
    After offsetting, a chunk that starts sequence b > 0 no longer has `s0 == 0`: build both
    with `flatten_chunks`, which masks those chunks out in `chunk_mask`.
    `denominator` is this term's *global* valid count (`kd_count`, summed over micro-batches and
    ranks); the term is `τ²·Σ D / denominator`. `params`: `beta` (jsd), `alpha` (skew_kl).
    `chunk_mask [C]`: False keeps a chunk out of KD (template tokens).
    `first_t [C]`: the teacher's token id at each chunk's start (`t0`); with it, the projected
    losses use the context-aware target (`projection.Continuation`), without it the first-piece
    target. `lookahead [C, D]`: the chunk's first D teacher token ids (−1 past its end); with it,
    `targets` hold D rows per chunk (`targets.target_rows(chunks, D)`: the KD position and the
    D − 1 after it) and the projected losses use the lookahead target (`losses.lookahead`);
    `past_end` (`lookahead_end`): the rows past a chunk's last teacher token are read too.
    A lookahead term whose projection has prefix groups (`lookahead_prefix`) puts the KD
    position's alternatives in their groups. `longer_only` (`lookahead_longer`): the groups and
    the rows past the end apply only at chunks of one student token over several teacher
    tokens. `mix` (`lookahead_mix`): a lookahead term whose projection has prefix groups is two
    divergences at half weight each, one without the groups and one with them. Groups with a
    `short_logshare` (`lookahead_split`) give that share of each alternative to its exact
    student token. `before [C, 3]` (`boundary: condition`, with the projection's `boundaries`,
    and `split_context: previous`, with the groups' pair table): per chunk, the student's and the
    teacher's token before it and the teacher's first token of it (−1: none); the KD positions'
    top-k is then conditioned on what the student's token rules out (`losses.boundaries`), and
    the split's share read after the student's token (`PrefixGroups.logshare`)."""

    targets: TeacherTargets
    projection: VocabProjection
    chunks: Tensor
    denominator: Tensor
    loss: str = "forward_kl"
    weight: float | Tensor = 1.0
    params: dict[str, float] = field(default_factory=dict)
    chunk_mask: Tensor | None = None
    name: str = "teacher"
    first_t: Tensor | None = None
    lookahead: Tensor | None = None
    past_end: bool = False
    longer_only: bool = False
    mix: bool = False
    before: Tensor | None = None

    @property
    def temperature(self) -> float:
        return self.targets.temperature

    @property
    def target(self) -> str:
        """The name of the target the term's fields select (`teachers.N.target`)."""
        if self.lookahead is None:
            if self.first_t is not None:
                return "context"
            return "first_piece" if self.projection.groups is None else "prefix"
        if self.longer_only:
            return "lookahead_longer"
        if self.mix and self.projection.groups is not None:
            return "lookahead_mix"
        if self.projection.groups is not None and self.projection.groups.short_logshare is not None:
            return "lookahead_split"
        name = "lookahead_prefix" if self.projection.groups is not None else "lookahead"
        return f"{name}_end" if self.past_end else name

    def check(self) -> None:
        if self.loss not in LOSSES:
            choices = ", ".join(LOSSES)
            raise UserError(f"unknown loss {self.loss!r} for teacher {self.name!r}; use {choices}")
        beta, alpha = self.params.get("beta", 0.5), self.params.get("alpha", 0.1)
        if self.loss == "jsd" and not 0.0 < beta < 1.0:
            raise UserError(f"jsd needs 0 < beta < 1 (teacher {self.name!r}), got {beta}")
        if self.loss == "skew_kl" and not 0.0 <= alpha < 1.0:
            raise UserError(f"skew_kl needs 0 <= alpha < 1 (teacher {self.name!r}), got {alpha}")
        if (self.first_t is not None or self.lookahead is not None) and self.loss not in (
            DISTRIBUTION_LOSSES
        ):
            raise UserError(
                f"the {self.target} target needs a projected loss "
                f"({', '.join(DISTRIBUTION_LOSSES)}); "
                f"teacher {self.name!r} uses {self.loss}: set its target to first_piece"
            )


def flatten_chunks(
    chunks: list[Tensor], rows_s: list[int] | int, rows_t: list[int] | int
) -> tuple[Tensor, Tensor]:
    """Per-sequence chunk alignments `[C_b, 4]` (sequence-local rows) → flattened `[C, 4]` for
    a batch whose sequences occupy `rows_s` / `rows_t` rows each (an int: all the same), and
    `chunk_mask [C]` that is False where a chunk starts its sequence on either side (its first
    token has no prediction to distil: the row before it belongs to another sequence)."""
    count = len(chunks)
    rows_s = [rows_s] * count if isinstance(rows_s, int) else list(rows_s)
    rows_t = [rows_t] * count if isinstance(rows_t, int) else list(rows_t)
    out, mask, off_s, off_t = [], [], 0, 0
    for c, n_s, n_t in zip(chunks, rows_s, rows_t):
        c = c.long().clone()
        mask.append((c[:, 0] > 0) & (c[:, 2] > 0))
        c[:, :2] += off_s
        c[:, 2:] += off_t
        out.append(c)
        off_s, off_t = off_s + n_s, off_t + n_t
    if not out:
        return torch.zeros(0, 4, dtype=torch.long), torch.zeros(0, dtype=torch.bool)
    return torch.cat(out), torch.cat(mask)


def _span_sums(values: Tensor, start: Tensor, end: Tensor) -> Tensor:
    """Σ values[start:end] per span, through a float64 prefix sum (so long sequences lose no
    precision); spans are clamped into range, empty spans give 0."""
    prefix = torch.nn.functional.pad(torch.cumsum(values.double(), 0), (1, 0))
    n = values.shape[0]
    start, end = start.clamp(0, n), end.clamp(0, n)
    return prefix[torch.maximum(start, end)] - prefix[start]


def _complete(chunks: Tensor, labels_s: Tensor, next_valid_t: Tensor) -> Tensor:
    """`[C]` chunks whose every token is predicted on both sides: labels valid on student rows
    `[s0 − 1, s1 − 1)`, next tokens valid on teacher rows `[t0 − 1, t1 − 1)`."""
    s0, s1, t0, t1 = chunks.unbind(-1)
    bad_s = _span_sums((labels_s < 0).double(), s0 - 1, s1 - 1)
    bad_t = _span_sums((~next_valid_t).double(), t0 - 1, t1 - 1)
    return (s0 > 0) & (t0 > 0) & (s1 > s0) & (t1 > t0) & (bad_s == 0) & (bad_t == 0)


def kd_valid(term: KDTerm, labels_s: Tensor) -> Tensor:
    """`[C]` bool: the chunks that contribute to this term (and to its count)."""
    chunks = term.chunks.to(labels_s.device)
    s0, s1, t0, t1 = chunks.unbind(-1)
    if term.loss == "chunk_likelihood":
        ok = _complete(chunks, labels_s, term.targets.next_valid.to(labels_s.device))
    else:
        ok = (s0 > 0) & (t0 > 0) & (s1 > s0) & (t1 > t0)
    return ok & _mask(term, labels_s.device)


def _mask(term: KDTerm, device: torch.device | None = None) -> Tensor | bool:
    return True if term.chunk_mask is None else term.chunk_mask.to(device or term.chunks.device)


def kd_count(term: KDTerm, labels_s: Tensor) -> Tensor:
    """This micro-batch's contribution to `term.denominator` (sum it over the global batch)."""
    return kd_valid(term, labels_s).sum()


def ce_count(labels_s: Tensor) -> Tensor:
    """This micro-batch's contribution to the CE denominator."""
    return (labels_s >= 0).sum()


def safe_inverse(count: Tensor | float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """1 / count, and 0 for a zero count (an all-masked global batch gives loss 0, not NaN).
    A Python number stays one: no host-to-device copy."""
    if not isinstance(count, Tensor):
        return torch.full((), 1.0 / count if count > 0 else 0.0, dtype=dtype, device=device)
    count = count.to(device, dtype)
    return torch.where(count > 0, 1.0 / torch.where(count > 0, count, 1.0), 0.0)


@dataclass
class Part:
    """One bucket divergence on the student's softmax at the term's temperature, per row.

    Buckets are `ids [N, B]` (or, with `ids=None`, the student's own top-B tokens, skipping
    `exclude [V_s]`) with teacher log-probs `logq [N, B]` and, when `logq_tail` is set, one tail
    bucket for all other tokens. With `groups [V_s]` (the byte-prefix target) the ids are events
    and a bucket holds every student token j with `groups[j]` equal to its id; `groups[j] =
    num_events` puts token j in the tail. `group_from > 0` (the `lookahead_prefix` target): the
    first `group_from` buckets are single student tokens, in none of the row's groups. `scale`:
    the part's share of its term's weight (½ for each of `lookahead_mix`'s two parts)."""

    divergence: str
    logq: Tensor
    ids: Tensor | None = None
    valid: Tensor | None = None
    logq_tail: Tensor | None = None
    exclude: Tensor | None = None
    params: dict[str, float] = field(default_factory=dict)
    groups: Tensor | None = None
    num_events: int = 0
    group_from: int = 0
    scale: float = 1.0


@dataclass
class TermPlan:
    """A `KDTerm` laid out per student row."""

    name: str
    loss: str
    temperature: float
    row_weight: Tensor  # [N] w·kd_ratio·τ²/denominator on valid KD rows, 0 elsewhere
    report_weight: Tensor  # [N] 1/denominator on valid KD rows (reported values)
    chunk_weight: Tensor  # [C] the same weights per chunk (chunk_likelihood)
    chunk_report: Tensor  # [C]
    top1_s: Tensor  # [N] student id of the teacher's most likely token, −1 if none
    parts: list[Part]
    chunks: Tensor  # [C, 4]
    valid_chunks: Tensor  # [C] bool
    complete_chunks: Tensor  # [C] bool: for the aligned NLL metrics
    logl_t: Tensor  # [C] float64 teacher log-likelihood of each chunk (τ = 1)
    count: Tensor  # local valid count


@dataclass
class Plan:
    labels: Tensor  # [N] int64, −100 = ignore
    ce_weight: Tensor  # [N] (1 − kd_ratio·share)/ce_denominator on labeled rows (build_plan)
    ce_report: Tensor  # [N] 1/ce_denominator on labeled rows
    terms: list[TermPlan]
    num_ce: Tensor

    @property
    def temperatures(self) -> list[float]:
        return sorted({t.temperature for t in self.terms if t.parts})


def _to_rows(values: Tensor, rows: Tensor, valid: Tensor, num_rows: int, fill) -> Tensor:
    """Scatter `values [C, ...]` to student rows `rows [C]`; rows without a value get `fill`.
    Invalid entries go to distinct spare rows past the end, so no two writes collide."""
    c = rows.shape[0]
    spare = num_rows + torch.arange(c, device=rows.device)
    out = torch.full(
        (num_rows + c,) + values.shape[1:], fill, dtype=values.dtype, device=values.device
    )
    out[torch.where(valid, rows, spare)] = values
    return out[:num_rows]


def _bucket_rows(b: Buckets, rows: Tensor, valid: Tensor, n: int) -> tuple[Tensor, ...]:
    """Buckets per student row; rows without KD put all teacher mass in the tail (a benign
    distribution: the student's tail is then everything, and every divergence is 0)."""
    return (
        _to_rows(b.ids, rows, valid, n, 0),
        _to_rows(b.logq, rows, valid, n, NEG_INF),
        _to_rows(b.valid, rows, valid, n, False),
        _to_rows(b.logq_tail, rows, valid, n, 0.0),
    )


def chunk_labels(term: KDTerm, labels_s: Tensor) -> Tensor:
    """`[C]` the student's first token of each chunk (the label of its KD row), −1 where the
    chunk starts its sequence."""
    s0 = term.chunks[:, 0]
    n = labels_s.shape[0]
    return torch.where(s0 > 0, labels_s[(s0 - 1).clamp(0, n - 1)], -1)


def first_token_ends(term: KDTerm, labels_s: Tensor) -> tuple[Tensor, Tensor]:
    """Where each chunk ends as its first student token sees it: `[C]` teacher rows, and `[C]`
    the chunks of several tokens on both sides read that way. The row is the chunk's end `t1`,
    except at such a chunk under a projection with byte lengths (`teachers.N.many_chunks: path`),
    where it is the end of the teacher token that crosses the end of the student's first token
    (the chunk's first token where the student's is the shorter one, or a later one, which may
    be the chunk's last). That token must be one of the chunk's first D (`term.lookahead`); a
    chunk whose byte counts do not place the crossing strictly inside a teacher token keeps
    `t1` and the first piece."""
    s0, s1, t0, t1 = term.chunks.unbind(-1)
    lengths = term.projection.byte_lengths
    if lengths is None or term.lookahead is None:
        return t1, torch.zeros_like(t1, dtype=torch.bool)
    obs = term.lookahead.long()
    depth = obs.shape[1]
    label = chunk_labels(term, labels_s)
    n_s = torch.where(label >= 0, lengths.student[label.clamp(min=0)], 0).long()
    n_t = torch.where(obs >= 0, lengths.teacher[obs.clamp(min=0)], 0).long().cumsum(-1)
    inside = ((n_t <= n_s[:, None]) & (obs >= 0)).sum(-1)  # whole teacher tokens in the student's
    at = inside.clamp(max=depth - 1)[:, None]
    before = n_t.gather(-1, (at - 1).clamp(min=0)).squeeze(-1)
    crosses = (inside < depth) & (obs.gather(-1, at).squeeze(-1) >= 0) & (n_s > 0)
    crosses = crosses & ((inside == 0) | (before < n_s)) & (label >= 0)
    crossing = (s1 - s0 > 1) & (t1 - t0 > 1) & crosses
    return torch.where(crossing, t0 + inside + 1, t1), crossing


def continuation(
    term: KDTerm, labels_s: Tensor, first_token: tuple[Tensor, Tensor] | None = None
) -> Continuation | None:
    """The context-aware target's view of each chunk (None without `term.first_t` or
    `term.lookahead`); `first_token`: where each chunk ends for its first student token and
    the chunks of several tokens on both sides read so (`first_token_ends`, computed when not
    given). Those chunks are active as chunks of one student token: their rest is the
    teacher's tokens up to that end."""
    first_t = term.first_t if term.lookahead is None else term.lookahead[:, 0]
    if first_t is None:
        return None
    s0, s1, t0, t1 = term.chunks.unbind(-1)
    ends, crossing = first_token_ends(term, labels_s) if first_token is None else first_token
    tg = term.targets
    rest_bad = _span_sums((~tg.next_valid).double(), t0, ends - 1)
    return Continuation(
        first_t=first_t.long(),
        label=chunk_labels(term, labels_s),
        log_rest=_span_sums(tg.next_logprobs, t0, ends - 1),
        active=((s1 - s0 == 1) & (t1 - t0 > 1) | crossing) & (rest_bad == 0),
    )


def _parts(term: KDTerm, rows: Tensor, valid: Tensor, n: int, labels_s: Tensor) -> list[Part]:
    tg, proj = term.targets, term.projection
    if term.loss == "chunk_likelihood":
        return []
    if term.loss == "uld":
        logq = _to_rows(tg.topk_logprobs, rows, valid, n, NEG_INF)
        tail = _to_rows(tg.tail_logprob, rows, valid, n, 0.0)
        return [Part("l1", logq, logq_tail=tail)]
    if term.loss in ("gold", "hkl"):  # the common vocabulary by forward KL, the rest by ULD
        pairs = proj.exact_only() if term.loss == "gold" else proj.matched_only()
        ids, logq, ok, tail = _bucket_rows(
            project_topk(tg.topk_ids, tg.topk_logprobs, tg.tail_logprob, pairs), rows, valid, n
        )
        common = Part("forward_kl", logq, ids=ids, valid=ok, logq_tail=tail)
        paired_t = pairs.exact[tg.topk_ids.long()]
        rest_t = torch.where(paired_t, NEG_INF, tg.topk_logprobs).sort(-1, descending=True).values
        rest = Part("l1", _to_rows(rest_t, rows, valid, n, NEG_INF), exclude=pairs.images())
        return [common, rest]
    params = {k: float(v) for k, v in term.params.items() if k == LOSS_PARAM.get(term.loss)}
    if proj.groups is not None and term.lookahead is None:  # the byte-prefix target: groups
        g = proj.groups
        b = project_topk(tg.topk_ids, tg.topk_logprobs, tg.tail_logprob, g.teacher_event)
        ids, logq, ok, tail = _bucket_rows(b, rows, valid, n)
        part = Part(term.loss, logq, ids=ids, valid=ok, logq_tail=tail, params=params)
        return [dataclasses.replace(part, groups=g.student_event, num_events=g.num_events)]
    if term.lookahead is None:
        cont = continuation(term, labels_s)
        b = project_topk(tg.topk_ids, tg.topk_logprobs, tg.tail_logprob, proj, cont)
        return [_projected_part(term, b, rows, valid, n, params)]
    first_token = first_token_ends(term, labels_s)
    cont = continuation(term, labels_s, first_token)
    ends = first_token[0]
    if term.mix and proj.groups is not None:  # lookahead_mix: without the groups, then with them
        parts = [
            _projected_part(
                term, _lookahead_buckets(term, cont, groups, ends), rows, valid, n, params
            )
            for groups in (None, proj.groups)
        ]
        return [dataclasses.replace(p, scale=0.5) for p in parts]
    b = _lookahead_buckets(term, cont, proj.groups, ends)
    return [_projected_part(term, b, rows, valid, n, params)]


def _projected_part(
    term: KDTerm, b: Buckets, rows: Tensor, valid: Tensor, n: int, params: dict[str, float]
) -> Part:
    """A projected target's buckets per student row, as one bucket divergence."""
    ids, logq, ok, tail = _bucket_rows(b, rows, valid, n)
    part = Part(term.loss, logq, ids=ids, valid=ok, logq_tail=tail, params=params)
    if b.group_from is not None:  # lookahead_prefix: the KD position's alternatives in groups
        g = term.projection.groups
        part = dataclasses.replace(
            part, groups=g.student_event, num_events=g.num_events, group_from=b.group_from
        )
    return part


def _lookahead_buckets(
    term: KDTerm, cont: Continuation, groups: PrefixGroups | None, ends: Tensor
) -> Buckets:
    """The lookahead target's buckets `[C, L]` from targets at D rows per chunk; `groups`: the
    KD position's other entries in their groups (`lookahead_prefix`), or None; `ends [C]`:
    where each chunk ends for its first student token (`first_token_ends`)."""
    tg, chunks = term.targets, term.chunks
    c, depth = term.lookahead.shape
    s0, s1, t0, t1 = chunks.unbind(-1)
    rest = [_span_sums(tg.next_logprobs, t0 - 1 + d, ends - 1) for d in range(depth + 1)]
    longer = (s1 - s0 == 1) & (t1 - t0 > 1) if term.longer_only else None
    return project_lookahead(
        tg.topk_ids.view(c, depth, -1),
        tg.topk_logprobs.view(c, depth, -1),
        tg.tail_logprob.view(c, depth),
        term.projection,
        cont,
        term.lookahead,
        ends - t0,
        torch.stack(rest, -1),
        single=(s1 - s0 == 1) if term.past_end else None,
        groups=groups,
        only=longer,
        previous=None if term.before is None else term.before[:, 0],
    )


def _local(term: KDTerm, device: torch.device, dtype: torch.dtype) -> KDTerm:
    """The term with everything on the student's device and teacher log-probs in `dtype`
    (targets may come from another device or a CPU cache; `.to` is free where they are)."""
    tg = term.targets.to(device)
    tg = dataclasses.replace(
        tg, topk_logprobs=tg.topk_logprobs.to(dtype), tail_logprob=tg.tail_logprob.to(dtype)
    )
    mask = None if term.chunk_mask is None else term.chunk_mask.to(device)
    first_t = None if term.first_t is None else term.first_t.to(device)
    ahead = None if term.lookahead is None else term.lookahead.to(device)
    before = None if term.before is None else term.before.to(device)
    return dataclasses.replace(
        term,
        targets=tg,
        projection=term.projection.to(device),
        chunks=term.chunks.to(device).long(),
        chunk_mask=mask,
        first_t=first_t,
        lookahead=ahead,
        before=before,
    )


def boundary_dropped(term: KDTerm) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """`[C, D, K]` top-k ids and log-probs and `[C, D]` tails of `term`'s targets (D rows per
    chunk, the KD position's first), and `[C, K]` the KD positions' entries that the student's
    token before each chunk rules out (`losses.boundaries`); None without a table or chunks."""
    bounds, before = term.projection.boundaries, term.before
    c = term.chunks.shape[0]
    if bounds is None or before is None or c == 0:
        return None
    tg = term.targets
    depth = 1 if term.lookahead is None else term.lookahead.shape[1]
    ids = tg.topk_ids.view(c, depth, -1)
    lp = tg.topk_logprobs.view(c, depth, -1)
    tail = tg.tail_logprob.view(c, depth)
    return ids, lp, tail, bounds.dropped(before[:, 0], before[:, 1], before[:, 2], ids[:, 0])


def _conditioned(term: KDTerm) -> KDTerm:
    """`term` with each KD position's top-k conditioned on what the student's token before the
    chunk rules out (`losses.boundaries`); the rows after it (lookahead) are left as they are."""
    read = boundary_dropped(term)
    if read is None:
        return term
    ids, lp, tail, dropped = read
    tg = term.targets
    ids0, lp0, tail0 = condition(ids[:, 0], lp[:, 0], tail[:, 0], dropped)
    ids = torch.cat([ids0.to(ids.dtype).unsqueeze(1), ids[:, 1:]], 1)
    lp = torch.cat([lp0.unsqueeze(1), lp[:, 1:]], 1)
    tail = torch.cat([tail0.unsqueeze(1), tail[:, 1:]], 1)
    tg = dataclasses.replace(
        tg,
        topk_ids=ids.view(tg.topk_ids.shape),
        topk_logprobs=lp.view(tg.topk_logprobs.shape),
        tail_logprob=tail.view(tg.tail_logprob.shape),
    )
    return dataclasses.replace(term, targets=tg)


def _term_plan(term: KDTerm, labels_s: Tensor, kd_ratio: float, dtype: torch.dtype) -> TermPlan:
    term.check()
    n, device = labels_s.shape[0], labels_s.device
    term = _conditioned(_local(term, device, dtype))
    chunks, tg = term.chunks, term.targets
    valid = kd_valid(term, labels_s)
    rows = chunks[:, 0] - 1
    inv = safe_inverse(term.denominator, dtype, device)
    weight = term.weight.to(device, dtype) if isinstance(term.weight, Tensor) else term.weight
    report = valid.to(dtype) * inv
    scaled = report * (weight * kd_ratio * term.temperature**2)
    depth = 1 if term.lookahead is None else term.lookahead.shape[1]
    first = term.projection.first_piece[tg.topk_ids[::depth, 0].long()]  # the KD positions' rows
    _, _, t0, t1 = chunks.unbind(-1)
    return TermPlan(
        name=term.name,
        loss=term.loss,
        temperature=term.temperature,
        row_weight=_to_rows(scaled, rows, valid, n, 0.0),
        report_weight=_to_rows(report, rows, valid, n, 0.0),
        chunk_weight=scaled,
        chunk_report=report,
        top1_s=_to_rows(first, rows, valid, n, -1),
        parts=_parts(term, rows, valid, n, labels_s),
        chunks=chunks,
        valid_chunks=valid,
        complete_chunks=_complete(chunks, labels_s, tg.next_valid) & _mask(term),
        logl_t=_span_sums(tg.next_logprobs, t0 - 1, t1 - 1),
        count=valid.sum(),
    )


def build_plan(
    labels_s: Tensor,
    kd_terms: list[KDTerm],
    kd_ratio: float,
    ce_denominator: Tensor | float,
    dtype: torch.dtype,
    ce_without_kd: CEWithoutKD = "ratio",
) -> Plan:
    """Lay out CE and every KD term per student row; `dtype` is the accumulation dtype.

    `ce_without_kd` (`TrainConfig.ce_without_kd`): "ratio" weighs CE by 1 − kd_ratio on every
    labeled row; "full" gives a row the KD share that no teacher uses there, so its CE weight
    is 1 − kd_ratio·Σ_k w_k·covered_k / Σ_k w_k (a row is covered by a term when that term's
    loss reaches the row's logits: its KD rows, or every row of its chunks for
    chunk_likelihood)."""
    if not 0.0 <= kd_ratio <= 1.0:
        raise UserError(f"kd_ratio must be in [0, 1], got {kd_ratio}")
    if ce_without_kd not in get_args(CEWithoutKD):
        raise UserError(
            f"ce_without_kd must be one of {', '.join(get_args(CEWithoutKD))}, got {ce_without_kd!r}"
        )
    labels = labels_s.long()
    labeled = (labels >= 0).to(dtype)
    inv = safe_inverse(ce_denominator, dtype, labels.device)
    names = [t.name for t in kd_terms]
    plans = [_term_plan(t, labels, kd_ratio, dtype) for t in kd_terms]
    for i, p in enumerate(plans):
        if names.count(p.name) > 1:
            p.name = f"{p.name}{i}"
    share: Tensor | float = 1.0
    if ce_without_kd == "full":
        share = kd_share(plans, [t.weight for t in kd_terms], labels, dtype)
    return Plan(
        labels=labels,
        ce_weight=labeled * ((1.0 - kd_ratio * share) * inv),
        ce_report=labeled * inv,
        terms=plans,
        num_ce=(labels >= 0).sum(),
    )


def kd_share(
    plans: list[TermPlan], weights: list[Tensor | float], labels: Tensor, dtype: torch.dtype
) -> Tensor:
    """`[N]` the fraction of the teachers' weight whose KD term reaches each row's logits:
    Σ_k w_k·covered_k / Σ_k w_k (0 everywhere when no teacher has weight)."""
    num_rows = labels.shape[0]
    share = torch.zeros(num_rows, dtype=dtype, device=labels.device)
    total = sum(weights, 0.0)
    for p, w in zip(plans, weights):
        if p.loss == "chunk_likelihood":  # its gradient reaches every row of each chunk
            covered = student_rows_of_chunks(p.chunks, p.valid_chunks, num_rows) >= 0
        else:
            covered = _to_rows(p.valid_chunks, p.chunks[:, 0] - 1, p.valid_chunks, num_rows, False)
        share = share + covered.to(dtype) * w
    if isinstance(total, Tensor):
        return torch.where(total > 0, share / total.to(dtype).clamp(min=1e-30), 0.0)
    return share / total if total > 0 else torch.zeros_like(share)


def student_rows_of_chunks(chunks: Tensor, valid: Tensor, num_rows: int) -> Tensor:
    """`[N]` index of the valid chunk whose student tokens each row predicts (rows
    `[s0 − 1, s1 − 1)`), −1 for none. Needs `chunks` in order, as the alignment gives them."""
    if chunks.shape[0] == 0:  # a batch of padding only
        return torch.full((num_rows,), -1, dtype=torch.long, device=chunks.device)
    start, end = chunks[:, 0] - 1, chunks[:, 1] - 1
    start = torch.where(valid, start, end)  # invalid chunks become empty spans, keeping order
    row = torch.arange(num_rows, device=chunks.device)
    idx = torch.searchsorted(start.contiguous(), row, right=True) - 1
    safe = idx.clamp(min=0)
    inside = (idx >= 0) & (row < end[safe]) & valid[safe]
    return torch.where(inside, idx, -1)


def chunk_logl_s(logp_label: Tensor, chunks: Tensor) -> Tensor:
    """`[C]` float64 student log-likelihood of each chunk from per-row label log-probs `[N]`."""
    return _span_sums(logp_label, chunks[:, 0] - 1, chunks[:, 1] - 1)


def loss_metrics(
    plan: Plan,
    loss: Tensor,
    term_sums: Tensor,
    logp_label: Tensor,
    argmax: Tensor,
    logp_chunks: Tensor | None = None,
) -> dict[str, Tensor]:
    """The detached metrics of one student pass (see `student_loss`). `logp_chunks [N]`: the
    label log-probs the chunk sums read (a row-sharded pass passes those of all rows; default
    `logp_label`)."""
    logp_chunks = logp_label if logp_chunks is None else logp_chunks
    out = {
        "loss": loss.detach(),
        "ce": (-logp_label * plan.ce_report).sum(),
        "num_ce": plan.num_ce,
    }
    for i, term in enumerate(plan.terms):
        name = term.name
        out[f"kd/{name}"] = term_sums[i] * term.temperature**2
        hit = (argmax == term.top1_s) & (term.top1_s >= 0)
        out[f"top1/{name}"] = torch.where(hit, term.report_weight, 0.0).sum()
        out[f"num_kd/{name}"] = term.count
        done = term.complete_chunks
        out[f"nll_s/{name}"] = -torch.where(done, chunk_logl_s(logp_chunks, term.chunks), 0.0).sum()
        out[f"nll_t/{name}"] = -torch.where(done, term.logl_t, 0.0).sum()
        out[f"num_chunks/{name}"] = done.sum()
    return out


def chunk_likelihood_coefs(
    plan: Plan, logp_label: Tensor, mine: list[Tensor] | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunk-likelihood terms from a first pass over the label log-probs: the loss, per-term
    reported sums `[T]`, and the per-row coefficient that folds their gradient into the chunked
    pass (each row of a chunk gets `−∂D/∂l_s` of its chunk, in the CE direction). `mine`: per
    term, the chunks this rank owns (a row-sharded pass counts each chunk on one rank; the
    coefficient still covers every chunk, since a row's chunk may be owned by another rank)."""
    n = logp_label.shape[0]
    coef = torch.zeros_like(logp_label)
    loss = torch.zeros((), dtype=logp_label.dtype, device=logp_label.device)
    sums = torch.zeros(len(plan.terms), dtype=logp_label.dtype, device=logp_label.device)
    for i, term in enumerate(plan.terms):
        if term.loss != "chunk_likelihood" or term.chunks.shape[0] == 0:
            continue  # no chunk (a batch of padding): nothing to add
        logl_s = chunk_logl_s(logp_label, term.chunks).requires_grad_(True)
        with torch.enable_grad():
            value = div.chunk_likelihood(term.logl_t, logl_s, term.chunk_weight, term.temperature)
            (grad,) = torch.autograd.grad(value, logl_s)
        owner = student_rows_of_chunks(term.chunks, term.valid_chunks, n)
        coef -= torch.where(owner >= 0, grad[owner.clamp(min=0)], 0.0).to(coef.dtype)
        logl = logl_s.detach()
        weight, report = term.chunk_weight, term.chunk_report
        if mine is not None:
            weight = torch.where(mine[i], weight, 0.0)
            report = torch.where(mine[i], report, 0.0)
        loss += div.chunk_likelihood(term.logl_t, logl, weight, term.temperature).to(loss.dtype)
        sums[i] = div.chunk_likelihood(term.logl_t, logl, report, term.temperature)
    return loss, sums, coef

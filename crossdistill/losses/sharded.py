"""`student_loss` for a student split over ranks: vocabulary shards (tensor parallelism) and/or
row shards (context parallelism). See `sharding.py` for what each rank holds.

The plan is laid out over the whole flattened batch (its targets and counts are tiny next to the
logits) and then cut to this rank's rows. Row terms (CE, distribution KD) are then local. A
chunk's log-likelihood sums label log-probs over rows that may live on several ranks, so the
label log-probs are summed into one `[N]` vector across ranks (one all-reduce of N floats); the
chunk-likelihood gradient of every local row is then known, and each chunk's value and metrics
are counted by the one rank holding the chunk's first prediction row. Summed over ranks, every
value equals the single-device one.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from crossdistill.config import CEWithoutKD
from crossdistill.losses.chunked import (
    ChunkedStudentLoss,
    accumulate_dtype,
    compute_dtype,
    label_logprobs,
)
from crossdistill.losses.plan import (
    KDTerm,
    Plan,
    TermPlan,
    build_plan,
    chunk_likelihood_coefs,
    loss_metrics,
)
from crossdistill.losses.sharding import RowShard, VocabShard


def owned_chunks(term: TermPlan, owned: Tensor) -> Tensor:
    """`[C]` the chunks whose first prediction row (`s0 − 1`) is one of this rank's rows."""
    s0 = term.chunks[:, 0]
    return owned[(s0 - 1).clamp(min=0)] & (s0 > 0)


def take_rows(plan: Plan, rows: Tensor, owned: Tensor) -> Plan:
    """The plan of rows `rows [n]` (this rank's); chunk-level counts restricted to the chunks
    this rank owns (`owned [N]`: its rows)."""

    def part_rows(p):
        pick = {"logq": p.logq[rows]}
        for name in ("ids", "valid", "logq_tail"):
            value = getattr(p, name)
            pick[name] = None if value is None else value[rows]
        return dataclasses.replace(p, **pick)

    terms = []
    for t in plan.terms:
        mine = owned_chunks(t, owned)
        terms.append(
            dataclasses.replace(
                t,
                row_weight=t.row_weight[rows],
                report_weight=t.report_weight[rows],
                top1_s=t.top1_s[rows],
                parts=[part_rows(p) for p in t.parts],
                complete_chunks=t.complete_chunks & mine,
                count=(t.valid_chunks & mine).sum(),
            )
        )
    labels = plan.labels[rows]
    return dataclasses.replace(
        plan,
        labels=labels,
        ce_weight=plan.ce_weight[rows],
        ce_report=plan.ce_report[rows],
        terms=terms,
        num_ce=(labels >= 0).sum(),
    )


def sharded_student_loss(
    hidden: Tensor,
    lm_head: Tensor,
    labels: Tensor,
    terms: list[KDTerm],
    kd_ratio: float,
    ce_denominator: Tensor | float,
    chunk_size: int,
    vocab: VocabShard | None,
    rows: RowShard | None,
    ce_without_kd: CEWithoutKD = "ratio",
) -> tuple[Tensor, dict[str, Tensor]]:
    """`student_loss` with `hidden [n, H]` of this rank's rows (`rows`, or all), `labels [N]`
    and `terms` of the whole flattened batch, `lm_head` this rank's vocabulary rows (`vocab`,
    or all). The loss and metrics are this rank's parts: their sum over ranks is the value."""
    acc = accumulate_dtype(compute_dtype(hidden, lm_head))
    plan = build_plan(labels, terms, kd_ratio, ce_denominator, acc, ce_without_kd)
    num_rows = labels.shape[0]
    if rows is None:
        owned = torch.ones(num_rows, dtype=torch.bool, device=labels.device)
        local = plan
    else:
        owned = rows.owned()
        local = take_rows(plan, rows.rows, owned)
    mine = [owned_chunks(t, owned) for t in plan.terms]

    def everywhere(x: Tensor) -> Tensor:  # [n] local rows -> [N] all rows
        return x if rows is None else rows.to_global(x)

    extra = torch.zeros((), dtype=acc, device=hidden.device)
    coef, cl_sums = local.ce_weight, None
    if any(t.loss == "chunk_likelihood" for t in plan.terms):
        first = everywhere(label_logprobs(hidden, lm_head, local.labels, chunk_size, vocab))
        extra, cl_sums, cl_coef = chunk_likelihood_coefs(plan, first, mine)
        coef = coef + (cl_coef if rows is None else cl_coef[rows.rows])
    loss, term_sums, logp_label, argmax = ChunkedStudentLoss.apply(
        hidden, lm_head, local, chunk_size, coef, extra, torch.is_grad_enabled(), False, vocab
    )
    if cl_sums is not None:
        term_sums = term_sums + cl_sums
    return loss, loss_metrics(
        local, loss, term_sums, logp_label, argmax, logp_chunks=everywhere(logp_label)
    )

"""The student objective: `(1 − kd_ratio)·ce + kd_ratio·Σ_k w_k·kd_k`, each term a sum over
valid positions divided by a global count that the caller passes in (all micro-batches and
ranks), so loss and gradient do not depend on how the global batch is split. Under
`ce_without_kd="full"` a row that no KD term reaches has CE weight 1 instead of 1 − kd_ratio;
the per-row CE weights are laid out once, in `plan.build_plan`."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from crossdistill.config import CEWithoutKD
from crossdistill.errors import UserError
from crossdistill.losses.chunked import (
    ChunkedStudentLoss,
    LazyPlan,
    accumulate_dtype,
    compute_dtype,
    label_logprobs,
)
from crossdistill.losses.kernels import available as fused_available
from crossdistill.losses.plan import (
    KDTerm,
    Plan,
    build_plan,
    ce_count,
    chunk_likelihood_coefs,
    loss_metrics,
)
from crossdistill.losses.reference import reference_loss
from crossdistill.losses.sharded import sharded_student_loss
from crossdistill.losses.sharding import RowShard, VocabShard

# Losses whose gradient has a sign(q − p) factor: where the two probabilities are close, the
# rounding of bf16 logits flips it, so the fused pass keeps float32 logits for them.
SIGN_LOSSES = ("tvd", "uld", "gold", "hkl")


def student_loss(
    hidden_s: Tensor,
    lm_head_s: Tensor,
    labels_s: Tensor,
    kd_terms: Sequence[KDTerm] = (),
    kd_ratio: float = 0.5,
    ce_denominator: Tensor | float | None = None,
    chunk_size: int = 1024,
    backend: str = "chunked",
    fused: bool | None = None,
    vocab: VocabShard | None = None,
    rows: RowShard | None = None,
    unit_upstream: bool = False,
    ce_without_kd: CEWithoutKD = "ratio",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The student's loss on a flattened micro-batch, and detached metrics.

    `hidden_s [N, H]` final hidden states, `lm_head_s [V_s, H]`, `labels_s [N]` next-token ids
    (−100 = ignore). `ce_denominator`: the global count of labeled rows (`ce_count`, summed over
    the global batch); None uses this micro-batch's own count. `backend="chunked"` never holds
    more than `chunk_size` rows of logits; `"reference"` is the plain full-logits version.
    A `chunk_likelihood` term costs the chunked pass one extra forward matmul (a first pass
    for the chunk log-likelihoods, which the gradient of every row of the chunk depends on).
    `fused`: do the vocabulary-wide passes in two kernels (`losses.kernels`: Triton on CUDA,
    their PyTorch reference elsewhere; token-group buckets add `losses.group_kernels`); None =
    on CUDA when Triton is installed. The fused
    pass keeps the logits in the matmul dtype (bf16 under bf16, as a plain lm_head gives them;
    all softmax math is float32), except with a tvd/uld/gold/hkl term (`SIGN_LOSSES`).

    Metrics (all detached, no host sync): `loss`, `ce` (Σ CE / ce_denominator), `num_ce`; per
    teacher `kd/<name>` (τ²·Σ D / denominator), `top1/<name>` (Σ student argmax == projected
    teacher argmax, / denominator), `num_kd/<name>` (local valid count) and, over its complete
    chunks (every token predicted on both sides), `nll_s/<name>` and `nll_t/<name>` — the
    student's and the teacher's summed NLL of the same bytes — and `num_chunks/<name>`. Terms
    divided by global counts add up over micro-batches; the `nll_*` sums are raw sums.

    A student split over ranks (`sharded.py`): `vocab`, `lm_head_s` is this rank's vocabulary
    shard; `rows`, `hidden_s` holds this rank's rows while `labels_s` and `kd_terms` cover the
    whole flattened batch. The loss, gradients and metrics are then this rank's parts, which sum
    over ranks to the single-device values.

    `ce_without_kd`: the CE weight of a row that no KD term reaches (`build_plan`): "ratio",
    1 − kd_ratio as on every row; "full", the KD share that no teacher uses there goes to CE.

    `unit_upstream=True` promises that the returned loss itself is backpropagated
    (`loss.backward()`, as the training step does): backward then skips scaling the gradients
    by the upstream gradient, a pass over the `[V, H]` weight gradient (checked on the device).
    """
    if backend not in ("chunked", "reference"):
        raise UserError(f"unknown loss backend {backend!r}; use 'chunked' or 'reference'")
    if chunk_size < 1:
        raise UserError(f"loss chunk size must be >= 1, got {chunk_size}")
    hidden = hidden_s.reshape(-1, hidden_s.shape[-1])
    labels = labels_s.reshape(-1)
    if ce_denominator is None:
        ce_denominator = ce_count(labels)
    acc = accumulate_dtype(compute_dtype(hidden, lm_head_s))
    terms = list(kd_terms)
    grouped = any(t.projection.groups is not None for t in terms)
    if vocab is not None or rows is not None:
        if backend != "chunked":
            raise UserError("a student split over ranks needs the chunked loss backend")
        if grouped and vocab is not None:
            raise UserError(
                "the prefix target sums the student's probabilities over whole token groups and "
                "needs its whole vocabulary on each rank: use another target with student.parallel.tp > 1"
            )
        return sharded_student_loss(
            hidden, lm_head_s, labels, terms, kd_ratio, ce_denominator, chunk_size, vocab, rows,
            ce_without_kd,
        )  # fmt: skip

    def build() -> Plan:
        return build_plan(labels, terms, kd_ratio, ce_denominator, acc, ce_without_kd)

    if backend == "reference":
        plan = build()
        loss, term_sums, logp_label, argmax, _ = reference_loss(hidden, lm_head_s, plan)
        return loss, loss_metrics(plan, loss, term_sums, logp_label, argmax)
    if fused is None:
        fused = hidden.is_cuda and fused_available()
    if fused and not any(t.loss in SIGN_LOSSES for t in terms):
        fused = "low"  # logits may stay in the matmul dtype (see SIGN_LOSSES)
    extra = torch.zeros((), dtype=acc, device=hidden.device)
    source, coef, cl_sums = LazyPlan(build), None, None
    if any(t.loss == "chunk_likelihood" for t in terms):
        plan = source.get()
        first = label_logprobs(hidden, lm_head_s, labels, chunk_size)
        extra, cl_sums, cl_coef = chunk_likelihood_coefs(plan, first)
        coef = plan.ce_weight + cl_coef
    loss, term_sums, logp_label, argmax = ChunkedStudentLoss.apply(
        hidden,
        lm_head_s,
        source,
        chunk_size,
        coef,
        extra,
        torch.is_grad_enabled(),
        fused,
        None,
        unit_upstream,
    )
    plan = source.get()
    if cl_sums is not None:
        term_sums = term_sums + cl_sums
    return loss, loss_metrics(plan, loss, term_sums, logp_label, argmax)

"""The chunked student pass: lm_head, softmax, CE and KD one sequence chunk at a time.

Per chunk of rows it computes the logits `z [c, V_s]`, the loss, and right away the gradient
w.r.t. the logits, then `grad_hidden` and `grad_weight` (accumulated over chunks); backward only
scales them by the incoming gradient. So one `[c, V_s]` block (one or two more per extra
temperature) exists at a time, and the lm_head matmul runs three times in all, as in a plain
forward + backward.

The gradient w.r.t. logits comes from the bucket view of every KD loss. With `e = exp(u − max)`,
`u = z/τ`, `S = Σ e`, a bucket of token set b has `log P_b = log Σ_{j∈b} e_j − log S`, so for a
loss D with `h_b = ∂D/∂log P_b` (closed form, `divergences.bucket_terms`):

    ∂D/∂u_j = h_{b(j)} · e_j / E_{b(j)} − e_j · Σ_b h_b / S

For a single-token bucket `e_j / E_b = 1`; for the tail bucket `E_b` is the tail's e-mass, summed
directly over the non-bucket tokens (never `S − Σ`, which cancels). The whole block is therefore
`e · A_row` plus a scatter of K corrections per row, one elementwise pass over `[c, V_s]`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from crossdistill.losses.divergences import bucket_terms
from crossdistill.losses.plan import Part, Plan
from crossdistill.losses.sharding import VocabShard

NEG_INF = float("-inf")
_OUT_DTYPE_MM: dict[str, bool] = {}


def logits(hidden: Tensor, weight: Tensor, acc: torch.dtype) -> Tensor:
    """`hidden [c, H] @ weight[V, H]ᵀ` as `acc` (float32 from bf16 on CUDA without a copy where
    `torch.mm(..., out_dtype=)` exists)."""
    if hidden.dtype == acc:
        return hidden @ weight.t()
    if hidden.is_cuda and _OUT_DTYPE_MM.get("ok", True):
        try:
            out = torch.mm(hidden, weight.t(), out_dtype=acc)
            _OUT_DTYPE_MM["ok"] = True
            return out
        except (RuntimeError, TypeError):
            _OUT_DTYPE_MM["ok"] = False
    return (hidden @ weight.t()).to(acc)


def chunk_slices(n: int, chunk_size: int, multiple: int = 128) -> list[slice]:
    """Row slices of at most `chunk_size` rows, as few as that allows and of near-equal size
    (rounded up to `multiple` rows where that stays within `chunk_size`): 8192 rows at 3072
    give 2816 + 2816 + 2560, not 3072 + 3072 + 2048, so the largest block, which sets the
    peak memory, is as small as the number of chunks allows."""
    if n <= 0:
        return []
    count = -(-n // chunk_size)
    size = -(-n // count)
    rounded = -(-size // multiple) * multiple
    size = rounded if rounded <= chunk_size else size
    return [slice(r0, min(r0 + size, n)) for r0 in range(0, n, size)]


def accumulate_mm(acc: Tensor | None, a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """`acc + a @ b` in `dtype` (a new product when `acc` is None), the product itself in the
    operands' dtype. With bf16 operands and a float32 accumulator (a float32 master weight's
    gradient) the matmul stays a bf16 one: on CUDA, cuBLAS adds into the float32 buffer directly
    (`addmm(..., out_dtype=)`); elsewhere, a product in the operands' dtype is added."""
    if a.dtype == dtype:
        return a @ b if acc is None else acc.addmm_(a, b)
    if a.is_cuda and _OUT_DTYPE_MM.get("addmm", True):
        try:
            out = (
                torch.mm(a, b, out_dtype=dtype)
                if acc is None
                else torch.addmm(acc, a, b, out_dtype=dtype, out=acc)
            )
            _OUT_DTYPE_MM["addmm"] = True
            return out
        except (RuntimeError, TypeError):
            _OUT_DTYPE_MM["addmm"] = False
    if a.device.type == "cpu":  # no fast half-precision matmul there: the float32 product
        a, b = a.to(dtype), b.to(dtype)
        return a @ b if acc is None else acc.addmm_(a, b)
    prod = a @ b
    return prod.to(dtype) if acc is None else acc.add_(prod)


def _tail_mass(
    e: Tensor, ids: Tensor, valid: Tensor | None, shard: VocabShard | None = None
) -> tuple[Tensor, Tensor]:
    """e at `ids` and the e-mass of all other tokens, by zeroing the buckets in place, summing and
    restoring them (exact; rows with no bucket write their filler id's own value back)."""
    if shard is not None:
        keep = torch.ones_like(ids[:, 0], dtype=torch.bool) if valid is None else valid.any(1)
        return shard.tail_mass(e, ids, keep)
    e_ids = e.gather(1, ids)
    if valid is None:
        hold = torch.zeros_like(e_ids)
    else:
        hold = torch.where(valid.any(1, keepdim=True), 0.0, e_ids)
    e.scatter_(1, ids, hold)
    s_tail = e.sum(1)
    e.scatter_(1, ids, e_ids)
    return e_ids, s_tail


def finish_tail(part: Part, sl: slice, ids: Tensor, s_tail: Tensor, vocab: int) -> Tensor:
    """The tail's e-mass as the loss uses it: exactly 0 when the buckets cover the vocabulary,
    else floored at the smallest normal number so that its log stays finite."""
    s_tail = s_tail.clamp(min=torch.finfo(s_tail.dtype).tiny)
    if part.valid is not None:
        return torch.where(part.valid[sl].sum(1) == vocab, 0.0, s_tail)
    return torch.zeros_like(s_tail) if ids.shape[1] == vocab else s_tail


def part_step(
    part: Part,
    sl: slice,
    z_sel: Tensor,
    e_ids: Tensor | None,
    s: Tensor,
    s_tail: Tensor | None,
    lse_u: Tensor,
    tau: float,
    weight: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """One bucket divergence on a chunk, from the logits at its buckets `z_sel [c, B]`, their
    `e` values, the row sums `s` and the tail mass `s_tail` (for parts with a tail): per-row
    values `[c]` (not weighted: `weighted_sum` weighs them for the loss and for the reported
    metric alike), the row coefficient of `e` `[c]`, and corrections `[c, B]` to add at the ids.
    Rows of weight 0 get no gradient (a zero-weight term still reports its value)."""
    valid = None if part.valid is None else part.valid[sl]
    logp = z_sel / tau - lse_u.unsqueeze(1)
    if valid is not None:
        logp = torch.where(valid, logp, NEG_INF)
    logq = part.logq[sl]
    coef_tail = None
    if s_tail is not None:
        logp_tail = s_tail.log() - s.log()
        terms, h = bucket_terms(
            part.divergence,
            torch.cat([logq, part.logq_tail[sl].unsqueeze(1)], 1),
            torch.cat([logp, logp_tail.unsqueeze(1)], 1),
            **part.params,
        )
        h, h_tail = h[:, :-1], h[:, -1]
        coef_tail = torch.where(s_tail > 0, h_tail / torch.where(s_tail > 0, s_tail, 1.0), 0.0)
    else:
        terms, h = bucket_terms(part.divergence, logq, logp, **part.params)
        h_tail = torch.zeros_like(s)
    if valid is not None:
        h = torch.where(valid, h, 0.0)
    live = weight != 0
    g = weight * (part.scale / tau)
    total_h = h.sum(1) + h_tail
    a = g * (-total_h / s if coef_tail is None else coef_tail - total_h / s)
    corr = h if coef_tail is None else h - e_ids * coef_tail.unsqueeze(1)
    corr = torch.where(live.unsqueeze(1), g.unsqueeze(1) * corr, 0.0)
    if valid is not None:
        corr = torch.where(valid, corr, 0.0)
    return terms.sum(1) * part.scale, torch.where(live, a, 0.0), corr


def weighted_sum(rows: Tensor, weight: Tensor) -> Tensor:
    """Σ rows · weight over the rows of nonzero weight: a row of weight 0 (no KD position)
    adds exactly 0, whatever its value."""
    return torch.where(weight != 0, rows * weight, 0.0).sum()


def select(
    z: Tensor, part: Part, sl: slice, shard: VocabShard | None = None
) -> tuple[Tensor, Tensor]:
    """Logits at the part's buckets, or the student's own top-k (skipping `exclude`)."""
    if shard is not None:
        return _select_sharded(z, part, sl, shard)
    if part.ids is not None:
        ids = part.ids[sl]
        return z.gather(1, ids), ids
    source = z if part.exclude is None else z.masked_fill(part.exclude, NEG_INF)
    return source.topk(min(part.logq.shape[1], z.shape[1]), dim=1)


def _select_sharded(z: Tensor, part: Part, sl: slice, shard: VocabShard) -> tuple[Tensor, Tensor]:
    """`select` on this rank's vocabulary columns; ids and top-k are over the whole vocabulary."""
    if part.ids is not None:
        ids = part.ids[sl]
        return shard.gather(z, ids), ids
    cols = slice(shard.start, shard.start + shard.size)
    source = z if part.exclude is None else z.masked_fill(part.exclude[cols], NEG_INF)
    return shard.topk(source, min(part.logq.shape[1], shard.total))


def chunk_step(
    z: Tensor,
    sl: slice,
    plan: Plan,
    label_coef: Tensor,
    want_grad: bool,
    shard: VocabShard | None = None,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor]:
    """Loss and logit gradient of one chunk. `z [c, V]` is consumed: it becomes the gradient.
    Returns (grad or None, loss, per-term weighted sums `[T]`, label log-probs `[c]`, argmax).
    `shard`: `z` holds this rank's vocabulary columns; row statistics (max, sums, bucket
    logits, top-k) are combined across ranks and the gradient returned is this rank's columns."""
    zmax, argmax = z.max(1) if shard is None else shard.max(z)
    labels = plan.labels[sl]
    labels0 = labels.clamp(min=0).unsqueeze(1)
    z_label = (z.gather(1, labels0) if shard is None else shard.gather(z, labels0)).squeeze(1)
    picked = [[select(z, p, sl, shard) for p in t.parts] for t in plan.terms]
    term_sums = torch.zeros(len(plan.terms), dtype=z.dtype, device=z.device)
    loss = torch.zeros((), dtype=z.dtype, device=z.device)
    out = None
    for tau in [t for t in plan.temperatures if t != 1.0] + [1.0]:
        last = tau == 1.0
        shifted = z.sub_(zmax.unsqueeze(1)) if last else torch.sub(z, zmax.unsqueeze(1))
        e = shifted.exp_() if last else shifted.div_(tau).exp_()  # [c, V]
        s = e.sum(1) if shard is None else shard.sum(e.sum(1))
        lse_u = zmax / tau + s.log()
        row_coef = torch.zeros_like(s)
        fixes: list[tuple[Tensor, Tensor]] = []
        for ti, term in enumerate(plan.terms):
            if term.temperature != tau:
                continue
            weight = term.row_weight[sl]
            for part, (z_sel, ids) in zip(term.parts, picked[ti]):
                e_ids = s_tail = None
                if part.logq_tail is not None:
                    e_ids, s_tail = _tail_mass(
                        e, ids, None if part.valid is None else part.valid[sl], shard
                    )
                    width = e.shape[1] if shard is None else shard.total
                    s_tail = finish_tail(part, sl, ids, s_tail, width)
                rows, a, corr = part_step(part, sl, z_sel, e_ids, s, s_tail, lse_u, tau, weight)
                term_sums[ti] += weighted_sum(rows, term.report_weight[sl])
                loss = loss + weighted_sum(rows, weight)
                row_coef += a
                fixes.append((ids, corr))
        if last:
            loss, logp_label = label_terms(plan, sl, z_label - lse_u, loss)
            row_coef += label_coef / s
            fixes.append((labels0, -label_coef.unsqueeze(1)))
        if want_grad:
            if out is None:
                out = e.mul_(row_coef.unsqueeze(1))
            elif last:
                out = e.mul_(row_coef.unsqueeze(1)).add_(out)
            else:
                out.addcmul_(e, row_coef.unsqueeze(1))
            for ids, corr in fixes:
                if shard is None:
                    out.scatter_add_(1, ids, corr)
                else:
                    shard.scatter_add_(out, ids, corr)
        del e, shifted
    return out, loss, term_sums, logp_label, argmax


def label_terms(plan: Plan, sl: slice, logp: Tensor, loss: Tensor) -> tuple[Tensor, Tensor]:
    """CE on the chunk's labels: (loss with CE added, label log-probs `[c]`, 0 where unlabeled).
    Its gradient is `coef · (softmax − onehot(label))`: `coef / s` on every `e`, `−coef` at the
    label (chunk-likelihood terms fold into the same coefficient)."""
    logp_label = torch.where(plan.labels[sl] >= 0, logp, 0.0)
    return loss - (logp_label * plan.ce_weight[sl]).sum(), logp_label


def compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The matmul dtype: autocast's when it is on, else the inputs' (promoted). On CPU, half
    precision runs in float32: its matmuls would round the logits themselves to 8 bits of
    mantissa (CUDA keeps them in float32 through `out_dtype`), and CPUs gain little from it."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        dtype = torch.get_autocast_dtype(kind)
    else:
        dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if kind == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def run_chunks(
    hidden: Tensor,
    weight: Tensor,
    plan: Plan | LazyPlan,
    chunk_size: int,
    label_coef: Tensor | None,
    need_grad_h: bool,
    need_grad_w: bool,
    dtype: torch.dtype,
    fused: bool | str = False,
    shard: VocabShard | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """All chunks, matmuls in `dtype`: (loss, term sums `[T]`, label log-probs `[N]`, argmax
    `[N]`, grad_hidden, grad_weight) — gradients of the loss, or None where not asked for.
    `plan` may be a `LazyPlan`: it is built after the first chunk's matmul is queued, so that
    the device has work while the host lays out the targets. `label_coef` None: CE only.
    `shard`: `weight` is this rank's vocabulary rows `[V/tp, H]` (see `chunk_step`); grad_weight
    is theirs, and grad_hidden, a sum over the whole vocabulary, is completed across ranks."""
    acc = accumulate_dtype(dtype)
    h_c, w_c = hidden.to(dtype), weight.to(dtype)
    n = hidden.shape[0]
    want = need_grad_h or need_grad_w
    grad_h = torch.empty_like(hidden) if need_grad_h else None
    w_acc = dtype if weight.dtype == dtype else torch.float32
    grad_w = None  # allocated by the first chunk's product: no V·H zero fill
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    logp_label = torch.empty(n, dtype=acc, device=hidden.device)
    argmax = torch.empty(n, dtype=torch.long, device=hidden.device)
    term_sums = None
    for sl in chunk_slices(n, chunk_size):
        # the fused kernels read the logits in the matmul dtype and upcast as they go
        z = h_c[sl] @ w_c.t() if fused == "low" else logits(h_c[sl], w_c, acc)
        if term_sums is None:
            plan = plan.get() if isinstance(plan, LazyPlan) else plan
            label_coef = plan.ce_weight if label_coef is None else label_coef
            term_sums = torch.zeros(len(plan.terms), dtype=acc, device=hidden.device)
        if fused:  # the gradient comes back in the matmul dtype already
            step = fused_step(z, sl, plan, label_coef[sl], want, dtype)
        else:
            step = chunk_step(z, sl, plan, label_coef[sl], want, shard)
        grad, c_loss, c_terms, logp_label[sl], argmax[sl] = step
        del step  # else it would keep this block alive into the next chunk
        loss += c_loss
        term_sums += c_terms
        if grad is None:
            continue
        g_c = grad.to(dtype)
        if grad_h is not None:
            if grad_h.dtype == g_c.dtype:
                torch.mm(g_c, w_c, out=grad_h[sl])  # no [c, H] temporary
            else:
                grad_h[sl] = g_c @ w_c
        if need_grad_w:
            grad_w = accumulate_mm(grad_w, g_c.t(), h_c[sl], w_acc)
        del grad, g_c, z
    if term_sums is None:  # no rows at all
        plan = plan.get() if isinstance(plan, LazyPlan) else plan
        term_sums = torch.zeros(len(plan.terms), dtype=acc, device=hidden.device)
    if need_grad_w and grad_w is None:
        grad_w = torch.zeros(weight.shape, dtype=w_acc, device=weight.device)
    if grad_w is not None:
        grad_w = grad_w.to(weight.dtype)
    if shard is not None and grad_h is not None:
        grad_h = shard.sum(grad_h)
    return loss, term_sums, logp_label, argmax, grad_h, grad_w


class LazyPlan:
    """A plan built on first use (see `run_chunks`)."""

    def __init__(self, build):
        self.build, self.plan = build, None

    def get(self) -> Plan:
        if self.plan is None:
            self.plan = self.build()
        return self.plan


def fused_step(*args):
    from crossdistill.losses.fused import chunk_step_fused

    return chunk_step_fused(*args)


class ChunkedStudentLoss(torch.autograd.Function):
    """Loss of `run_chunks` as an autograd node over (hidden, weight); `extra_loss` (a value whose
    gradient is already folded into `label_coef`) is added to the returned loss. Gradients are
    computed in forward only when `grad_enabled` (the caller's grad mode; inside `forward` it is
    always off) and the input asks for one. `shard`: the weight is a vocabulary shard.
    `unit_upstream`: the loss is backpropagated as is (`loss.backward()`), so backward returns
    the gradients unscaled instead of multiplying them by the upstream gradient (a read and a
    write of the whole `[V, H]` weight gradient); a device-side assert checks it is 1."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        plan,
        chunk_size,
        label_coef,
        extra_loss,
        grad_enabled,
        fused,
        shard,
        unit_upstream=False,
    ):
        dtype = compute_dtype(hidden, weight)  # before autocast is switched off below
        need_h = grad_enabled and ctx.needs_input_grad[0]
        need_w = grad_enabled and ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            loss, term_sums, logp_label, argmax, grad_h, grad_w = run_chunks(
                hidden, weight, plan, chunk_size, label_coef, need_h, need_w, dtype, fused, shard
            )
        ctx.save_for_backward(grad_h, grad_w)
        ctx.applied = None
        ctx.unit_upstream = unit_upstream
        ctx.mark_non_differentiable(term_sums, logp_label, argmax)
        return loss + extra_loss, term_sums, logp_label, argmax

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_h, grad_w = ctx.saved_tensors
        if ctx.unit_upstream:
            # the caller backpropagates the loss itself (`loss.backward()`): the gradients are
            # final as computed, and a pass over the V·H weight gradient is saved. Checked on
            # the device, without a host sync: another upstream gradient stops the run.
            torch._assert_async(grad_loss == 1)
            return grad_h, grad_w, *([None] * 8)
        if grad_h is not None:
            grad_h = grad_h * grad_loss.to(grad_h.dtype)
        if grad_w is not None:
            # Scaled in place: a second V·H buffer would double the memory of the weight
            # gradient. `.data` leaves the version counter alone, and a repeated backward over a
            # retained graph (gradcheck) rescales from the factor already applied.
            factor = grad_loss if ctx.applied is None else grad_loss / ctx.applied
            # foreach: the 0-dim device factor is read once, the pass stays vectorized
            torch._foreach_mul_([grad_w.data], factor.to(grad_w.dtype))
            ctx.applied = grad_loss
        return grad_h, grad_w, *([None] * 8)


@torch.no_grad()
def label_logprobs(
    hidden: Tensor, weight: Tensor, labels: Tensor, chunk_size: int, vocab: VocabShard | None = None
) -> Tensor:
    """`[n]` log-prob of each row's label (0 where unlabeled), chunked, without gradient; over
    this rank's vocabulary shard when `vocab` is given."""
    dtype = compute_dtype(hidden, weight)
    acc = accumulate_dtype(dtype)
    out = torch.zeros(hidden.shape[0], dtype=acc, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        h_c, w_c = hidden.to(dtype), weight.to(dtype)
        for sl in chunk_slices(hidden.shape[0], chunk_size):
            z = logits(h_c[sl], w_c, acc)
            lab = labels[sl].clamp(min=0).unsqueeze(1)
            if vocab is None:
                picked, lse = z.gather(1, lab).squeeze(1), torch.logsumexp(z, 1)
            else:
                picked, lse = vocab.gather(z, lab).squeeze(1), vocab.logsumexp(z)
            out[sl] = torch.where(labels[sl] >= 0, picked - lse, 0.0)
    return out

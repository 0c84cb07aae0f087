"""The chunked student pass: lm_head, softmax, CE and KD one sequence chunk at a time.

Per chunk of rows it computes the logits `z [c, V_s]`, the loss, and right away the gradient
w.r.t. the logits (`chunk_math`), then `grad_hidden` and `grad_weight` (accumulated over
chunks); backward only scales them by the incoming gradient. So one `[c, V_s]` block (one or
two more per extra temperature) exists at a time, and the lm_head matmul runs three times in
all, as in a plain forward + backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from crossdistill.losses.chunk_math import chunk_step, chunk_step_fused
from crossdistill.losses.plan import Plan
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
            step = chunk_step_fused(z, sl, plan, label_coef[sl], want, dtype)
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

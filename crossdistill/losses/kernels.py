"""The Triton kernels of the vocabulary-wide passes (CUDA), each with a plain PyTorch
counterpart, its reference, which also runs where Triton is missing.

1. `row_stats` (`_stats`): one online-softmax pass per row computing the max, its argmax,
   `S_τ = Σ e^{(z−max)/τ}` for every temperature in use, and each tail part's `S_tail` (the same
   sum over tokens outside the part's buckets, read from a per-row bitmask: exact, no `S − Σ`
   cancellation).
2. `logit_grad` (`_grad`): `G = Σ_τ e^{(z−max)/τ} · A_τ[row]` written once, in the matmul dtype,
   over the logits themselves.
3. `block_stats`: per-block maxima and sums of `[c, V]` logits in one pass (the teachers'
   targets).

The logits stay in the matmul dtype (bf16 under bf16 training, as a plain bf16 lm_head produces
them); every exp and sum is float32. Nothing here imports another loss module.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

NEG_INF = float("-inf")
BLOCK_STATS = 2048
SPAN = 16384  # columns per program of the stats kernel (a row is split over several programs)
BLOCK_GRAD = 4096


@functools.cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def stats(
        z_ptr, stride_z, vocab, span, inv_tau_ptr, mask_ptr, stride_mp, stride_mr, mask_tau_ptr,
        max_ptr, arg_ptr, s_ptr, tail_ptr,
        T: tl.constexpr, TP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # program (row, part) reduces columns [part·span, (part+1)·span): partial results go to
        # [row, part, ...] and are combined on the host side of the call (small tensors)
        row = tl.program_id(0)
        part = tl.program_id(1)
        parts = tl.num_programs(1)
        lo = part * span
        hi = tl.minimum(lo + span, vocab)
        t_idx = tl.arange(0, TP)
        p_idx = tl.arange(0, PP)
        # a block is a [W, 32] tile: each bucket-mask word is loaded once and its 32 bits
        # spread over its row of the tile (spans and blocks start at multiples of 32)
        W: tl.constexpr = BLOCK // 32
        w_idx = tl.arange(0, W)
        b_idx = tl.arange(0, 32)
        m = float("-inf")
        arg = 0
        s = tl.zeros([TP], dtype=tl.float32)
        tail = tl.zeros([PP], dtype=tl.float32)
        for start in range(lo, hi, BLOCK):
            cols = start + w_idx[:, None] * 32 + b_idx[None, :]  # [W, 32]
            inside = cols < hi
            x = tl.load(z_ptr + row * stride_z + cols, mask=inside, other=float("-inf"))
            x = tl.reshape(x.to(tl.float32), [BLOCK])  # column order: start + position
            b_max = tl.max(x, 0)
            b_arg = tl.argmax(x, 0) + start
            arg = tl.where(b_max > m, b_arg, arg)
            m_new = tl.maximum(m, b_max)
            for t in tl.static_range(T):  # one exp per element and temperature in use
                inv_tau = tl.load(inv_tau_ptr + t)
                rescale = tl.exp((m - m_new) * inv_tau)  # 0 on the first block
                e = tl.reshape(tl.exp((x - m_new) * inv_tau), [W, 32])
                s = tl.where(t_idx == t, s * rescale + tl.sum(tl.sum(e, 1), 0), s)
                for p in tl.static_range(P):
                    word_at = start // 32 + w_idx
                    word = tl.load(
                        mask_ptr + p * stride_mp + row * stride_mr + word_at,
                        mask=word_at * 32 < hi,
                        other=0,
                    )
                    hit = ((word[:, None] >> b_idx[None, :]) & 1) != 0  # [W, 32]
                    add = tl.sum(tl.sum(tl.where(hit, 0.0, e), 1), 0)
                    mine = (p_idx == p) & (tl.load(mask_tau_ptr + p) == t)
                    tail = tl.where(mine, tail * rescale + add, tail)
            m = m_new
        out = row * parts + part
        tl.store(max_ptr + out, m)
        tl.store(arg_ptr + out, arg)
        tl.store(s_ptr + out * T + t_idx, s, mask=t_idx < T)
        tl.store(tail_ptr + out * P + p_idx, tail, mask=p_idx < P)

    @triton.jit
    def grad(
        z_ptr, stride_z, g_ptr, stride_g, vocab, max_ptr, inv_tau_ptr, coef_ptr,
        T: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        m = tl.load(max_ptr + row)
        x = tl.load(z_ptr + row * stride_z + cols, mask=inside, other=float("-inf")).to(tl.float32)
        g = tl.zeros([BLOCK], dtype=tl.float32)
        for t in tl.static_range(T):  # one exp per element and temperature in use
            inv_tau = tl.load(inv_tau_ptr + t)
            g += tl.exp((x - m) * inv_tau) * tl.load(coef_ptr + row * T + t)
        tl.store(g_ptr + row * stride_g + cols, g.to(g_ptr.dtype.element_ty), mask=inside)

    return triton, stats, grad


@functools.cache
def _block_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def block_stats(
        z_ptr, stride_z, nb, inv_tau_ptr, max_ptr, sum_ptr,
        T: tl.constexpr, B: tl.constexpr, G: tl.constexpr,
    ):  # fmt: skip
        # program (row, g) reduces blocks [g·G, (g+1)·G) of B columns each: their maxima, and
        # per temperature the sum of e^{(z−block max)/τ} inside each block
        row = tl.program_id(0)
        blk = tl.program_id(1) * G + tl.arange(0, G)
        cols = blk[:, None] * B + tl.arange(0, B)[None, :]  # [G, B]
        inside = blk < nb
        x = tl.load(z_ptr + row.to(tl.int64) * stride_z + cols, mask=inside[:, None], other=0.0).to(
            tl.float32
        )
        m = tl.max(x, 1)
        tl.store(max_ptr + row * nb + blk, m, mask=inside)
        for t in tl.static_range(T):
            e = tl.exp((x - m[:, None]) * tl.load(inv_tau_ptr + t))
            tl.store(sum_ptr + (row * nb + blk) * T + t, tl.sum(e, 1), mask=inside)

    return block_stats


BLOCKS_PER_PROGRAM = 16


def block_stats(z: Tensor, block: int, taus: list[float]) -> tuple[Tensor, Tensor]:
    """Per block of `block` columns of `z [c, V]` (V a multiple of `block`): its max `[c, nb]`
    and `Σ e^{(z − block max)/τ}` inside it for each τ `[c, nb, T]`, float32 (float64 for
    float64 input); the Triton kernel on CUDA, else PyTorch."""
    if z.is_cuda and available() and z.dtype != torch.float64:
        return block_stats_triton(z, block, taus)
    return block_stats_torch(z, block, taus)


def block_stats_torch(z: Tensor, block: int, taus: list[float]) -> tuple[Tensor, Tensor]:
    c, v = z.shape
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    zb = z.view(c, v // block, block).to(acc)
    bmax = zb.amax(2)
    d = zb - bmax.unsqueeze(2)
    return bmax, torch.stack([(d / t).exp().sum(2) for t in taus], 2)


def block_stats_triton(z: Tensor, block: int, taus: list[float]) -> tuple[Tensor, Tensor]:
    import triton

    c, v = z.shape
    nb = v // block
    inv_tau = _small([1.0 / t for t in taus], torch.float32, z.device)
    bmax = torch.empty(c, nb, dtype=torch.float32, device=z.device)
    bsum = torch.empty(c, nb, len(taus), dtype=torch.float32, device=z.device)
    grid = (c, triton.cdiv(nb, BLOCKS_PER_PROGRAM))
    _block_kernel()[grid](
        z, z.stride(0), nb, inv_tau, bmax, bsum,
        T=len(taus), B=block, G=BLOCKS_PER_PROGRAM, num_warps=8,
    )  # fmt: skip
    return bmax, bsum


_SMALL: dict[tuple, Tensor] = {}


def _small(values: list[float], dtype, device) -> Tensor:
    """A short constant vector on the device, made once by fills (a host-to-device copy would
    synchronize) and kept for later calls."""
    key = (tuple(values), dtype, str(device))
    if key not in _SMALL:
        _SMALL[key] = torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values])
    return _SMALL[key]


def _pow2(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def bucket_bits(ids: Tensor, valid: Tensor | None, vocab: int) -> Tensor:
    """`[c, ⌈V/32⌉]` int32 words with bit `id % 32` of word `id // 32` set for each valid bucket
    id of the row. Bit 31 is the sign bit: sums of distinct bits wrap to exactly the OR of them
    (two's complement, no carries), and reading a bit back with `(w >> b) & 1` is exact."""
    words = torch.zeros(ids.shape[0], (vocab + 31) // 32, dtype=torch.int32, device=ids.device)
    bits = torch.bitwise_left_shift(torch.ones_like(ids, dtype=torch.int32), (ids % 32).int())
    if valid is not None:
        bits = torch.where(valid, bits, 0)
    return words.scatter_add_(1, ids // 32, bits)


def row_stats(
    z: Tensor, taus: list[float], masks: list[Tensor], mask_tau: list[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(max `[c]`, argmax `[c]`, S `[c, T]` per temperature, S_tail `[c, P]` per mask)."""
    if not (z.is_cuda and available()):
        return row_stats_torch(z, taus, masks, mask_tau)
    return row_stats_triton(z, taus, masks, mask_tau)


def row_stats_triton(
    z: Tensor, taus: list[float], masks: list[Tensor], mask_tau: list[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`row_stats` through the Triton kernel (any device Triton runs on)."""
    triton, stats, _ = _kernels()
    c, vocab = z.shape
    dev = z.device
    inv_tau = _small([1.0 / t for t in taus], torch.float32, dev)
    if len(masks) == 1:
        mask = masks[0].unsqueeze(0)  # a view: no copy
    elif masks:
        mask = torch.stack(masks)
    else:
        mask = torch.zeros(1, c, 1, dtype=torch.int32, device=dev)
    mtau = _small(mask_tau or [0], torch.int32, dev)
    parts = triton.cdiv(vocab, SPAN)
    span = triton.cdiv(triton.cdiv(vocab, parts), BLOCK_STATS) * BLOCK_STATS
    num_p = max(len(masks), 1)
    pmax = torch.empty(c, parts, dtype=torch.float32, device=dev)
    parg = torch.empty(c, parts, dtype=torch.int32, device=dev)
    ps = torch.empty(c, parts, len(taus), dtype=torch.float32, device=dev)
    ptail = torch.empty(c, parts, num_p, dtype=torch.float32, device=dev)
    stats[(c, parts)](
        z, z.stride(0), vocab, span, inv_tau, mask, mask.stride(0), mask.stride(1), mtau,
        pmax, parg, ps, ptail,
        T=len(taus), TP=_pow2(len(taus)), P=len(masks), PP=_pow2(num_p),
        BLOCK=BLOCK_STATS, num_warps=8,
    )  # fmt: skip
    # combine the parts: rescale each part's sums from its own max to the row max
    zmax, best = pmax.max(1)
    scale = ((pmax - zmax.unsqueeze(1)).unsqueeze(2) * inv_tau).exp()  # [c, parts, T]
    s = (ps * scale).sum(1)
    # (basic indexing per mask: a list index would copy it to the device, a synchronization)
    tails = [(ptail[:, :, p] * scale[:, :, t]).sum(1) for p, t in enumerate(mask_tau)]
    tail = torch.stack(tails, 1) if tails else torch.zeros_like(s[:, :1])
    return zmax, parg.gather(1, best.unsqueeze(1)).squeeze(1).long(), s, tail


def logit_grad(z: Tensor, zmax: Tensor, taus: list[float], coef: Tensor, dtype) -> Tensor:
    """`G [c, V] = Σ_τ e^{(z−max)/τ} · coef[:, τ]` in `dtype`, written over `z` when that is
    its dtype (each element is read, then written, by the same program)."""
    if not (z.is_cuda and available()):
        return logit_grad_torch(z, zmax, taus, coef, dtype)
    return logit_grad_triton(z, zmax, taus, coef, dtype)


def logit_grad_triton(z: Tensor, zmax: Tensor, taus: list[float], coef: Tensor, dtype) -> Tensor:
    """`logit_grad` through the Triton kernel."""
    triton, _, grad = _kernels()
    c, vocab = z.shape
    out = z if z.dtype == dtype else torch.empty(c, vocab, dtype=dtype, device=z.device)
    inv_tau = _small([1.0 / t for t in taus], torch.float32, z.device)
    grid = (c, triton.cdiv(vocab, BLOCK_GRAD))
    grad[grid](
        z, z.stride(0), out, out.stride(0), vocab, zmax, inv_tau, coef.float().contiguous(),
        T=len(taus), BLOCK=BLOCK_GRAD, num_warps=8,
    )  # fmt: skip
    return out


def _in_buckets(words: Tensor, vocab: int) -> Tensor:
    cols = torch.arange(vocab, device=words.device)
    return ((words[:, cols // 32] >> (cols % 32)) & 1).bool()


def row_stats_torch(
    z: Tensor, taus: list[float], masks: list[Tensor], mask_tau: list[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`row_stats` in plain PyTorch (the kernel's reference, and its stand-in without Triton)."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    z = z.to(acc)
    zmax, arg = z.max(1)
    e = [((z - zmax.unsqueeze(1)) / tau).exp() for tau in taus]
    s = torch.stack([x.sum(1) for x in e], 1)
    tails = [
        e[t].masked_fill(_in_buckets(w, z.shape[1]), 0.0).sum(1) for w, t in zip(masks, mask_tau)
    ]
    tail = torch.stack(tails, 1) if tails else torch.zeros_like(s[:, :1])
    return zmax, arg, s, tail


def logit_grad_torch(z: Tensor, zmax: Tensor, taus: list[float], coef: Tensor, dtype) -> Tensor:
    """`logit_grad` in plain PyTorch."""
    shifted = z.to(coef.dtype) - zmax.unsqueeze(1)
    out = sum(((shifted / tau).exp() * coef[:, t : t + 1] for t, tau in enumerate(taus)), 0.0)
    return z.copy_(out) if z.dtype == dtype else out.to(dtype)

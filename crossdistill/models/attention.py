"""Attention over packed documents without a mask: variable-length flash attention.

A packed row holds several documents. Given `position_ids` that restart per document,
transformers builds a `[B, 1, T, T]` block-diagonal mask for SDPA, which then runs the
memory-efficient kernel over all `T²` scores (a mask skips no work) and checks on the host
whether the batch is packed at all (a device sync per forward). Flash attention's varlen kernel
takes the documents as cumulative lengths over the flattened batch instead and computes only
each document's causal triangle.

`VARLEN` is registered as a transformers attention implementation (`register_varlen`); a model
built with `attn_implementation="varlen"` uses it. transformers builds no mask for it. The
segments come with the forward's keyword arguments (`segment_kwargs`: `cu_seq_lens_q`,
`max_length_q`, as the collator computes them on the host, so nothing syncs), else from
`position_ids` (a new segment wherever a position is not its predecessor + 1, as transformers
itself detects packing; this costs one host sync for the longest length). Where flash cannot
run (no CUDA, float32, head dim > 256, a torch without `torch.nn.attention.varlen`) the same
function runs SDPA with the equivalent block-causal mask, so results agree on every device; so
do sliding-window layers (Mistral, Gemma-3's local layers) when a segment is longer than the
window.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

VARLEN = "crossdistill_varlen"


def resolve_attention(name: str, config: Any = None) -> str:
    """The transformers implementation name for a config value: `auto` and `varlen` mean the
    varlen path (it falls back to masked SDPA by itself where flash cannot run). A model with
    attention-logit soft-capping (Gemma-2) needs transformers' eager attention, which applies
    it: `auto` picks that, `varlen` is refused."""
    capped = getattr(config, "attn_logit_softcapping", None) is not None
    if name == "auto" and capped:
        return "eager"
    if name in ("auto", "varlen"):
        if capped:
            from crossdistill.errors import UserError

            raise UserError(
                "varlen attention does not apply attention-logit soft-capping, which this "
                "model uses; set attn_implementation: auto (or eager)"
            )
        register_varlen()
        return VARLEN
    return name


def set_attention(model: torch.nn.Module, implementation: str) -> None:
    """Switch every (possibly per-module) config of the model to an attention implementation."""
    seen: set[int] = set()
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and id(cfg) not in seen and hasattr(cfg, "_attn_implementation"):
            seen.add(id(cfg))
            cfg._attn_implementation = resolve_attention(implementation)


@functools.cache
def register_varlen() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN, varlen_attention)


def segments_from_positions(position_ids: Tensor) -> tuple[Tensor, int]:
    """`[B, T]` position ids -> (`cu_seqlens [S + 1]` int32 over the flattened batch, longest
    segment), as `crossdistill.data.batch.segments_from_docs` gives them (one host sync, for the
    longest length)."""
    b, t = position_ids.shape
    starts = torch.ones(b, t, dtype=torch.bool, device=position_ids.device)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    idx = torch.nonzero(starts.reshape(-1)).squeeze(1)
    cu = torch.cat([idx, idx.new_full((1,), b * t)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def segments_of(batch: Any, device: torch.device) -> tuple[Tensor, int] | None:
    """A student or teacher batch's `(cu_seqlens, max_seqlen)` on `device`, None if it has none."""
    cu = getattr(batch, "cu_seqlens", None)
    return None if cu is None else (cu.to(device, non_blocking=True), batch.max_seqlen)


def segment_kwargs(cu_seqlens: Tensor, max_len: int) -> dict[str, Any]:
    """Forward keyword arguments that carry the segments down to every attention layer."""
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


def flash_ok(query: Tensor, scaling: float | None, dtype: torch.dtype | None = None) -> bool:
    """Whether the flash kernel runs `query` (computing in `dtype`, default its own)."""
    if not query.is_cuda or (dtype or query.dtype) not in (torch.float16, torch.bfloat16):
        return False
    head_dim = query.shape[-1]
    if head_dim > 256 or head_dim % 8:
        return False
    # PyTorch's FlashAttention-2 operators, called directly (grouped-query attention native)
    return hasattr(torch.ops.aten, "_flash_attention_forward")


class _FlashVarlen(torch.autograd.Function):
    """Causal FlashAttention-2 over segments: `q [N, H, D]`, `k`/`v` `[N_k, H_kv, D]` (H_kv
    dividing H: the kernel shares each key/value head across its query heads). Segment i is
    query rows `cu_q[i]:cu_q[i+1]` against key rows `cu_k[i]:cu_k[i+1]`; where a segment has
    fewer queries than keys, the queries are the keys' last rows (the kernel's causal mask is
    aligned to the bottom right)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0,
            True, rng, unused, scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None, None


def flash_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, scale
) -> Tensor:
    """`_FlashVarlen` (see there): `[N, H, D]` out of token-major `q`, `k`, `v` in the
    kernel's dtype, `cu_q`/`cu_k` int32 on their device."""
    return _FlashVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale)


def varlen_reference(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float | None
) -> Tensor:
    """What `flash_varlen` computes, one segment at a time through SDPA (any device and dtype;
    tests and the float64 checks)."""
    out = torch.empty_like(q)
    for i in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]))
        if q1 == q0:
            continue
        lq, lk = q1 - q0, k1 - k0
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        seg = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),
            k[k0:k1].transpose(0, 1),
            v[k0:k1].transpose(0, 1),
            attn_mask=mask,
            scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )
        out[q0:q1] = seg.transpose(0, 1)
    return out


@torch.compiler.disable  # a graph break inside compiled blocks: the kernels are opaque anyway
def varlen_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention interface: `query [B, H, T, D]`, `key`/`value` `[B, H_kv, T, D]`
    -> `[B, T, H, D]`, causal within each segment."""
    if dropout:
        raise ValueError("varlen attention has no dropout (distillation runs without it)")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            "varlen attention runs whole sequences, not a key/value cache (generation): build "
            "the model with attn_implementation='sdpa' for that"
        )
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        cu, max_len = segments_from_positions(_positions(kwargs, query))
    else:
        max_len = int(kwargs["max_length_q"])
    b, h, t, d = query.shape
    window = kwargs.get("sliding_window")  # Mistral, Gemma-3 local layers: keys within W
    if window is not None and window >= max_len:
        window = None  # no segment is longer than the window: plain causal
    dtype = compute_dtype(query)
    if window is not None or not flash_ok(query, scaling, dtype):
        return _masked_sdpa(query, key, value, cu, scaling, window), None
    q, k, v = (flat_heads(x, dtype) for x in (query, key, value))
    cu = cu.to(device=q.device, dtype=torch.int32)
    out = flash_varlen(q, k, v, cu, cu, max_len, max_len, scaling)
    return out.view(b, t, h, d), None


def flash_covers(model: torch.nn.Module, device: torch.device, longest: int) -> bool:
    """Whether every attention layer of `model` runs the flash varlen kernel on `device` for
    segments of at most `longest` tokens (no layer falls back to the masked path, whose cost
    grows with the row length squared)."""
    cfg = model.config
    if device.type != "cuda" or getattr(cfg, "_attn_implementation", None) != VARLEN:
        return False
    heads = getattr(cfg, "num_attention_heads", 1)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    dtype = next(model.parameters()).dtype
    query = torch.empty(0, heads, 0, head_dim, dtype=dtype, device=device)
    if not flash_ok(query, None, compute_dtype(query)):
        return False
    window = sliding_window(cfg)
    return window is None or window >= longest


def sliding_window(config: Any) -> int | None:
    """The window of a model's sliding-window layers (Mistral, Gemma-3's local layers), None
    where it has none or turns it off (Qwen configs carry a window with `use_sliding_window:
    false`)."""
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return getattr(config, "sliding_window", None)


def compute_dtype(query: Tensor) -> torch.dtype:
    """The dtype attention computes in: under autocast, the autocast dtype, as SDPA would use.
    A float32 model under bf16 autocast (mixed-precision training with float32 master weights)
    hands attention float32 queries and keys: its projections run in bf16, but the rotary
    embedding multiplies them by float32 cos/sin. Left as they are, they would miss the flash
    kernel and take the masked path over all `T²` scores."""
    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return query.dtype


def _token_major(x: Tensor) -> Tensor:
    """`[B, H, T, D]` with the same values, laid out as `[B, T, H, D]` in memory."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def token_major_rotary(module: Any) -> None:
    """Make `module.apply_rotary_pos_emb` (a transformers modeling module's) hand compiled
    blocks its queries and keys laid out token-major. Where the rotary embedding covers part of
    each head (Phi-3, Phi-4-mini) it ends in a `cat` whose output is head-major; flash then
    writes its output head-major too, and the block copies it back, transposing, before the
    output projection (18 ms of a two-teacher step on an H200). Compiled, the layout change fuses
    into the rotary kernel and both copies go; eager code is left as it was (there it would be
    a copy of its own). The values are unchanged; already token-major tensors are untouched."""
    rotary = getattr(module, "apply_rotary_pos_emb", None)
    if rotary is None or getattr(rotary, "token_major", False):
        return

    @functools.wraps(rotary)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        out = rotary(*args, **kwargs)
        if not (torch.compiler.is_compiling() and isinstance(out, tuple) and len(out) == 2):
            return out
        q, k = out
        if isinstance(q, Tensor) and q.dim() == 4 and q.stride(1) > q.stride(2):
            return _token_major(q), _token_major(k)
        return out

    wrapped.token_major = True
    module.apply_rotary_pos_emb = wrapped


def flat_heads(x: Tensor, dtype: torch.dtype) -> Tensor:
    """`[B, H, T, D]` -> `[B·T, H, D]` in `dtype`, at most one copy."""
    b, h, t, d = x.shape
    x = x.transpose(1, 2)
    if x.dtype != dtype:  # (with the dtype unchanged, `to` ignores the memory format)
        x = x.to(dtype, memory_format=torch.contiguous_format)
    return x.reshape(b * t, h, d)


def _positions(kwargs: dict[str, Any], query: Tensor) -> Tensor:
    pos = kwargs.get("position_ids")
    if pos is None:  # one unpacked sequence per row
        b, _, t, _ = query.shape
        pos = torch.arange(t, device=query.device).expand(b, t)
    return pos


def _masked_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: Tensor,
    scaling: float | None,
    window: int | None = None,
) -> Tensor:
    """The same attention through SDPA and a block-causal mask built from the segments;
    `window`: each query sees only the `window` latest keys (itself included), as transformers'
    sliding-window layers do."""

    b, h, t, _ = query.shape
    cu = cu.to(query.device)
    flat = torch.arange(b * t, device=query.device)
    seg = torch.bucketize(flat, cu[1:], right=True).view(b, t)  # segment of each position
    mask = block_causal_mask(seg)  # [B, 1, T, T]
    if window is not None:
        mask = mask & ~torch.ones(t, t, dtype=torch.bool, device=query.device).tril(-window)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != h
    )
    return out.transpose(1, 2).contiguous()


def block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] document ids -> [B, 1, T, T] bool, True where query `i` may attend to key `j`:
    `j <= i` and both in the same document. Padding (-1) attends to earlier padding only, so
    no row is empty (an all-False row would make SDPA return NaN)."""
    t = doc_ids.shape[-1]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (same & causal)[:, None]

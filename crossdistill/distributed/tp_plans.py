"""Tensor-parallel plans, declared per model family in this one place.

A plan names, per decoder layer, which linear layers are split along their output features
("colwise": each rank computes whole attention heads / MLP channels) and which along their input
features ("rowwise": partial sums, all-reduced). Embeddings and the lm_head are split along the
vocabulary, which is what the vocab-parallel loss consumes.

Fused projections (Phi-3's `qkv_proj` and `gate_up_proj`) stack several outputs in one weight.
A plain colwise split would hand rank 0 all of `q` and none of `v`; instead the rows are
reordered so that each rank's contiguous block is `[q_r; k_r; v_r]` (resp. `[gate_r; up_r]`),
and the attention module is told its local head counts. `fused_row_order` gives that order, so
loading, export and checkpoints can translate between it and the Hugging Face layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from crossdistill.errors import UserError


@dataclass(frozen=True)
class FamilyPlan:
    """How one model family is split: `layer` maps a module path inside a decoder layer to
    "colwise" or "rowwise"; `fused` maps a module path to a function of the HF config giving the
    sizes of the blocks stacked in its weight rows."""

    layer: dict[str, str]
    fused: dict[str, Any] = field(default_factory=dict)
    # attention modules whose forward reads head counts from `config` / attributes (fused qkv)
    local_head_counts: bool = False


_SEPARATE = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def _head_dim(c: Any) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def _qkv_sizes(c: Any) -> list[int]:
    kv = (c.num_key_value_heads or c.num_attention_heads) * _head_dim(c)
    return [c.num_attention_heads * _head_dim(c), kv, kv]


def _gate_up_sizes(c: Any) -> list[int]:
    return [c.intermediate_size, c.intermediate_size]


PLANS: dict[str, FamilyPlan] = {
    "llama": FamilyPlan(_SEPARATE),
    "mistral": FamilyPlan(_SEPARATE),
    "qwen2": FamilyPlan(_SEPARATE),
    # q_norm / k_norm act on one head's features: every rank applies them to its own heads
    "qwen3": FamilyPlan(_SEPARATE),
    "phi3": FamilyPlan(
        {
            "self_attn.qkv_proj": "colwise",
            "self_attn.o_proj": "rowwise",
            "mlp.gate_up_proj": "colwise",
            "mlp.down_proj": "rowwise",
        },
        fused={"self_attn.qkv_proj": _qkv_sizes, "mlp.gate_up_proj": _gate_up_sizes},
        local_head_counts=True,
    ),
}


def family_plan(hf_config: Any) -> FamilyPlan:
    """The plan of a model's family (`config.model_type`); a clear error for others."""
    kind = getattr(hf_config, "model_type", None)
    if kind not in PLANS:
        raise UserError(
            f"tensor parallelism has no plan for model type {kind!r}; supported: "
            f"{', '.join(sorted(PLANS))}. Use tp=1 (FSDP and context parallelism work for it)"
        )
    return PLANS[kind]


def fused_row_order(sizes: list[int], tp: int) -> torch.Tensor:
    """`[sum(sizes)]` HF row index of each row in TP order: rank r's contiguous block holds
    block 0's r-th slice, then block 1's, and so on. Identity for tp = 1."""
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()
    pieces = []
    for r in range(tp):
        for start, size in zip(starts, sizes):
            if size % tp:
                raise UserError(
                    f"a fused projection block of {size} rows does not split over tp={tp}"
                )
            step = size // tp
            pieces.append(torch.arange(start + r * step, start + (r + 1) * step))
    return torch.cat(pieces)


def fused_params(model: torch.nn.Module, hf_config: Any, tp: int) -> dict[str, torch.Tensor]:
    """Parameter name -> row order (HF row of each stored row) for fused weights under `tp`."""
    if tp == 1:
        return {}
    plan = family_plan(hf_config)
    out = {}
    for name, _ in model.named_parameters():
        for path, sizes in plan.fused.items():
            if name.endswith(f"{path}.weight"):
                out[name] = fused_row_order(sizes(hf_config), tp)
    return out

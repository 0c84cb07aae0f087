"""Apply a layout to a Hugging Face causal LM: `apply_tp`, `apply_cp`, `apply_fsdp`,
`apply_activation_checkpointing`, `apply_compile`, and `parallelize_model`, which calls them in
the one order that works (TP, CP, activation checkpointing, compile, FSDP).

Works the same on a meta-device model (sharded loading fills it afterwards) and on a
materialised one (its weights are split as they are)."""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import torch
from torch import nn

from crossdistill.distributed.layout import ParallelLayout
from crossdistill.distributed.tp_plans import family_plan, fused_params
from crossdistill.models.attention import set_attention
from crossdistill.models.forward import HeldElsewhere, decoder_of, final_hidden

HIDDEN_METHOD = "forward_hidden"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a causal LM that this rank holds (a pipeline rank holds
    some; `stages.keep_stages`)."""
    return [b for b in decoder_of(model).layers if not isinstance(b, HeldElsewhere)]


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Split every block by the family's plan (`tp_plans.py`), the embedding and the lm_head along
    the vocabulary. The lm_head is never called as a module: the chunked loss reads its
    vocabulary shard (`[V/tp, H]`) directly. Tied embeddings stay tied."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    cfg = model.config
    plan = family_plan(cfg)
    for name, rows in fused_params(model, cfg, tp).items():
        param = model.get_parameter(name)
        if not param.is_meta:
            with torch.no_grad():
                param.copy_(param[rows.to(param.device)])
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    tied = head.weight is embed.weight
    parallelize_module(
        embed,
        tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    )
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for layer in decoder_layers(model):
        parallelize_module(layer, tp_mesh, {p: styles[k]() for p, k in plan.layer.items()})
        if plan.local_head_counts:
            _localize_heads(layer.self_attn, tp)
    if tied:
        head.weight = embed.weight
    else:
        parallelize_module(head, tp_mesh, ColwiseParallel())


def _localize_heads(attn: nn.Module, tp: int) -> None:
    """Attention modules that slice a fused qkv by config head counts must see this rank's."""
    local = copy.copy(attn.config)
    local.num_attention_heads = attn.config.num_attention_heads // tp
    local.num_key_value_heads = attn.config.num_key_value_heads // tp
    attn.config = local
    if hasattr(attn, "num_key_value_heads"):
        attn.num_key_value_heads //= tp


def apply_cp(model: nn.Module, cp_mesh: Any) -> None:
    """Context parallelism: every attention layer gathers keys and values of the whole sequence
    from its context-parallel group and attends with the packed-document causal mask of its own
    query rows (see `cp.py`). The inputs are cut by `cp.shard_batch` in the forward helper."""
    from crossdistill.distributed.cp import CP_ATTENTION, CPState, register_cp_attention

    register_cp_attention()
    state = CPState(group=cp_mesh.get_group(), size=cp_mesh.size(), rank=cp_mesh.get_local_rank())
    for layer in decoder_layers(model):
        layer.self_attn.cp_state = state
    model.cp_state = state
    set_attention(model, CP_ATTENTION)


def apply_activation_checkpointing(
    model: nn.Module, blocks: int = 0, scope: str = "block", context_fn: Any = None
) -> None:
    """Recompute activations in backward (non-reentrant): each block's whole forward (`scope`
    "block"); only its MLP ("mlp": the gate/up activations, the largest of a block, for its
    gate/up matmuls again; attention is not recomputed); or only the MLP's elementwise work
    ("selective", see `_recompute_elementwise`). `blocks` > 0: only the first `blocks`.
    `context_fn`: `torch.utils.checkpoint`'s, for a whole block's recompute (a pipeline's
    context-parallel attention: `CPState.recompute_context`)."""
    from crossdistill.config import CHECKPOINT_SCOPES

    if scope not in CHECKPOINT_SCOPES:
        raise ValueError(f"checkpoint scope must be one of {CHECKPOINT_SCOPES}, got {scope!r}")
    layers = list(decoder_layers(model))
    chosen = layers[:blocks] if blocks > 0 else layers
    if scope in ("mlp", "selective"):
        for layer in chosen:
            _recompute_in_backward(layer.mlp, elementwise_only=scope == "selective")
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # the older name (deprecated where the new one exists)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for layer in layers[len(chosen) :]:
        layer.gradient_checkpointing = False


_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear")


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Selective checkpointing policy: save matmul outputs, recompute everything else."""
    from torch.utils.checkpoint import CheckpointPolicy

    name = getattr(op, "__name__", str(op)).split(".")[0]
    if name in _MATMULS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_elementwise() -> Any:
    """Contexts for `checkpoint(context_fn=...)` that recompute only what is not a matmul. In a
    gated MLP of a float32 model under bf16 autocast this drops, per block, the bf16 copies of
    its three weights (autocast's casts, which backward would otherwise keep) and the product
    `act(gate)·up` (recomputed from the kept gate and up outputs): 3·H·F + T·F values for a
    few elementwise passes, no matmul."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_matmuls)


def _recompute_in_backward(module: nn.Module, elementwise_only: bool = False) -> None:
    """Run `module` under non-reentrant `torch.utils.checkpoint` while gradients are recorded:
    only its inputs are saved, its forward runs again in backward (`elementwise_only`: matmul
    outputs are saved too, only the rest runs again). The forward is replaced on the instance,
    so parameter names and the state dict are unchanged."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward
    extra = {"context_fn": _recompute_elementwise} if elementwise_only else {}

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    recomputed.recomputes = forward
    module.forward = recomputed


def apply_compile(model: nn.Module) -> None:
    """`torch.compile` each transformer block in place (names and state dict unchanged), with
    dynamic shapes: a teacher's row length changes from batch to batch, and so do the
    attention segments, which would otherwise recompile. Attention itself stays outside the
    compiled graphs (`varlen_attention` is opaque to them); what compiling fuses is the rest:
    norms, rotary embedding, the gated MLP's activation, residual adds; and queries and keys
    leave the rotary kernel laid out as flash wants them (`token_major_rotary`)."""
    from crossdistill.models import attention

    for layer in decoder_layers(model):
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            attention.token_major_rotary(sys.modules[type(attn).__module__])
        layer.compile(dynamic=True)


def apply_block_options(
    model: nn.Module,
    *,
    activation_checkpointing: bool = False,
    checkpoint_blocks: int = 0,
    compile_blocks: bool = False,
    checkpoint_scope: str = "block",
    checkpoint_context: Any = None,
) -> None:
    """Per-block options a model gets on one device as under any layout: activation
    checkpointing (of the first `checkpoint_blocks` blocks, 0 = all; `checkpoint_scope` and
    `checkpoint_context` as `scope` and `context_fn` for `apply_activation_checkpointing`),
    then compiling."""
    if activation_checkpointing:
        apply_activation_checkpointing(
            model, checkpoint_blocks, checkpoint_scope, checkpoint_context
        )
    if compile_blocks:
        apply_compile(model)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: Any,
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
) -> None:
    """FSDP2 per transformer block, plus one root group (embeddings, final norm, lm_head).

    The root's hidden-state forward is registered as an FSDP forward method, so calling
    `model.forward_hidden(ids, pos)` gathers the root group and leaves it gathered for the
    chunked loss, which reads the lm_head weight directly. Gradients are summed across ranks,
    never averaged: every loss term is already divided by its global count."""
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    reduce = torch.float32 if param_dtype is not None else None
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    model.forward_hidden = types.MethodType(_forward_hidden, model)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    register_fsdp_forward_method(model, HIDDEN_METHOD)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # plain sums: gloo has no pre-multiplied sum, and a factor of 1 needs none
            module.set_force_sum_reduction_for_comms(True)


def _forward_hidden(
    self: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None, segments=None
):
    return final_hidden(self, input_ids, position_ids, segments)


def model_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    segments: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """`[B, T] -> [B, T, H]` final hidden states, through FSDP's registered method if any;
    `segments` as for `final_hidden`."""
    method = getattr(model, HIDDEN_METHOD, None)
    if method is not None:
        return method(input_ids, position_ids, segments)
    return final_hidden(model, input_ids, position_ids, segments)


def fsdp_mesh(layout: ParallelLayout, mesh: Any, trainable: bool) -> Any:
    """The mesh FSDP shards over, or None when no data-parallel sync is needed. Parameters are
    sharded over dp_shard x cp (context-parallel ranks hold the same weights); a trainable model
    also replicates over dp_replicate (HSDP). A frozen teacher needs no sync across replicas."""
    shard = layout.dp_shard * layout.cp
    if trainable and layout.dp_replicate > 1:
        return mesh["dp_replicate", "fsdp"]
    return mesh["fsdp"] if shard > 1 else None


def parallelize_model(
    model: nn.Module,
    layout: ParallelLayout,
    mesh: Any,
    *,
    trainable: bool,
    activation_checkpointing: bool = False,
    compile_blocks: bool = False,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    checkpoint_blocks: int = 0,
    checkpoint_scope: str = "block",
) -> nn.Module:
    """Apply `layout` in place: TP, CP, activation checkpointing, compile, then FSDP.
    `reshard_after_forward=False` keeps each block gathered from its forward to its backward
    (no second all-gather; memory of the full model per rank, as plain data parallelism).
    `param_dtype`: FSDP gathers parameters in this dtype (bf16 halves the traffic; gradients
    are still reduced in float32)."""
    options: dict[str, Any] = {
        "activation_checkpointing": activation_checkpointing,
        "checkpoint_blocks": checkpoint_blocks,
        "checkpoint_scope": checkpoint_scope,
        "compile_blocks": compile_blocks,
    }
    if mesh is None:
        apply_block_options(model, **options)
        return model
    if layout.tp > 1:
        apply_tp(model, mesh["tp"])
    if layout.cp > 1:
        apply_cp(model, mesh["cp"])
        if layout.pp > 1:  # a block recomputed for its backward: its micro-batch's sequence
            options["checkpoint_context"] = model.cp_state.recompute_context
    apply_block_options(model, **options)
    dp_mesh = fsdp_mesh(layout, mesh, trainable)
    if dp_mesh is not None:
        apply_fsdp(
            model, dp_mesh, reshard_after_forward=reshard_after_forward, param_dtype=param_dtype
        )
    return model

"""Build a model already laid out over the ranks (one rank included), reading only this rank's
shards.

From a checkpoint folder: meta-device modules -> `parallelize_model` (still on meta) -> storage
for this rank's shards only (`to_empty`) -> each parameter's local block read straight from the
safetensors files with `safe_open(...).get_slice`, which maps the file and touches only the
requested bytes. No rank ever holds the full model: peak memory per rank is about the model size
divided by the number of shards (`local_nbytes` reports it).

From an architecture (random init, tests and benchmarks): the full model is built with the run's
seed, exactly as a single process builds it, and then split, so every layout starts from the
same weights.
"""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import torch
from torch import nn

from crossdistill.config import ModelConfig
from crossdistill.distributed.layout import ParallelLayout
from crossdistill.distributed.parallelize import parallelize_model
from crossdistill.distributed.stages import keep_stages
from crossdistill.distributed.tp_plans import fused_params
from crossdistill.errors import UserError
from crossdistill.models.loading import (
    build_causal_lm,
    build_meta_model,
    checkpoint_files,
    materialize,
    parse_dtype,
)


def build_parallel_model(
    mcfg: ModelConfig,
    layout: ParallelLayout,
    mesh: Any,
    device: torch.device,
    *,
    trainable: bool,
    seed: int,
    activation_checkpointing: bool = False,
    checkpoint_blocks: int = 0,
    checkpoint_scope: str = "block",
    compile_blocks: bool = False,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    stage: int = 0,
) -> nn.Module:
    """The model of `mcfg` under `layout` on this rank (see module doc); under pipeline
    parallelism (`layout.pp` > 1) the stages of pipeline rank `stage` only."""
    dtype = parse_dtype(mcfg.dtype)
    options = {
        "trainable": trainable,
        "activation_checkpointing": activation_checkpointing,
        "checkpoint_blocks": checkpoint_blocks,
        "checkpoint_scope": checkpoint_scope,
        "compile_blocks": compile_blocks,
        "reshard_after_forward": reshard_after_forward,
        "param_dtype": param_dtype,
    }
    if mcfg.path is None:
        model = build_causal_lm(
            None,
            mcfg.arch,
            device=device,
            dtype=dtype,
            overrides=mcfg.overrides,
            attn_implementation=mcfg.attn_implementation,
            seed=seed,
        )
        layout.check_model(model.config)
        keep_stages(model, stage, layout.pp, layout.stages_per_rank)
        return parallelize_model(model, layout, mesh, **options)
    model = build_meta_model(
        mcfg.path,
        None,
        dtype=dtype,
        overrides=mcfg.overrides,
        attn_implementation=mcfg.attn_implementation,
    )
    layout.check_model(model.config)
    keep_stages(model, stage, layout.pp, layout.stages_per_rank)
    parallelize_model(model, layout, mesh, **options)
    materialize(model, device)
    load_local_shards(model, mcfg.path, fused_params(model, model.config, layout.tp))
    return model


def _local_block(param: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """This rank's storage of `param` and the global index block it holds."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(param, DTensor):
        return param.data, tuple(slice(0, n) for n in param.shape)
    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """Consecutive runs `[a, b)` of an index vector, in order."""
    if rows.numel() == 0:
        return []
    breaks = (torch.diff(rows) != 1).nonzero().flatten().add(1).tolist()
    bounds = [0, *breaks, rows.numel()]
    return [(int(rows[s]), int(rows[e - 1]) + 1) for s, e in zip(bounds[:-1], bounds[1:])]


def _read(handle: Any, key: str, block: tuple[slice, ...], order: torch.Tensor | None):
    sl = handle.get_slice(key)
    if order is None:
        return sl[block] if block else sl[:]
    # a fused weight stored in TP order: read each run of HF rows of this rank's block
    rows = order[block[0]]
    return torch.cat([sl[(slice(a, b), *block[1:])] for a, b in _runs(rows)])


@torch.no_grad()
def load_local_shards(
    model: nn.Module, path: str | Path, fused: dict[str, torch.Tensor] | None = None
) -> None:
    """Fill every parameter and persistent buffer with its local block from the checkpoint."""
    from safetensors import safe_open

    fused = fused or {}
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    aliases = _aliases(model)
    needed = set(model.state_dict().keys()) - set(aliases)
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                name = aliases.get(key, key)
                if name not in targets or name in loaded:
                    continue
                dst = targets[name]
                if tuple(f.get_slice(key).get_shape()) != tuple(dst.shape):
                    raise UserError(
                        f"{file}: tensor {key} has shape {tuple(f.get_slice(key).get_shape())}, "
                        f"the model expects {tuple(dst.shape)}"
                    )
                local, block = _local_block(dst)
                local.copy_(_read(f, key, block, fused.get(name)))
                loaded.add(name)
    missing = sorted(needed - loaded)
    if missing:
        raise UserError(
            f"checkpoint {path} lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}"
        )


def _aliases(model: nn.Module) -> dict[str, str]:
    """Second names of shared (tied) parameters -> the name `named_parameters` keeps."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def local_nbytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers this rank stores (its shards)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def full_nbytes(model: nn.Module) -> int:
    """Bytes of the whole model (all shards together)."""
    return sum(t.numel() * t.element_size() for t in list(model.parameters()))


def peak_host_bytes() -> int:
    """The process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

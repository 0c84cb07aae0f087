"""Build a Hugging Face causal LM on the meta device, then materialise it once.

Two sources: a local checkpoint folder (`config.json` + `*.safetensors`), whose tensors are
read straight into the materialised parameters, or an architecture only (a preset name from
`presets.py`, or a `config.json`), randomly initialised. Either way the full model is never
built twice, which is what lets a sharded loader (see `distributed/`) parallelise the meta
model first and read only its own shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from crossdistill.errors import UserError
from crossdistill.models.presets import PRESETS

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,
}


def _dtype_kwarg() -> str:
    from importlib.metadata import version

    major, minor = (int(x) for x in version("transformers").split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


_DTYPE_KWARG = _dtype_kwarg()


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def resolve_hf_config(
    path: str | None = None, arch: str | None = None, overrides: dict[str, Any] | None = None
):
    """The `transformers` config of a checkpoint folder, a `config.json`, or a preset name."""
    from transformers import CONFIG_MAPPING

    if (path is None) == (arch is None):
        raise UserError(
            "a model needs exactly one of `path` (checkpoint folder) or `arch` (preset or config.json)"
        )
    source = path if path is not None else arch
    assert source is not None
    if arch is not None and arch in PRESETS:
        raw = dict(PRESETS[arch])
    else:
        p = Path(source)
        cfg_file = p / "config.json" if p.is_dir() else p
        if not cfg_file.is_file():
            presets = ", ".join(sorted(PRESETS))
            raise UserError(
                f"model {source!r}: no config.json found there; give a checkpoint folder, a "
                f"config.json file, or a preset name ({presets})"
            )
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{cfg_file} is not valid JSON: {e}") from None
    raw.update(overrides or {})
    model_type = raw.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise UserError(f"model {source!r}: unknown model_type {model_type!r} in its config")
    try:
        return CONFIG_MAPPING[model_type](**raw)
    except (TypeError, ValueError) as e:
        raise UserError(f"model {source!r}: invalid config: {e}") from None


def build_causal_lm(
    path: str | None = None,
    arch: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    overrides: dict[str, Any] | None = None,
    attn_implementation: str = "auto",
    seed: int | None = None,
) -> nn.Module:
    """A causal LM from a checkpoint folder (`path`) or an architecture (`arch`, random init)."""
    model = build_meta_model(
        path, arch, dtype=dtype, overrides=overrides, attn_implementation=attn_implementation
    )
    materialize(model, device)
    if path is not None:
        load_safetensors_into(model, path)
    else:
        init_random(model, seed)
    return model


def weight_bytes(hf_config: Any, dtype: str) -> int:
    """Bytes of a model's weights in `dtype` (a config's name for it), counted on the meta
    device (no memory, no init; tied weights once)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    count = sum(p.numel() for p in model.parameters())
    return count * torch.empty((), dtype=DTYPES[dtype]).element_size()


def build_meta_model(
    path: str | None,
    arch: str | None,
    *,
    dtype: torch.dtype,
    overrides: dict[str, Any] | None = None,
    attn_implementation: str = "auto",
) -> nn.Module:
    """The model's modules with parameters on the meta device: no memory, no init."""
    from transformers import AutoModelForCausalLM

    from crossdistill.models.attention import resolve_attention

    config = resolve_hf_config(path, arch, overrides)
    config._attn_implementation = resolve_attention(attn_implementation, config)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, **{_DTYPE_KWARG: dtype})
        except ValueError as e:
            raise UserError(f"model {path or arch!r}: cannot build a causal LM: {e}") from None
    return model


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Allocate the meta model's storage on `device` (this rank's shards only, for a model
    already laid out over ranks) and rebuild non-persistent buffers (rotary frequencies), which
    `to_empty` leaves uninitialised. `to_empty` gives each module a new parameter, so plain
    tied weights are tied again; sharded ones (DTensor) kept their ties through the layout."""
    from torch.distributed.tensor import DTensor

    model.to_empty(device=device)
    _rebuild_rotary(model, torch.device(device))
    _init_non_persistent_buffers(model)
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        model.tie_weights()


def _rebuild_rotary(model: nn.Module, device: torch.device) -> None:
    for name, module in list(model.named_modules()):
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        with torch.device(device):
            fresh = type(module)(config=module.config)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, fresh)


@torch.no_grad()
def _init_non_persistent_buffers(model: nn.Module) -> None:
    """Fill the other non-persistent buffers (Gemma-3's `embed_scale`) with the model's own
    `_init_weights`: they are in no checkpoint, and `to_empty` left them as garbage. The owning
    module's parameters get re-initialised too, and are overwritten when weights are loaded;
    the global RNG is left as it was."""
    init_module = getattr(model, "_init_weights", None)
    if init_module is None:
        return
    with torch.random.fork_rng(devices=[]):
        for module in model.modules():
            if module._non_persistent_buffers_set and not type(module).__name__.endswith(
                "RotaryEmbedding"
            ):
                init_module(module)


@torch.no_grad()
def init_random(model: nn.Module, seed: int | None = None) -> None:
    """Initialise a materialised model with its own `_init_weights` (normal, std=initializer_range)."""
    gen_state = torch.random.get_rng_state()
    if seed is not None:
        torch.manual_seed(seed)
    try:
        if hasattr(model, "initialize_weights"):
            model.initialize_weights()
        else:
            model.apply(model._init_weights)
    finally:
        if seed is not None:
            torch.random.set_rng_state(gen_state)
    model.tie_weights()


def checkpoint_files(path: str | Path) -> list[Path]:
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(
            f"no *.safetensors files in {folder}; convert the checkpoint with "
            "`model.save_pretrained(folder, safe_serialization=True)`"
        )
    return files


@torch.no_grad()
def load_safetensors_into(model: nn.Module, path: str | Path) -> None:
    """Copy every tensor of the checkpoint into the matching materialised parameter or buffer."""
    from safetensors import safe_open

    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    loaded: set[str] = set()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if key not in targets:
                    continue
                dst = targets[key]
                src = f.get_tensor(key)
                if src.shape != dst.shape:
                    raise UserError(
                        f"{file}: tensor {key} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}"
                    )
                dst.copy_(src)
                loaded.add(key)
    tied = _tied_names(model)
    persistent = {n for n, _ in model.state_dict().items()}
    missing = sorted(k for k in persistent if k not in loaded and k not in tied)
    if missing:
        raise UserError(
            f"checkpoint {path} lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}"
        )


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that share storage with an earlier name (tied embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        else:
            seen[id(p)] = name
    return tied

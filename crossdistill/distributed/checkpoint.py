"""Sharded checkpoints with `torch.distributed.checkpoint` (DCP), and the gathered HF export.

A sharded checkpoint lives beside single-process ones, with the same atomic protocol (written
into `.tmp-*`, renamed into place, `latest` replaced, old ones pruned; see
`train/checkpoint.py`)::

    step_000100/
        dcp/                 model + optimizer, each rank writing its own shards
        data_00001.pt        the train loader's state of data-parallel rank 1
        rng_00003.pt         RNG states of global rank 3
        meta.json            format "dcp", step, scheduler, layout and sizes (written last)

DCP stores every tensor with its global shape, so a checkpoint resumes under any world size or
layout (resharding), also in one process. The loader's position resumes exactly when the
data-parallel size is unchanged; otherwise the data stream restarts with a warning.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from crossdistill.errors import UserError
from crossdistill.train import checkpoint as single

log = logging.getLogger(__name__)

DCP_FORMAT = "dcp"
DCP_DIR = "dcp"


def _is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _is_dist() else 0


def _barrier() -> None:
    if _is_dist():
        dist.barrier()


def _broadcast(obj: Any) -> Any:
    if not _is_dist():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def checkpoint_format(folder: Path) -> str | None:
    """ "dcp" for a sharded checkpoint folder, "single" for a single-process one."""
    try:
        meta = json.loads((folder / single.META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return DCP_FORMAT if meta.get("format") == DCP_FORMAT else "single"


def newest(run_dir: str | Path) -> tuple[int, Path, str] | None:
    """The newest complete checkpoint `(step, folder, format)`, agreed by all ranks (rank 0
    looks, after removing leftovers of an interrupted save)."""
    found = None
    if _rank() == 0:
        root = Path(run_dir) / single.CHECKPOINTS_DIR
        if root.is_dir():
            single._clean_leftovers(root)
            for step in sorted(single._complete_steps(root), reverse=True):
                folder = root / single._dir_name(step)
                fmt = checkpoint_format(folder)
                if fmt is not None:
                    found = (step, str(folder), fmt)
                    break
    found = _broadcast(found)
    return None if found is None else (found[0], Path(found[1]), found[2])


def _model_and_optim(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_sharded(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
    data_state: tuple[int, dict[str, Any]] | None,
    rng_state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Every rank writes its shards; rank 0 completes the checkpoint atomically. `data_state`:
    `(data rank, loader state)` from one rank per data-parallel rank, None from the others."""
    import torch.distributed.checkpoint as dcp

    root = Path(run_dir) / single.CHECKPOINTS_DIR
    name = single._dir_name(step)
    tmp = root / f"{single._TMP_PREFIX}{name}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    dcp.save(_model_and_optim(model, optimizer), checkpoint_id=str(tmp / DCP_DIR))
    if data_state is not None:
        single._torch_save(data_state[1], tmp / f"data_{data_state[0]:05d}.pt")
    single._torch_save(rng_state, tmp / f"rng_{_rank():05d}.pt")
    _barrier()
    if _rank() == 0:
        record = {
            "format": DCP_FORMAT,
            "step": int(step),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "state": meta,
        }
        with open(tmp / single.META_FILE, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            single._flush_and_sync(f)
        single._move_into_place(tmp, root / name)
        single._write_marker(root, name)
        single._prune(root, step, keep_last)
    _barrier()
    return root / name


def load_sharded(
    folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load model and optimizer shards for the current layout (any world size); return the
    JSON state that rank 0 saved (step, scheduler, layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    meta = json.loads((folder / single.META_FILE).read_text(encoding="utf-8"))
    single.check_same_student(meta["state"].get("student_config"), model, folder)
    state = _model_and_optim(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(folder / DCP_DIR))
    except Exception as e:
        raise UserError(
            f"checkpoint {folder} cannot be loaded into this model ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); resume with the same student model"
        ) from None
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    out = dict(meta["state"])
    out["step"] = int(meta["step"])
    return out


def load_rank_files(
    folder: Path, data_rank: int, data_size: int, saved_data_size: int
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """This rank's loader state (None when the data-parallel size changed) and RNG state (None
    when this rank had no counterpart)."""
    data = rng = None
    if saved_data_size == data_size:
        data = torch.load(folder / f"data_{data_rank:05d}.pt", weights_only=True)
    else:
        log.warning(
            "data-parallel size changed from %d to %d: the data stream restarts from its "
            "beginning (the order of batches depends on how many ranks read it)",
            saved_data_size,
            data_size,
        )
    rng_file = folder / f"rng_{_rank():05d}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=True)
    return data, rng


def full_state_on_rank0(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict on CPU on rank 0 (empty elsewhere), gathered once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not _is_dist():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def export_hf_gathered(
    model: nn.Module, tokenizer: Any, out: Path, fused: dict[str, torch.Tensor]
) -> None:
    """Write the student as a plain Hugging Face folder from rank 0: the full weights gathered
    once, fused tensor-parallel rows put back in Hugging Face order."""
    import copy

    from transformers import AutoModelForCausalLM

    state = full_state_on_rank0(model)
    if _rank() == 0:
        for name, order in fused.items():
            if name in state:
                restored = torch.empty_like(state[name])
                restored[order] = state[name]
                state[name] = restored
        config = copy.deepcopy(model.config)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config)
        plain.load_state_dict(state, strict=False, assign=True)
        plain.tie_weights()

        def write(folder: Path) -> None:
            plain.save_pretrained(folder, safe_serialization=True)
            tokenizer.save_pretrained(folder)

        single.write_folder(out, write, "the final Hugging Face folder")
    _barrier()

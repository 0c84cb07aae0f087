"""A model folder loaded for evaluation: weights, tokenizer, device, dtype, one clear line for
a folder that is not a model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from crossdistill.errors import UserError


@dataclass
class EvalModel:
    path: str
    model: nn.Module
    tokenizer: Any
    device: torch.device

    @property
    def name(self) -> str:
        return Path(self.path).name or self.path


def load_eval_model(path: str, device: str = "auto") -> EvalModel:
    """`path`'s model (bf16 on a GPU, float32 on a CPU) and its tokenizer."""
    from crossdistill.models import build_causal_lm, load_tokenizer
    from crossdistill.models.loading import checkpoint_files

    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"model folder {path} does not exist")
    if not (folder / "config.json").is_file():
        raise UserError(f"{path} has no config.json: give a Hugging Face model folder")
    checkpoint_files(folder)  # no weights: one line naming the folder
    dev = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    )
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_causal_lm(path=str(folder), device=dev, dtype=dtype).eval()
    return EvalModel(str(path), model, load_tokenizer(str(folder)), dev)

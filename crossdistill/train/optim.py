"""AdamW with decoupled weight decay on matrices only, and a warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from crossdistill.config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on 2-D weights only (not norms, biases or embeddings' tied twins)."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=cfg.betas,
        eps=cfg.eps,
        fused=True if on_cuda else None,
        foreach=None if on_cuda else True,  # one kernel per op over all tensors, not per tensor
    )


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total_steps`."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, cfg.warmup_steps, total_steps, cfg.min_lr_ratio),
    )

"""The frozen teacher: inference dtype, `eval()`, no gradients, no optimizer state, never
checkpointed. Optionally parked on the CPU between steps for small GPUs."""

from __future__ import annotations

import torch
from torch import nn

from crossdistill.models.forward import final_hidden


class Teacher:
    """Wraps a causal LM for distillation. It is deliberately not an `nn.Module`, so it never
    shows up in the student's `parameters()`, optimizer or `state_dict()`."""

    def __init__(self, model: nn.Module, name: str = "teacher", offload: bool = False):
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.name = name
        self.offload = offload
        self._device = next(model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """`[V_t, H]`; targets are computed from hidden states in chunks, never full logits."""
        return self.model.get_output_embeddings().weight

    def to(self, device: torch.device | str) -> Teacher:
        self.model.to(device)
        self._device = torch.device(device)
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    @torch.no_grad()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segments: tuple[torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """Final-layer hidden states `[B, T_t, H]` (after the last norm), without the lm_head;
        `segments` as for `final_hidden`."""
        return final_hidden(self.model, input_ids, position_ids, segments)

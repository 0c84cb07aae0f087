"""Forward passes that return final hidden states (the lm_head and the loss run chunked
elsewhere), with packed documents kept apart.

Packed sequences carry `position_ids` that restart at 0 for each document. transformers (>= 4.53)
turns such position ids, given with `attention_mask=None`, into a block-diagonal causal mask for
SDPA, eager and FlexAttention, and into varlen calls for flash-attention: attention never crosses a
document. `tests/unit/test_models.py` checks that a document packed behind another gives the same
hidden states as the document alone.
"""

from __future__ import annotations

import torch
from torch import nn


def decoder_of(model: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (everything but the lm_head)."""
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    return model.model


def final_hidden(
    model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None
) -> torch.Tensor:
    """`[B, T] -> [B, T, H]`: hidden states after the final norm, documents kept apart by
    `position_ids` (see module doc)."""
    out = decoder_of(model)(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state

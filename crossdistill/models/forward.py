"""Forward passes that return final hidden states (the lm_head and the loss run chunked
elsewhere), with packed documents kept apart.

Packed sequences carry `position_ids` that restart at 0 for each document. With the default
varlen attention (`crossdistill.models.attention`) each document is its own segment of a flash
varlen call; with transformers' own implementations (>= 4.53), such position ids given with
`attention_mask=None` become a block-diagonal causal mask (SDPA, eager, FlexAttention) or varlen
calls (flash-attention): attention never crosses a document. `tests/unit/test_models.py` checks that a document packed behind another gives the same
hidden states as the document alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from crossdistill.models.attention import VARLEN, segment_kwargs


def decoder_of(model: nn.Module) -> nn.Module:
    """The transformer body of a causal LM (everything but the lm_head)."""
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    return model.model


class HeldElsewhere(nn.Module):
    """A transformer block (or final norm) that another pipeline stage holds: it holds nothing
    and passes the hidden states through, so the model's own forward runs this stage's part."""

    def forward(self, hidden_states: Tensor, *args, **kwargs) -> Tensor:
        return hidden_states


def final_hidden(
    model: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    segments: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """`[B, T] -> [B, T, H]`: hidden states after the final norm, documents kept apart by
    `position_ids` (see module doc). `segments`: the batch's `(cu_seqlens, max_seqlen)` from the
    collator, which varlen attention uses instead of deriving them (a host sync). Floating-point
    `input_ids` are hidden states from an earlier pipeline stage (`[B, T, H]`, no embedding)."""
    varlen = getattr(model.config, "_attn_implementation", None) == VARLEN
    use = varlen and segments is not None and segments[0] is not None
    extra = segment_kwargs(*segments) if use else {}
    inputs = {"inputs_embeds" if input_ids.is_floating_point() else "input_ids": input_ids}
    out = decoder_of(model)(**inputs, position_ids=position_ids, use_cache=False, **extra)
    return out.last_hidden_state


def packed_row(
    parts: Sequence[Sequence[int] | np.ndarray], device: torch.device | str
) -> tuple[Tensor, Tensor, tuple[Tensor, int]]:
    """Token sequences packed into one row: ids `[1, N]`, positions `[1, N]` restarting at 0 for
    each sequence, and their segments `(cu_seqlens [S + 1] int32, longest)` as `final_hidden`
    takes them; attention never crosses two sequences (what a cache build, scoring and
    benchmarks run on whole documents)."""
    lengths = [len(p) for p in parts]
    ids = torch.from_numpy(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))
    pos = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return (
        ids.view(1, -1).to(device),
        pos.view(1, -1).to(device),
        (cu.to(device), max(lengths)),
    )

"""Bits per byte of a model on a corpus: its summed next-token NLL in bits over the UTF-8 bytes
of the text it predicted, so models with different tokenizers compare directly. Documents are
encoded and packed exactly as the trainer's validation packs them (start tokens, text,
document end; rows of `seq_len`), and the lm_head runs in chunks (no `[N, V]` logits)."""

from __future__ import annotations

import math
from typing import Any

import torch

from crossdistill.eval.model import EvalModel

LN2 = math.log(2.0)


@torch.no_grad()
def bits_per_byte(
    m: EvalModel,
    corpus: list[str],
    seq_len: int = 2048,
    batch_size: int = 4,
    max_batches: int | None = None,
    text_field: str = "text",
    progress: bool = False,
) -> dict[str, Any]:
    from crossdistill.config import DataConfig
    from crossdistill.data import build_loader
    from crossdistill.losses import student_loss
    from crossdistill.models.attention import segments_of
    from crossdistill.models.forward import final_hidden

    cfg = DataConfig(
        train=list(corpus),
        validation=list(corpus),
        text_field=text_field,
        seq_len=seq_len,
        micro_batch_size=batch_size,
        num_workers=0,
    )
    held = build_loader(
        cfg, m.tokenizer, [], split="validation", pin_memory=False, fill_one_batch=False
    )
    weight = m.model.get_output_embeddings().weight
    nll = torch.zeros((), dtype=torch.float64)
    tokens = nbytes = 0
    bar = _bar(progress, "bits per byte")
    for i, (batch, _) in enumerate(held.stream_batches()):
        if max_batches is not None and i >= max_batches:
            break
        sb = batch.to(m.device).student
        hidden = final_hidden(m.model, sb.input_ids, sb.position_ids, segments_of(sb, m.device))
        # the trainer's chunked loss (its fused kernels on a GPU): CE summed over the labels
        _, metrics = student_loss(
            hidden.flatten(0, 1), weight, sb.labels.flatten(), kd_ratio=0.0, ce_denominator=1.0
        )
        nll += metrics["ce"].double().cpu()
        tokens += sb.num_target_tokens
        nbytes += sb.num_target_bytes
        bar.update(1)
    bar.close()
    if nbytes == 0:
        from crossdistill.errors import UserError

        raise UserError(f"{', '.join(corpus)} holds no text to score")
    return {
        "bpb": float(nll) / LN2 / nbytes,
        "nll_per_token": float(nll) / max(tokens, 1),
        "tokens": tokens,
        "bytes": nbytes,
    }


def _bar(enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(desc=desc, unit="batch", disable=not enabled, dynamic_ncols=True)

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
        hidden, labels = hidden.flatten(0, 1), sb.labels.flatten()
        keep = labels >= 0
        hidden, labels = hidden[keep], labels[keep]
        for r0 in range(0, labels.numel(), 1024):
            logits = (hidden[r0 : r0 + 1024] @ weight.t()).float()
            lp = torch.log_softmax(logits, dim=-1)
            nll -= lp.gather(1, labels[r0 : r0 + 1024, None]).sum().double().cpu()
        tokens += int(keep.sum())
        nbytes += int(sb.target_bytes.sum())
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

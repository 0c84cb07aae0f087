"""Validation: held-out CE, KD terms and bits per byte.

Bits per byte is the tokenizer-independent yardstick: a model's summed next-token NLL over a
text, in bits, divided by the text's UTF-8 bytes. Teacher and student cut the text differently
but cover the same bytes, so their bits per byte compare directly. The teacher's is computed
once (it is frozen) and logged beside the student's at every validation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from crossdistill.config import Config
from crossdistill.losses import kd_count, next_token_nll, student_loss
from crossdistill.models.forward import final_hidden
from crossdistill.train.step import make_term, run_teacher, target_bytes

LN2 = math.log(2.0)


@torch.no_grad()
def evaluate(c: Any, cfg: Config) -> dict[str, float]:
    """Metrics over the first `train.eval_batches` validation batches (the same ones every
    time). Every sum is divided once at the end, so the values do not depend on batching."""
    dev = c.device
    was_training = c.student.training
    c.student.eval()
    lm_head = c.student.get_output_embeddings().weight
    sums: dict[str, torch.Tensor] = {}

    def add(key: str, value: torch.Tensor) -> None:
        sums[key] = sums.get(key, 0) + value.double()

    for s in c.slots:
        if s.teacher.offload:
            s.teacher.to(dev)
    for i, batch in enumerate(c.val_loader):
        if i >= cfg.train.eval_batches:
            break
        labels = batch.student.labels.to(dev).flatten()
        terms = []
        for k, slot in enumerate(c.slots):
            tb = batch.teachers[k]
            targets = run_teacher(slot, tb, cfg.train.loss_chunk_size, dev)
            term = make_term(slot, tb, targets, dev)
            term.denominator = torch.ones((), device=dev)
            terms.append(term)
            add(f"kdn/{slot.cfg.name}", kd_count(term, labels))
            if slot.cfg.name not in c.teacher_bpb:
                add(f"tnll/{slot.cfg.name}", next_token_nll(targets)[0])
                add(f"tbytes/{slot.cfg.name}", target_bytes(slot, tb.labels.to(dev)))
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            hidden = final_hidden(
                c.student, batch.student.input_ids.to(dev), batch.student.position_ids.to(dev)
            )
        _, metrics = student_loss(
            hidden.flatten(0, 1),
            lm_head,
            labels,
            terms,
            kd_ratio=0.5,
            ce_denominator=torch.ones((), device=dev),
            chunk_size=cfg.train.loss_chunk_size,
        )
        add("ce_sum", metrics["ce"])
        add("ce_n", metrics["num_ce"])
        add("bytes", batch.student.target_bytes.to(dev).sum())
        for slot in c.slots:
            add(f"kd/{slot.cfg.name}", metrics[f"kd/{slot.cfg.name}"])
            add(f"top1/{slot.cfg.name}", metrics[f"top1/{slot.cfg.name}"])
    for s in c.slots:
        if s.teacher.offload:
            s.teacher.to("cpu")
    c.student.train(was_training)
    return _finish(c, sums)


def _finish(c: Any, sums: dict[str, torch.Tensor]) -> dict[str, float]:
    v = {k: float(x) for k, x in sums.items()}  # the one host sync of a validation
    n_bytes = max(v.get("bytes", 0.0), 1.0)
    out = {
        "val/loss/ce": v.get("ce_sum", 0.0) / max(v.get("ce_n", 0.0), 1.0),
        "val/bpb/student": v.get("ce_sum", 0.0) / LN2 / n_bytes,
    }
    for slot in c.slots:
        name = slot.cfg.name
        n_kd = max(v.get(f"kdn/{name}", 0.0), 1.0)
        out[f"val/loss/kd/{name}"] = v.get(f"kd/{name}", 0.0) / n_kd
        out[f"val/top1/{name}"] = v.get(f"top1/{name}", 0.0) / n_kd
        if name not in c.teacher_bpb:
            c.teacher_bpb[name] = v[f"tnll/{name}"] / LN2 / max(v[f"tbytes/{name}"], 1.0)
        key = "val/bpb/teacher" if len(c.slots) == 1 else f"val/bpb/teacher/{name}"
        out[key] = c.teacher_bpb[name]
    return out

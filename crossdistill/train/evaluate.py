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
from crossdistill.distributed.runtime import (
    cached_of,
    make_term,
    shard_kwargs,
    target_bytes,
)
from crossdistill.losses import kd_count, next_token_nll, student_loss
from crossdistill.train.step import StepSettings, move_offloaded

LN2 = math.log(2.0)


@torch.no_grad()
def evaluate(c: Any, cfg: Config) -> dict[str, float]:
    """Metrics over the first `train.eval_batches` batches of the validation split: the same
    documents packed the same way every time, however many loader workers and ranks there are
    (`crossdistill.data.HeldOut`). Every sum is divided once at the end; under `torchrun` the
    sums of all data-parallel ranks are added first."""
    dev = c.device
    place = c.placement
    fused = StepSettings.of(cfg.train, c.device).fused  # the loss kernels the step uses
    was_training = c.student.training
    c.student.eval()
    move_offloaded(c.slots, dev)
    fresh = [s.cfg.name for s in c.slots if s.cfg.name not in c.teacher_bpb]
    whole, parts = _zero_sums([s.cfg.name for s in c.slots], fresh, dev)
    # this rank's share of the first eval_batches batches of the split, the same count on every
    # rank (a rank that ran out early would hang the others in a collective)
    for batch in c.val_loader.take(cfg.train.eval_batches):

        def targets_of(i: int, k: int, batch=batch):
            tb, chunk = batch.teachers[k], cfg.train.loss_chunk_size
            return place.teacher_targets(c.slots[k], k, tb, chunk, fused, cached_of(batch, k))

        # where the loss runs (a pipeline's last stage; None on the stages before it)
        targets = place.window_targets(c.slots, [batch.teachers], targets_of)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            if place.pipeline is None:
                hidden, rows = place.student_hidden(c.student, batch.student)
            else:  # the stages hand the batch on; the last one scores it
                hidden, rows = place.pipeline.forward(batch.student)
        if targets is not None:  # an earlier pipeline stage's sums stay zero
            _score(c, cfg, batch, targets[0], hidden, rows, fused, fresh, whole, parts)
    move_offloaded(c.slots, "cpu")
    c.student.train(was_training)
    sums = {**_reduced(whole, place.reduce_counts), **_reduced(parts, place.reduce_sums)}
    if place.pipeline is not None:  # the sums are the last stage's
        sums = _reduced(sums, place.pipeline.sum_over_stages)
    return _finish(c, sums)


def _zero_sums(names: list[str], fresh: list[str], dev: torch.device) -> tuple[dict, dict]:
    """Every sum of a validation at zero, in one order on every rank (the pipeline stages
    before the last keep them at zero): per micro-batch counts, summed over data-parallel
    ranks (`fresh`: teachers whose bits per byte are not known yet), and partial loss sums,
    over every rank that holds a part."""
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    counts = [f"kdn/{n}" for n in names] + [f"{m}/{n}" for m in ("tnll", "tbytes") for n in fresh]
    losses = ["ce_sum", "ce_n"] + [f"{m}/{n}" for m in ("kd", "top1") for n in names]
    return dict.fromkeys([*counts, "bytes"], zero), dict.fromkeys(losses, zero)


def _score(
    c: Any,
    cfg: Config,
    batch: Any,
    targets: list,
    hidden: torch.Tensor,
    rows: Any,
    fused: bool | None,
    fresh: list[str],
    whole: dict[str, torch.Tensor],
    parts: dict[str, torch.Tensor],
) -> None:
    """Add one held-out batch's counts to `whole` and its loss sums to `parts`: `targets`, per
    teacher; `hidden`: the student's final hidden states `[N, H]`, `rows` their row sharding."""
    dev = c.device

    def add(into: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
        into[key] = into[key] + value.double()

    labels = batch.student.labels.to(dev).flatten()
    terms = []
    for k, slot in enumerate(c.slots):
        tb, name = batch.teachers[k], slot.cfg.name
        term = make_term(slot, tb, targets[k], dev, batch.student.input_ids)
        term.denominator = torch.ones((), device=dev)
        terms.append(term)
        add(whole, f"kdn/{name}", kd_count(term, labels))
        if name in fresh:
            add(whole, f"tnll/{name}", next_token_nll(targets[k])[0])
            add(whole, f"tbytes/{name}", target_bytes(tb, dev))
    add(whole, "bytes", batch.student.target_bytes.to(dev).sum())
    lm_head, vocab = c.placement.lm_head(c.student)
    _, metrics = student_loss(
        hidden,
        lm_head,
        labels,
        terms,
        kd_ratio=0.5,
        ce_denominator=torch.ones((), device=dev),
        chunk_size=cfg.train.loss_chunk_size,
        **shard_kwargs(rows, vocab),
        fused=fused,
    )
    add(parts, "ce_sum", metrics["ce"])
    add(parts, "ce_n", metrics["num_ce"])
    for slot in c.slots:
        name = slot.cfg.name
        add(parts, f"kd/{name}", metrics[f"kd/{name}"])
        add(parts, f"top1/{name}", metrics[f"top1/{name}"])


def _reduced(sums: dict[str, torch.Tensor], reduce) -> dict[str, torch.Tensor]:
    """`reduce` applied to all the sums at once (one collective under `torchrun`)."""
    if not sums:
        return sums
    keys = list(sums)
    flat = reduce(torch.stack([torch.as_tensor(sums[k]) for k in keys]))
    return {k: flat[i] for i, k in enumerate(keys)}


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

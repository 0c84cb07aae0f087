"""Teacher targets as one flat byte buffer, and the int8 quantisation they share with the cache.

A separate teacher sends each micro-batch's `TeacherTargets` to the student ranks as one
`uint8` tensor (on the device, so NCCL moves it without a host copy), after the batch's id
(`batch_id`: sequence number, checksum, M, N_t; a small host message the receiver checks before
it takes the payload):

    topk_ids  int32 [M, K]
    tail      float32 [M]
    next      float32 [N_t] next-token log-probs (τ = 1)
    topk      float32 [M, K] log-probs, or uint8 [M, K] codes round(−8·logp) ("int8")
    valid     uint8 [N_t]

Every section that is read back as a 4- or 8-byte type starts at a multiple of its size. The
receiver knows M, K and N_t from its own copy of the batch (`payload_sizes`), so nothing else
travels. Quantised, a row's log-probs are renormalised with its tail on arrival, exactly as the
teacher cache reads its records (`renormalise_top_k`, shared by both).

Size at K = 64: 8·K + 4 = 516 bytes per KD position and 5 per teacher token unquantised, 324
and 5 with int8 codes (the ids are sent whole); 32 bytes of id per micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from crossdistill.config import Quantization
from crossdistill.losses.targets import TeacherTargets, kd_positions

QUANT_SCALE = 8.0  # int8 top-k log-probs: steps of 1/8 nat, down to -31.9


def renormalise_top_k(top_lp: Tensor, tail: Tensor) -> tuple[Tensor, Tensor]:
    """Rows `[M, K]` of dequantised top-k log-probs and their tails `[M]`, shifted so that each
    row's top-k mass plus its tail is exactly 1 again (quantisation moved the sum off 1);
    computed in float64, returned in float32."""
    both = torch.cat([top_lp, tail[:, None]], dim=1).double()
    lse = torch.logsumexp(both, dim=1, keepdim=True).float()
    return top_lp.float() - lse, tail.float() - lse[:, 0]


def quantise(top_lp: Tensor) -> Tensor:
    """uint8 codes of log-probs (steps of 1/8 nat; below -31.9 clipped)."""
    return torch.clamp(torch.round(-top_lp.double() * QUANT_SCALE), 0, 255).to(torch.uint8)


def dequantise(codes: Tensor) -> Tensor:
    return -codes.float() / QUANT_SCALE


def batch_id(seq: int, input_ids: Tensor, labels: Tensor) -> Tensor:
    """int64 `[4]` naming a micro-batch on both sides of a stream: its sequence number, a
    checksum of its teacher inputs and labels, and its sizes. The trainer passes the host copies
    the loaders hand out (no device work); tensors already on a device are summed there and
    read back (one synchronisation)."""
    ids = input_ids.reshape(-1).long()
    lab = labels.reshape(-1).long()
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64, device=ids.device)
    weights = weights % 1_000_003 + 1
    sums = torch.stack([(ids * weights).sum(), ((lab + 7) * weights).sum()]).cpu().tolist()
    check = sums[0] * 31 + sums[1]
    return torch.tensor([seq, check % (1 << 62), ids.numel(), lab.numel()], dtype=torch.int64)


def payload_sizes(tb: Any, depth: int = 1) -> tuple[int, int]:
    """(M top-k rows, N_t tokens) of teacher batch `tb`'s targets: what a receiver counts on
    its own copy of the batch to size and read a payload (with K and the quantisation);
    `depth`: top-k rows per chunk (`TeacherTargets.depth`)."""
    return kd_positions(tb.chunks)[1].shape[0] * depth, tb.labels.numel()


def payload_nbytes(m: int, k: int, n: int, quantization: Quantization) -> int:
    """Bytes of the buffer `pack_targets` makes for M KD positions, top-k K and N_t tokens."""
    top = m * k * (1 if quantization == "int8" else 4)
    return 4 * m * k + 4 * m + 4 * n + top + n


def pack_targets(t: TeacherTargets, quantization: Quantization) -> Tensor:
    """One `uint8` buffer on `t`'s device holding the targets."""
    top = quantise(t.topk_logprobs) if quantization == "int8" else t.topk_logprobs.float().flatten()
    parts = [
        t.topk_ids.to(torch.int32).flatten(),
        t.tail_logprob.float().flatten(),
        t.next_logprobs.float().flatten(),
        top.flatten(),
        t.next_valid.to(torch.uint8).flatten(),
    ]
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts])


def unpack_targets(
    buf: Tensor, m: int, k: int, n: int, quantization: Quantization, temperature: float
) -> TeacherTargets:
    """The targets of a buffer made by `pack_targets`; views into `buf` except where int8
    codes are turned back into log-probs."""
    at = 0

    def take(dtype: torch.dtype, count: int) -> Tensor:
        nonlocal at
        size = torch.empty((), dtype=dtype).element_size() * count
        out = buf[at : at + size].view(dtype)
        at += size
        return out

    ids = take(torch.int32, m * k).view(m, k)
    tail = take(torch.float32, m)
    next_lp = take(torch.float32, n)
    if quantization == "int8":
        top, tail = renormalise_top_k(dequantise(take(torch.uint8, m * k).view(m, k)), tail)
    else:
        top = take(torch.float32, m * k).view(m, k)
    valid = take(torch.uint8, n).bool()
    if at != buf.numel():
        raise ValueError(f"payload holds {buf.numel()} bytes, its layout {at}")
    return TeacherTargets(ids, top, tail, next_lp, valid, temperature=temperature)


def receive_like(
    tb: Any, like: TeacherTargets, transfer: Callable[[Tensor], Any]
) -> TeacherTargets:
    """Targets of teacher batch `tb` that arrive whole (no quantisation) from another rank:
    a buffer sized from this rank's own copy of the batch and `like` (targets of the same
    teacher computed here: K, the id dtype and the temperature) is filled by `transfer(buf)`
    (a receive or a broadcast) and read back."""
    (m, n), k = payload_sizes(tb, like.depth), like.topk_ids.shape[1]
    buf = torch.empty(
        payload_nbytes(m, k, n, "none"), dtype=torch.uint8, device=like.topk_ids.device
    )
    transfer(buf)
    got = unpack_targets(buf, m, k, n, "none", like.temperature)
    got.topk_ids = got.topk_ids.to(like.topk_ids.dtype)
    got.depth = like.depth
    return got

"""Teacher targets: what a teacher hands the student, never full-vocabulary logits.

At the M distribution-matching (KD) positions, the teacher's top-k token ids and log-probs at
temperature τ plus the log of the remaining tail mass; at every teacher position, the log-prob
(at τ = 1) of the actual next token, for chunk-likelihood matching and teacher CE / bits per byte.

Size: with k = top-k, a KD position costs `8·k + 4` bytes (int32 ids, float32 log-probs, float32
tail) — 516 B at k = 64 — and every teacher token `5` bytes (float32 next-token log-prob plus a
bool). At 8k tokens and k = 64 that is about 4.3 MB per sequence, against 2.4 GB for bf16 logits
over a 150k vocabulary. This is what moves between devices and what an on-disk cache stores.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch import Tensor

from crossdistill.errors import UserError
from crossdistill.losses.kernels import available, block_stats, bucket_bits, row_stats
from crossdistill.losses.sharding import VocabShard


@dataclass
class TeacherTargets:
    """One teacher's sparse targets for a flattened batch (M KD positions, N_t teacher rows)."""

    topk_ids: Tensor  # [M, K] int32 teacher token ids, by descending probability
    topk_logprobs: Tensor  # [M, K] float32 log-probs at `temperature`
    tail_logprob: Tensor  # [M] float32 log of the mass outside the top-k (-inf when K = V_t)
    next_logprobs: Tensor  # [N_t] float32 log-prob at τ = 1 of the next token; 0 where invalid
    next_valid: Tensor  # [N_t] bool: the position has a next token
    temperature: float = 1.0
    depth: int = 1  # top-k rows per chunk: 1, or D for the lookahead target (`target_rows`)

    @staticmethod
    def bytes_per_kd_position(top_k: int) -> int:
        return 8 * top_k + 4

    BYTES_PER_TOKEN = 5

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors().values())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TeacherTargets:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> TeacherTargets:
        return self._map(lambda t: t.pin_memory())

    def tensors(self) -> dict[str, Tensor]:
        """The tensors by field name (for safetensors caches); `temperature`, `depth` are
        metadata."""
        meta = ("temperature", "depth")
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in meta}

    def _map(self, fn) -> TeacherTargets:
        return TeacherTargets(
            **{k: fn(v) for k, v in self.tensors().items()},
            temperature=self.temperature,
            depth=self.depth,
        )


def kd_positions(chunks: Tensor) -> tuple[Tensor, Tensor]:
    """Student and teacher KD rows `[C]` of each chunk `[C, 4]` = (s0, s1, t0, t1): the positions
    `s0 − 1` and `t0 − 1` that predict the chunk's first token from the same text prefix; −1
    where the chunk has none (it starts a sequence, or one side is empty)."""
    s0, s1, t0, t1 = chunks.unbind(-1)
    ok = (s0 > 0) & (t0 > 0) & (s1 > s0) & (t1 > t0)
    return torch.where(ok, s0 - 1, -1), torch.where(ok, t0 - 1, -1)


def target_rows(chunks: Tensor, depth: int = 1, past_end: bool = False) -> Tensor:
    """Teacher rows `[C·depth]` whose top-k the loss reads: per chunk, its KD row `t0 − 1`
    (`kd_positions`) and, for the lookahead targets (`depth` > 1), the `depth − 1` rows after it
    that predict the chunk's later teacher tokens (−1 past the chunk's end; with `past_end`,
    one row further: the chunk's last token's, which predicts the text after the chunk)."""
    _, kd = kd_positions(chunks)
    if depth == 1:
        return kd
    t0, t1 = chunks[:, 2], chunks[:, 3]
    d = torch.arange(depth, device=chunks.device)
    rows = kd.unsqueeze(-1) + d
    inside = (kd >= 0).unsqueeze(-1) & (t0.unsqueeze(-1) + d < t1.unsqueeze(-1) + past_end)
    return torch.where(inside, rows, -1).flatten()


def chunk_tokens(input_ids_t: Tensor, chunks: Tensor, depth: int) -> Tensor:
    """`[C, depth]` the first `depth` teacher token ids of each chunk (−1 past its end), from
    the flattened teacher inputs `[N_t]`."""
    t0, t1 = chunks[:, 2], chunks[:, 3]
    at = t0.unsqueeze(-1) + torch.arange(depth, device=chunks.device)
    inside = at < t1.unsqueeze(-1)
    n = input_ids_t.shape[0]
    return torch.where(inside, input_ids_t[at.clamp(max=n - 1)].long(), -1)


def _logits(hidden: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
    return (hidden @ weight.t()).to(out_dtype)


def _acc(hidden_t: Tensor) -> torch.dtype:
    return torch.float64 if hidden_t.dtype == torch.float64 else torch.float32


def _buffers(hidden_t: Tensor, top_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per teacher row: top-k log-probs `[N_t, K]`, top-k ids `[N_t, K]`, tail `[N_t]`,
    next-token log-prob `[N_t]`, filled chunk by chunk."""
    n, dev, acc = hidden_t.shape[0], hidden_t.device, _acc(hidden_t)
    return (
        torch.empty(n, top_k, dtype=acc, device=dev),
        torch.empty(n, top_k, dtype=torch.int64, device=dev),
        torch.empty(n, dtype=acc, device=dev),
        torch.empty(n, dtype=acc, device=dev),
    )


def _tail_floor(top_k: int, width: int) -> float:
    """float32's smallest normal when a tail exists (its log stays finite), else 0."""
    return torch.finfo(torch.float32).tiny if top_k < width else 0.0


def _gathered(
    top_ids: Tensor,
    top_lp: Tensor,
    tail: Tensor,
    next_lp: Tensor,
    kd_index_t: Tensor,
    next_ids_t: Tensor,
    temperature: float,
) -> TeacherTargets:
    """The per-row results at the KD rows (top-k, tail) and everywhere (next token)."""
    rows = kd_index_t.clamp(min=0)
    next_valid = next_ids_t >= 0
    return TeacherTargets(
        topk_ids=top_ids[rows].to(torch.int32),
        topk_logprobs=top_lp[rows],
        tail_logprob=tail[rows],
        next_logprobs=torch.where(next_valid, next_lp, 0.0),
        next_valid=next_valid,
        temperature=float(temperature),
    )


@torch.no_grad()
def teacher_targets(
    hidden_t: Tensor,
    lm_head_t: Tensor,
    kd_index_t: Tensor,
    next_ids_t: Tensor,
    top_k: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    vocab: VocabShard | None = None,
    fused: bool | None = None,
) -> TeacherTargets:
    """Top-k targets at `kd_index_t` and next-token log-probs everywhere, in sequence chunks.

    `hidden_t [N_t, H_t]` final hidden states, `lm_head_t [V_t, H_t]`, `kd_index_t [M]` teacher
    rows (−1 = none: that row of the result is filler the loss masks out), `next_ids_t [N_t]` the
    next token id per row (< 0 = none). Only one `[chunk_size, V_t]` block of logits exists at a
    time. The tail is computed by summing the non-top-k probabilities directly (no `1 − Σ`
    cancellation); when K < V_t it is floored at float32's smallest normal so that it is never
    −inf, which would make reverse-KL-like losses infinite.

    `vocab`: `lm_head_t` holds this rank's vocabulary rows only (tensor parallelism); softmax
    statistics are combined across ranks and the top-k is the top-k of every rank's top-k.

    `fused`: the vocabulary-wide pass in one kernel per chunk (`fused_chunk`); None = where it
    applies (CUDA with Triton, half-precision hidden states), False = the PyTorch code.
    """
    width = vocab.total if vocab is not None else lm_head_t.shape[0]
    if not 0 < top_k <= width:
        raise UserError(f"top_k must be in [1, {width}] (the teacher vocabulary), got {top_k}")
    if temperature <= 0:
        raise UserError(f"temperature must be > 0, got {temperature}")
    if vocab is not None:
        return _sharded_targets(
            hidden_t, lm_head_t, kd_index_t, next_ids_t, top_k, temperature, chunk_size, vocab
        )
    num_rows, acc = hidden_t.shape[0], _acc(hidden_t)
    top_lp, top_ids, tail, next_lp = _buffers(hidden_t, top_k)
    tail_floor = _tail_floor(top_k, width)
    fused = _use_fused(hidden_t) if fused is None else fused and _use_fused(hidden_t)
    for r0 in range(0, num_rows, chunk_size):
        r1 = min(r0 + chunk_size, num_rows)
        if fused:
            z = hidden_t[r0:r1] @ lm_head_t.t()  # [c, V_t] in the model's half precision
            out = fused_chunk(z, next_ids_t[r0:r1], top_k, temperature, tail_floor)
            next_lp[r0:r1], top_lp[r0:r1], top_ids[r0:r1], tail[r0:r1] = out
            continue
        z = _logits(hidden_t[r0:r1], lm_head_t, acc)  # [c, V_t]
        nxt = next_ids_t[r0:r1].clamp(min=0).unsqueeze(1)
        next_lp[r0:r1] = z.gather(1, nxt).squeeze(1) - torch.logsumexp(z, dim=1)
        vals, ids = z.topk(top_k, dim=1)  # sorted, descending
        zmax = vals[:, :1]
        e = z.sub_(zmax).div_(temperature).exp_()  # in place: [c, V_t] at τ, max 1
        log_s = e.sum(1).log()
        e.scatter_(1, ids, 0.0)
        tail[r0:r1] = e.sum(1).clamp(min=tail_floor).log() - log_s
        top_lp[r0:r1] = (vals - zmax) / temperature - log_s.unsqueeze(1)
        top_ids[r0:r1] = ids
    return _gathered(top_ids, top_lp, tail, next_lp, kd_index_t, next_ids_t, temperature)


def _use_fused(hidden_t: Tensor) -> bool:
    return hidden_t.is_cuda and hidden_t.dtype in (torch.bfloat16, torch.float16) and available()


TOPK_BLOCK = 128  # columns per block of `topk_by_blocks`


def topk_by_blocks(z: Tensor, k: int, block: int = TOPK_BLOCK) -> tuple[Tensor, Tensor]:
    """`z.topk(k, dim=1)` (values sorted, descending) from the blocks of `block` columns with the
    k largest maxima: one max-reduction pass over `z [c, V]`, then top-k over `[c, V / block]`
    maxima and over the `[c, k·block]` candidates, instead of a radix select over all of `z`.

    Exact in values: an element above the k-th largest value v_k whose block were not among
    those k would leave k block maxima ≥ it, so k + 1 elements above v_k. If more than k blocks
    reach v_k, the k taken hold k elements ≥ v_k. Among equal values, which ids are returned may
    differ from `torch.topk` (which leaves that order unspecified too). Falls back to
    `torch.topk` where `block` does not divide V or the blocks would not save work."""
    if not _blocks_apply(z, k, block):
        return z.topk(k, dim=1)
    c, v = z.shape
    vals, ids, _, _, _ = _top_of_blocks(z, z.view(c, v // block, block).amax(2), k, block)
    return vals, ids


def _blocks_apply(z: Tensor, k: int, block: int) -> bool:
    """Whether the top-k can come from blocks: whole blocks, and many more of them than k."""
    v = z.shape[1]
    return v % block == 0 and v // block > 4 * k and z.is_contiguous()


def _top_of_blocks(
    z: Tensor, block_max: Tensor, k: int, block: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The top-k of `z [c, V]` from the k blocks with the largest `block_max [c, V / block]`:
    (values `[c, k]` descending, ids `[c, k]`, the blocks taken `[c, k]`, their candidates
    `[c, k·block]`, the top-k's positions among the candidates `[c, k]`)."""
    c, v = z.shape
    best = block_max.topk(k, dim=1).indices  # [c, k] blocks
    blocks = z.view(c, v // block, block)
    cand = blocks.gather(1, best.unsqueeze(2).expand(c, k, block)).view(c, k * block)
    vals, at = cand.topk(k, dim=1)
    return vals, best.gather(1, at // block) * block + at % block, best, cand, at


def _chunk_log_probs(
    z: Tensor,
    next_ids: Tensor,
    vals: Tensor,
    zmax: Tensor,
    s: Tensor,
    tail: Tensor,
    temperature: float,
    tail_floor: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(next log-prob `[c]`, top-k log-probs `[c, k]`, tail log-prob `[c]`) of a chunk from its
    row max `zmax [c]`, sums `s [c, T]` (τ = 1 first, τ last) and tail sum `tail [c]` at τ."""
    nxt = next_ids.clamp(min=0).unsqueeze(1)
    next_lp = z.gather(1, nxt).squeeze(1).to(zmax.dtype) - zmax - s[:, 0].log()
    log_s = s[:, -1].log()
    top_lp = (vals.to(zmax.dtype) - zmax.unsqueeze(1)) / temperature - log_s.unsqueeze(1)
    return next_lp, top_lp, tail.clamp(min=tail_floor).log() - log_s


def _blocks_chunk(
    z: Tensor, next_ids: Tensor, top_k: int, temperature: float, tail_floor: float
) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """`fused_chunk` from per-block maxima and sums (`kernels.block_stats`, one pass over `z`):
    the row max and `S_τ` combine the blocks; the top-k comes from the k blocks with the largest
    maxima (as in `topk_by_blocks`); the tail is the sum over the other blocks plus the sum over
    the candidates outside the top-k, both sums of positive terms (exact, no `S − Σ`). None
    where the blocks do not apply."""
    if not _blocks_apply(z, top_k, TOPK_BLOCK):
        return None
    taus = [1.0] if temperature == 1.0 else [1.0, temperature]
    bmax, bsum = block_stats(z, TOPK_BLOCK, taus)
    zmax = bmax.max(1).values
    shift = bmax - zmax.unsqueeze(1)  # each block's sums rescaled to the row max
    weight = torch.stack([bsum[:, :, i] * (shift / t).exp() for i, t in enumerate(taus)], 2)
    s = weight.sum(1)  # [c, T]
    vals, ids, best, cand, at = _top_of_blocks(z, bmax, top_k, TOPK_BLOCK)
    rest = weight[:, :, -1].scatter(1, best, 0.0).sum(1)  # blocks outside the top-k blocks
    e = ((cand.to(zmax.dtype) - zmax.unsqueeze(1)) / taus[-1]).exp().scatter(1, at, 0.0)
    tail = rest + e.sum(1)  # + candidates outside the top-k
    next_lp, top_lp, tail_lp = _chunk_log_probs(
        z, next_ids, vals, zmax, s, tail, temperature, tail_floor
    )
    return next_lp, top_lp, ids, tail_lp


def fused_chunk(
    z: Tensor,
    next_ids: Tensor,
    top_k: int,
    temperature: float,
    tail_floor: float,
    flow: Literal["blocks", "bitmask"] = "blocks",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk of `teacher_targets` from half-precision logits `z [c, V_t]` (what the bf16
    lm_head gives; the float32 path upcasts exactly these values): (next log-prob, top-k
    log-probs, top-k ids, tail log-prob). `flow` "blocks": one pass for per-block maxima and
    sums, everything else from them (`_blocks_chunk`; the default, it reads the chunk once
    less, see benchmarks/README.md); "bitmask", and wherever the blocks do not apply: top-k by
    blocks, then one kernel for the max and the sums at τ = 1 and at τ and the tail (the sum
    over the non-top-k tokens, read from a bitmask: exact, no `S − Σ` cancellation)."""
    if flow == "blocks":
        out = _blocks_chunk(z, next_ids, top_k, temperature, tail_floor)
        if out is not None:
            return out
    vals, ids = topk_by_blocks(z, top_k)  # sorted, descending
    taus = [1.0] if temperature == 1.0 else [1.0, temperature]
    zmax, _, s, tail = row_stats(z, taus, [bucket_bits(ids, None, z.shape[1])], [len(taus) - 1])
    next_lp, top_lp, tail_lp = _chunk_log_probs(
        z, next_ids, vals, zmax, s, tail[:, 0], temperature, tail_floor
    )
    return next_lp, top_lp, ids, tail_lp


@torch.no_grad()
def _sharded_targets(
    hidden_t: Tensor,
    lm_head_t: Tensor,
    kd_index_t: Tensor,
    next_ids_t: Tensor,
    top_k: int,
    temperature: float,
    chunk_size: int,
    vocab: VocabShard,
) -> TeacherTargets:
    """`teacher_targets` with the vocabulary split over ranks (`lm_head_t [V_t/tp, H_t]`);
    arguments already checked there."""
    num_rows, acc = hidden_t.shape[0], _acc(hidden_t)
    top_lp, top_ids, tail, next_lp = _buffers(hidden_t, top_k)
    tail_floor = _tail_floor(top_k, vocab.total)
    for r0 in range(0, num_rows, chunk_size):
        r1 = min(r0 + chunk_size, num_rows)
        z = _logits(hidden_t[r0:r1], lm_head_t, acc)  # [c, V_t/tp]
        nxt = next_ids_t[r0:r1].clamp(min=0).unsqueeze(1)
        next_lp[r0:r1] = vocab.gather(z, nxt).squeeze(1) - vocab.logsumexp(z)
        vals, ids = vocab.topk(z, top_k)  # global ids, sorted, descending
        zmax = vals[:, :1]
        e = z.sub_(zmax).div_(temperature).exp_()
        log_s = vocab.sum(e.sum(1)).log()
        keep = torch.ones(r1 - r0, dtype=torch.bool, device=e.device)
        _, s_tail = vocab.tail_mass(e, ids, keep)  # Σ e over the non-top-k tokens, directly
        tail[r0:r1] = s_tail.clamp(min=tail_floor).log() - log_s
        top_lp[r0:r1] = (vals - zmax) / temperature - log_s.unsqueeze(1)
        top_ids[r0:r1] = ids
    return _gathered(top_ids, top_lp, tail, next_lp, kd_index_t, next_ids_t, temperature)


def next_token_nll(targets: TeacherTargets, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The teacher's own next-token NLL summed over valid positions (and `mask [N_t]` if given),
    with the count: sum both over the global batch for the teacher's CE or bits per byte."""
    valid = targets.next_valid if mask is None else targets.next_valid & mask
    nll = torch.where(valid, -targets.next_logprobs, 0.0).sum()
    return nll, valid.sum()

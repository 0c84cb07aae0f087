"""The batch the trainer consumes, and the collation of packed rows into it.

Attention across packed documents: each row holds several documents, told apart by `doc_ids`;
`position_ids` restart at 0 for every document so rotary positions match an unpacked run. The
collator also gives each side its attention segments (`cu_seqlens`, `max_seqlen`), computed here
on the host, which varlen attention takes instead of a mask (`crossdistill.models.attention`);
`models.attention.block_causal_mask(doc_ids)` is the equivalent `[B, 1, T, T]` mask for SDPA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE = -100
_TORCH_DTYPES = {
    np.int64: torch.int64,
    np.int32: torch.int32,
    np.bool_: torch.bool,
    np.float32: torch.float32,
}


@dataclass
class StudentBatch:
    """Student tensors, all `[B, T_s]` int64 with `T_s = seq_len`.

    input_ids: token ids (pad id where `doc_ids == -1`).
    labels: already shifted: `labels[b, i]` is the target of position `i` (token `i + 1`), or
        -100 where there is no loss (padding, the last token of a document, targets outside
        the `loss_on` set: prompts and chat template).
    position_ids: restart at 0 for each packed document (a continued piece goes on counting).
    doc_ids: 0, 1, ... per document within a row, -1 on padding.
    target_bytes: bytes of the text covered by each label token (0 where `labels == -100`),
        for bits per byte: the text's own UTF-8 bytes (a SentencePiece dummy-prefix space and
        Unicode normalisation do not count), so every tokenizer divides by the same number.
    num_target_tokens / num_target_bytes: the totals of `labels != -100` and `target_bytes`
        as Python ints (no device sync needed to count).
    cu_seqlens: [S + 1] int32 start of each attention segment (a run of one `doc_ids` value
        within a row) in the flattened `[B·T_s]`, then `B·T_s`; `max_seqlen` the longest, as a
        Python int. What varlen attention takes instead of a mask
        (`crossdistill.models.attention`); None for batches built by hand.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    target_bytes: torch.Tensor
    num_target_tokens: int
    num_target_bytes: int
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0


@dataclass
class TeacherBatch:
    """One teacher's tensors. `[B, T_t]` int64 with `T_t` the longest row rounded up to
    `pad_multiple` (a teacher with the student's tokenizer shares the student's tensors and
    `T_t = T_s`). `input_ids`, `labels`, `position_ids`, `doc_ids` mean what they mean for the
    student, in teacher tokens.

    chunks: [C, 4] int64 `(s0, s1, t0, t1)`, flattened over the batch: student rows
        `[s0, s1)` of `input_ids_s.view(-1)` and teacher rows `[t0, t1)` of
        `input_ids_t.view(-1)` cover the same text. In order, contiguous within each document
        piece, every non-pad token on both sides in exactly one chunk.
    kd_valid: [C] bool. The KD position of chunk `c` is student row `s0 - 1` vs teacher row
        `t0 - 1`; False where there is none: a document's first chunk, chat template chunks,
        a loss-masked target (`labels_s.view(-1)[s0 - 1] == -100`). For a teacher with the
        student's tokenizer every token is its own chunk and `kd_valid` is exactly
        `labels_s != -100` shifted by one: the ordinary same-tokenizer positions.
    num_kd: `kd_valid.sum()` as a Python int.
    same_as_student: True when this teacher reuses the student's tensors.
    cu_seqlens / max_seqlen: the teacher's attention segments, as for the student.
    real_index / real_cu_seqlens / real_max_seqlen (cross teachers): the flat positions of the
        non-pad tokens `[N]` and their segments once the padding is dropped, so the teacher's
        body can run on `[1, N]` instead of `[B, T_t]` (`distributed.runtime.Placement`).
    target_bytes: `[B, T_t]` bytes of the text each label covers, as the student's: over the
        same text both sides' sums are equal (the teacher's bits per byte divides by it).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    chunks: torch.Tensor
    kd_valid: torch.Tensor
    num_kd: int
    same_as_student: bool
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    real_index: torch.Tensor | None = None
    real_cu_seqlens: torch.Tensor | None = None
    real_max_seqlen: int = 0
    target_bytes: torch.Tensor | None = None


@dataclass
class CachedTargets:
    """A cached teacher's targets for one micro-batch, read from its cache by the loader: the
    fields of `losses.TeacherTargets`, in the same coordinates as a live teacher's (top-k rows
    at each chunk's KD position `t0 - 1` of its `TeacherBatch`, and the rows after it that its
    target reads (`losses.target_rows`), next-token log-probs over the padded `[B·T_t]`)."""

    topk_ids: torch.Tensor  # [M, K] int32
    topk_logprobs: torch.Tensor  # [M, K] float32 at `temperature`
    tail_logprob: torch.Tensor  # [M] float32
    next_logprobs: torch.Tensor  # [N_t] float32 at τ = 1, 0 where invalid
    next_valid: torch.Tensor  # [N_t] bool
    temperature: float = 1.0


@dataclass
class Batch:
    """One micro-batch: the student and one entry per configured teacher, in config order;
    `cached[i]`: teacher i's targets when it reads from a cache (else None; empty when no
    teacher does)."""

    student: StudentBatch
    teachers: list[TeacherBatch]
    cached: list[CachedTargets | None] = dataclasses.field(default_factory=list)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """All tensors on `device`, in one copy per underlying buffer (see `pack_tensors`)."""
        return _map_buffers(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Batch:
        """Called by the DataLoader's pinning thread; shared tensors stay shared."""
        return _map_buffers(self, lambda t: t.pin_memory())


def pack_tensors(arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """Tensors with the contents of `arrays`, all views of one byte buffer (8-byte aligned).

    One buffer per batch matters: a DataLoader worker sends each tensor storage through its
    own shared-memory segment, which costs ~1-2 ms each, so 17 separate tensors cost more
    than building the batch. Pinning and device copies likewise move one buffer.
    """
    sizes = [-(-a.nbytes // 8) * 8 for a in arrays]
    buffer = torch.empty(sum(sizes), dtype=torch.uint8)
    raw = buffer.numpy()
    out, offset = [], 0
    for a, size in zip(arrays, sizes):
        a = np.ascontiguousarray(a)
        raw[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        dtype = _TORCH_DTYPES[a.dtype.type]
        out.append(buffer[offset : offset + a.nbytes].view(dtype).view(a.shape))
        offset += size
    return out


def _map_buffers(batch: Batch, fn: Any) -> Batch:
    """Apply `fn` once per underlying storage and rebuild every tensor as the same view of the
    result, so a batch packed into one buffer stays one buffer."""
    done: dict[int, torch.Tensor] = {}

    def move(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in done:
            done[key] = fn(torch.empty(0, dtype=torch.uint8).set_(storage))
        start = t.storage_offset() * t.element_size()
        flat = done[key][start : start + t.numel() * t.element_size()]
        return flat.view(t.dtype).view(t.shape)

    def walk(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return move(obj) if obj.is_contiguous() else fn(obj)
        if isinstance(obj, list):
            return [walk(x) for x in obj]
        if dataclasses.is_dataclass(obj):
            return dataclasses.replace(
                obj, **{f.name: walk(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
            )
        return obj

    return walk(batch)


def segments_from_docs(doc_ids: np.ndarray) -> tuple[np.ndarray, int]:
    """`[B, T]` document ids (-1 on padding) -> (`cu_seqlens [S + 1]` int32 over the flattened
    batch, longest segment). A segment is a run of equal ids within a row (padding is one run)."""
    b, t = doc_ids.shape
    starts = np.ones((b, t), dtype=bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    cu = np.append(np.flatnonzero(starts.reshape(-1)), b * t).astype(np.int32)
    return cu, int(np.diff(cu).max()) if cu.size > 1 else 0


def real_segments(doc_ids: np.ndarray, cu: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """`[B, T]` document ids (-1 on padding) and their `segments_from_docs` cu_seqlens -> (flat
    positions of the non-pad tokens `[N]`, `cu_seqlens` of their segments once the padding is
    dropped, longest segment): the same segments without the padding runs; rows stay apart."""
    flat = doc_ids.reshape(-1)
    index = np.flatnonzero(flat >= 0)
    lengths = np.diff(cu)
    lengths = lengths[flat[cu[:-1]] >= 0]
    real_cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return index, real_cu, int(lengths.max()) if lengths.size else 0


def shifted_labels(ids: np.ndarray, target: np.ndarray, doc: np.ndarray) -> np.ndarray:
    """[B, T] labels: the next token where it is a target in the same document, else -100."""
    labels = np.full_like(ids, IGNORE)
    keep = (doc[:, 1:] == doc[:, :-1]) & (doc[:, 1:] >= 0) & target[:, 1:]
    labels[:, :-1] = np.where(keep, ids[:, 1:], IGNORE)
    return labels


def identity_chunks(doc: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chunks of a teacher with the student's tokenizer: one per non-pad token, `[C, 4]`
    `(i, i + 1, i, i + 1)` over the flattened `[B, T]`, and `kd_valid [C]`: position `i - 1`
    is in the same row and has a label (the ordinary same-tokenizer KD positions)."""
    width = doc.shape[1]
    idx = np.flatnonzero(doc.reshape(-1) >= 0)
    chunks = np.stack([idx, idx + 1, idx, idx + 1], axis=1)
    prev = np.maximum(idx - 1, 0)
    kd_valid = (idx % width != 0) & (labels.reshape(-1)[prev] != IGNORE)
    return chunks, kd_valid

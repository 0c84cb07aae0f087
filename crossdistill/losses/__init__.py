"""Distillation losses: pure tensor math, and the chunked student pass.

- `teacher_targets` → `TeacherTargets`: a teacher's top-k + tail at KD positions and its
  next-token log-probs, computed in chunks under `no_grad`.
- Divergences on log-probs with masks and sum reduction: `forward_kl`, `reverse_kl`, `jsd`,
  `skew_kl`, `tvd`, `gold`, `uld`, `chunk_likelihood`, `ce`. The `hkl` loss is `gold`'s math
  on its own token pairs (`VocabProjection.matched`; `plan.py` lays out both).
- `student_loss(hidden, lm_head, labels, [KDTerm, ...], kd_ratio, ce_denominator)` → loss and
  detached metrics; chunked over sequence rows (never `[N, V_s]` logits), with a full-logits
  reference backend.
- Projected targets (`projection.py`, `lookahead.py`): first piece, context, byte prefix,
  lookahead, lookahead past the student token's end, lookahead with byte-prefix groups for the
  other tokens, both of those, both only where the student's token is the longer one, and the
  two past the end at half weight each, and the split between them counted on the text
  (`teachers.N.target`). `target_kinds.py`: what each of them reads and where it puts the
  teacher's mass (`target_kind(name)`), the one place the code outside their math asks.
- `kernels.py`, `group_kernels.py`: the fused vocabulary-wide passes (Triton on CUDA, each with
  its PyTorch reference), the second for targets with token-group buckets.
- `boundaries.py`: a KD position's top-k conditioned on the next bytes the student's token
  before it rules out (`teachers.N.boundary: condition`; the table is counted at load by
  `train.boundaries`).
- `payload.py`: targets as one byte buffer (what a separate teacher sends) and the int8
  quantisation the teacher cache shares.

Imports `errors` and `config` only: no model, tokenizer or data code."""

from crossdistill.losses.boundaries import Boundaries
from crossdistill.losses.divergences import (
    ce,
    chunk_likelihood,
    forward_kl,
    gold,
    jsd,
    reverse_kl,
    skew_kl,
    tvd,
    uld,
)
from crossdistill.losses.objective import student_loss
from crossdistill.losses.plan import LOSSES, KDTerm, ce_count, flatten_chunks, kd_count, kd_valid
from crossdistill.losses.projection import (
    Buckets,
    ByteLengths,
    Extensions,
    Joins,
    PrefixGroups,
    VocabProjection,
    project_topk,
)
from crossdistill.losses.target_kinds import (
    LOOKAHEAD_DEPTH,
    TARGET_KINDS,
    TargetKind,
    reads_past_end,
    target_depth,
    target_kind,
)
from crossdistill.losses.targets import (
    TeacherTargets,
    chunk_tokens,
    kd_positions,
    next_token_nll,
    target_rows,
    teacher_targets,
)

__all__ = [
    "LOOKAHEAD_DEPTH",
    "TARGET_KINDS",
    "LOSSES",
    "Boundaries",
    "Buckets",
    "ByteLengths",
    "Extensions",
    "Joins",
    "PrefixGroups",
    "KDTerm",
    "TargetKind",
    "TeacherTargets",
    "VocabProjection",
    "ce",
    "ce_count",
    "chunk_tokens",
    "chunk_likelihood",
    "flatten_chunks",
    "forward_kl",
    "gold",
    "jsd",
    "kd_count",
    "kd_positions",
    "kd_valid",
    "next_token_nll",
    "project_topk",
    "reads_past_end",
    "reverse_kl",
    "skew_kl",
    "student_loss",
    "target_depth",
    "target_kind",
    "target_rows",
    "teacher_targets",
    "tvd",
    "uld",
]

"""`teachers.N.target: auto` (the default): each teacher's target chosen at load, from how its
tokenizer pair aligns on the run's own training text.

The measure is the one `crossdistill audit` reports: at each KD position, whether the first-piece
projection of the teacher's observed token is the student's observed token (`first_piece_right`).
The rule follows what `crossdistill bench quality` measured (benchmarks/README.md,
"Cross-tokenizer quality"):

- **Near pairs** (right at `NEAR_PAIR_RIGHT` or more; Qwen3 and Phi-4-mini for a Llama-3
  student, 97-99%): `first_piece`. There it taught what same-tokenizer KD teaches, and in one
  run on two corpora `prefix`, `lookahead_prefix_end` and `gold` were level with it, not ahead.
- **Every other pair** (under `NEAR_PAIR_RIGHT`): `lookahead_split`. That covers the far pairs
  (Llama-2 and Mistral for a Llama-3 student, 68-81%) and the pairs between near and far (Qwen3
  on Perl's numbers; Mistral on Java sources; the demo's pair). On far pairs the first piece
  made the student worse than CE only; each lookahead refinement closed more of the gap:
  `lookahead_prefix` (the student tokens that start with the teacher's bytes, as one group),
  then `lookahead_prefix_end` (the observed token's mass split past its end), then
  `lookahead_split` (each other token's mass split between its exact student token and its
  longer ones, at a share counted on the run's text). Pairs between near and far once got
  `lookahead_prefix_end`; it lost to CE only on every seed where a corpus put a pair near the
  old 85% bound, while the split won those seeds, and the two were level on the pairs between.
  A bound that a corpus can cross costs a user most where it is wrong, so there is none
  (benchmarks/README.md, "`lookahead_split` on a third corpus" and "The cpu scale's far pair
  with Mistral's tokenizer"). A tensor-parallel student gets the next best, `lookahead` (the
  prefix groups sum over the whole student vocabulary, which tensor parallelism splits). A
  teacher read from a cache gets the same targets as a live one: the cache holds every
  position's top-k, and the loader reads the rows a target needs.

A teacher with the student's tokenizer, or a loss without a projected target
(`chunk_likelihood`, `uld`, `gold`, `hkl`), gets `first_piece`, the target having nothing to do
there.
The sample is the same on every rank, so every process of a job makes the same choice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from crossdistill.config import DISTRIBUTION_LOSSES, Config, TeacherConfig

# share of KD positions where the first piece is right: at or below it the reason calls the pair
# far (Llama-2 and Mistral for a Llama-3 student: 68-81%); the target is the same either side
FAR_PAIR_RIGHT = 0.85
# at or above it, a near pair: the first piece; under it, `SPLIT_TARGET`
NEAR_PAIR_RIGHT = 0.95
# what a pair that is not near gets with a student without tensor parallelism
SPLIT_TARGET = "lookahead_split"
# a share this close to the near bound may fall on its other side on other text of the same
# corpus (one pair's share moved 3 points between two samples of one corpus): the reason says so
BOUND_MARGIN = 0.02
# text read to measure a pair: tens of thousands of KD positions, small enough to tokenize at
# every load on every rank
SAMPLE_BYTES = 1 << 18


def first_piece_kinds(
    ids_s: np.ndarray, ids_t: np.ndarray, chunks: np.ndarray, first: np.ndarray
) -> dict[str, np.ndarray]:
    """Per KD position (chunk start with a token before it on both sides), as boolean masks:
    whether the first-piece projection of the teacher's observed token is the student's
    observed token (`right`); else whether the student's token spans several of the teacher's
    (`student_longer`), the teacher's spans several of the student's (`student_shorter`), or
    neither (`other`)."""
    c = chunks[(chunks[:, 0] > 0) & (chunks[:, 2] > 0)]
    right = first[ids_t[c[:, 2]]] == ids_s[c[:, 0]]
    one_s, one_t = c[:, 1] - c[:, 0] == 1, c[:, 3] - c[:, 2] == 1
    return {
        "right": right,
        "student_longer": ~right & one_s & ~one_t,
        "student_shorter": ~right & ~one_s & one_t,
        "other": ~right & ~(one_s ^ one_t),
    }


def encoded_sample(tok_s: Any, tok_t: Any, texts: list[str]) -> tuple[Any, list, list]:
    """(the data pipeline, with both byte tables, student ids, teacher ids) of `texts`, encoded
    as training encodes a document."""
    from crossdistill.data.aligned import Pipeline
    from crossdistill.data.encoders import TokenizerSide

    pipe = Pipeline(TokenizerSide(tok_s, fast=False), TokenizerSide(tok_t, fast=False))
    return (pipe, *pipe.encode(texts))


def aligned_sample(
    tok_s: Any, tok_t: Any, texts: list[str]
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per text: (student ids, teacher ids, chunks `[n, 4]`), encoded and aligned as training
    encodes and aligns a document."""
    from crossdistill.alignment import align_batch

    pipe, ids_s, ids_t = encoded_sample(tok_s, tok_t, texts)
    for a, s, t in zip(align_batch(ids_s, ids_t, pipe.bytes_s, pipe.bytes_t), ids_s, ids_t):
        yield np.asarray(s), np.asarray(t), a.chunks


def first_piece_right(tok_s: Any, tok_t: Any, texts: list[str]) -> tuple[float, int]:
    """(share of KD positions where the first piece is right, number of KD positions) over
    `texts`, encoded as training encodes a document."""
    from crossdistill.alignment.projection import build_projection

    first = build_projection(tok_t, tok_s).first_piece.numpy()
    right = total = 0
    for s, t, chunks in aligned_sample(tok_s, tok_t, texts):
        hits = first_piece_kinds(s, t, chunks, first)["right"]
        right, total = right + int(hits.sum()), total + hits.size
    return right / max(total, 1), total


def choose_target(right: float | None, loss: str, tensor_parallel: bool) -> tuple[str, str]:
    """(target, why) for a cross-tokenizer teacher whose first piece is right at `right` of KD
    positions (None: not measured, no text)."""
    if loss not in DISTRIBUTION_LOSSES:
        return "first_piece", f"{loss} has no projected target"
    if right is None:
        return "first_piece", "no training text to measure the pair on"
    share = f"the first piece is right at {right:.1%} of KD positions"
    hint = near_a_bound(right)
    if right >= NEAR_PAIR_RIGHT:
        kind = f"{share} (at least {NEAR_PAIR_RIGHT:.0%}): a near pair"
        return "first_piece", f"{kind}; {hint}" if hint else kind
    name = "a far pair" if right <= FAR_PAIR_RIGHT else "between near and far"
    kind = f"{share} (under {NEAR_PAIR_RIGHT:.0%}): {name}"
    if tensor_parallel:
        return "lookahead", f"{kind}; {SPLIT_TARGET} does not take a tensor-parallel student"
    return SPLIT_TARGET, f"{kind}; {hint}" if hint else kind


def near_a_bound(right: float) -> str:
    """The comparison to run when `right` is within `BOUND_MARGIN` of the near bound; "" when
    not."""
    if abs(right - NEAR_PAIR_RIGHT) > BOUND_MARGIN:
        return ""
    return (
        f"within {BOUND_MARGIN * 100:.0f} points of the {NEAR_PAIR_RIGHT:.0%} bound, where other "
        "text can fall on its other side: compare both with `crossdistill bench quality "
        f"--target first_piece --target {SPLIT_TARGET}` on your corpus"
    )


def resolve_targets(
    cfg: Config, tok_s: Any, toks_t: list[Any]
) -> tuple[list[TeacherConfig], list[str]]:
    """`cfg.teachers` with every `auto` target chosen (the others as given), and one line per
    choice saying why."""
    from crossdistill.data.build import sample_texts
    from crossdistill.models import tokenizer_fingerprint

    texts: list[str] | None = None
    measured: dict[str, tuple[float, int] | None] = {}
    teachers, notes = [], []
    for i, (t, tok) in enumerate(zip(cfg.teachers, toks_t)):
        if t.target != "auto":
            teachers.append(t)
            continue
        key = tokenizer_fingerprint(tok)
        if key == tokenizer_fingerprint(tok_s):
            target, why = "first_piece", "the student's own tokenizer"
        else:
            if key not in measured and t.loss in DISTRIBUTION_LOSSES:
                texts = sample_texts(cfg.data, SAMPLE_BYTES) if texts is None else texts
                found = first_piece_right(tok_s, tok, texts)
                measured[key] = found if found[1] else None
            share = measured.get(key)
            target, why = choose_target(
                None if share is None else share[0],
                t.loss,
                tensor_parallel=cfg.student.parallel.tp > 1,
            )
        teachers.append(replace(t, target=target))
        notes.append(f"teachers.{i} ({t.name}): target auto -> {target}: {why}")
    return teachers, notes

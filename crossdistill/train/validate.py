"""Checks that a config can work, run before any model weight is loaded.

Everything here reads configs, tokenizers and `config.json` files only, so a mistake costs
seconds, not the minutes of loading a teacher. Each failure is one `UserError` that says what to
change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from crossdistill.config import (
    DISTRIBUTION_LOSSES,
    TEACHER_LENGTH_FACTOR,
    Config,
    ModelConfig,
    TeacherConfig,
)
from crossdistill.errors import UserError
from crossdistill.losses import target_kind


@dataclass
class ResolvedModel:
    """What validation learned about one model: its HF config and its tokenizer spec."""

    hf_config: Any
    tokenizer_spec: str
    label: str


def tokenizer_spec(model: ModelConfig, label: str) -> str:
    spec = model.tokenizer or model.path
    if spec is None:
        raise UserError(
            f"{label}: no tokenizer; set {label}.tokenizer (a folder, HF id or tiktoken file) "
            f"when {label} is given by `arch`"
        )
    return spec


def resolve_model(model: ModelConfig, label: str) -> ResolvedModel:
    from crossdistill.models.loading import resolve_hf_config

    if (model.path is None) == (model.arch is None):
        raise UserError(f"{label}: set exactly one of {label}.path (checkpoint) or {label}.arch")
    hf_config = resolve_hf_config(model.path, model.arch, model.overrides)
    return ResolvedModel(hf_config, tokenizer_spec(model, label), label)


def resolve_teacher(t: TeacherConfig, label: str) -> ResolvedModel:
    """A teacher's model, or for one that reads a cache (`cache`), the config and tokenizer the
    cache folder holds (its `path`, if also given, is only checked against the cache)."""
    if t.cache is None:
        return resolve_model(t, label)
    from crossdistill.data.teacher_cache import read_manifest
    from crossdistill.models.loading import resolve_hf_config

    if t.arch is not None:
        raise UserError(f"{label}: a teacher read from a cache has no arch; drop {label}.arch")
    if t.offload:
        raise UserError(f"{label}: offload moves a model, a cached teacher has none; drop it")
    read_manifest(t.cache)
    hf_config = resolve_hf_config(t.cache, None, t.overrides)
    return ResolvedModel(hf_config, t.tokenizer or t.cache, label)


def validate_config(cfg: Config) -> tuple[ResolvedModel, list[ResolvedModel]]:
    """Check scalars, models, tokenizers and sequence lengths; return what was resolved."""
    _check_scalars(cfg)
    student = resolve_model(cfg.student, "student")
    teachers = [resolve_teacher(t, f"teachers.{i}") for i, t in enumerate(cfg.teachers)]
    _check_length(student, cfg.data.seq_len, 1)
    for t in teachers:
        _check_length(t, cfg.data.seq_len, TEACHER_LENGTH_FACTOR)
    names = [t.name for t in cfg.teachers]
    if len(set(names)) != len(names):
        raise UserError(f"teacher names must be distinct, got {names}; set teachers.N.name")
    for i, (t, r) in enumerate(zip(cfg.teachers, teachers)):
        _check_top_k(t, i, student.hf_config.vocab_size, r.hf_config.vocab_size)
        if t.target != "auto" and target_kind(t.target).groups and cfg.student.parallel.tp > 1:
            raise UserError(
                f"teachers.{i}.target = {t.target} sums the student's probabilities over "
                f"groups of tokens anywhere in its vocabulary, which student.parallel.tp = "
                f"{cfg.student.parallel.tp} splits over ranks: use target first_piece, context "
                "or lookahead, or a student without tensor parallelism"
            )
    return student, teachers


# Losses with a forward-KL part: the teacher's tail mass must have a student bucket to go to.
_TAIL_NEEDS_ROOM = ("forward_kl", "gold", "hkl")


def _check_top_k(t: Any, i: int, vocab_s: int, vocab_t: int) -> None:
    """Top-k settings the losses cannot use on these vocabularies (`vocab_*`: embedding rows).
    `uld`/`gold`/`hkl` sort the teacher's top-k against the student's top-k, so k cannot exceed the
    student's vocabulary. A forward KL is infinite once the projected top-k can cover every
    student id while the teacher keeps mass outside its top-k (k < its vocabulary): that mass
    would land on a student bucket of probability 0."""
    if t.target not in ("auto", "first_piece") and t.loss not in DISTRIBUTION_LOSSES:
        raise UserError(
            f"teachers.{i}.target = {t.target} needs a projected loss "
            f"({', '.join(DISTRIBUTION_LOSSES)}), not {t.loss}: set teachers.{i}.target=first_piece"
        )
    where = f"teachers.{i}.top_k = {t.top_k}"
    if t.loss in ("uld", "gold", "hkl") and t.top_k > vocab_s:
        raise UserError(
            f"{where} exceeds the student's vocabulary of {vocab_s} ids; {t.loss} compares the "
            f"teacher's top-k with the student's: use top_k <= {vocab_s}"
        )
    forward = t.loss in _TAIL_NEEDS_ROOM or (t.loss == "skew_kl" and t.alpha == 0)
    if forward and vocab_s <= t.top_k < vocab_t:
        raise UserError(
            f"{where} can cover all {vocab_s} student ids while the teacher keeps probability "
            f"outside its top-k (its vocabulary has {vocab_t}); {t.loss} would be infinite: use "
            f"top_k < {vocab_s}"
        )


def check_vocab(resolved: ResolvedModel, tok) -> None:
    """The tokenizer's ids must fit the model's embedding table."""
    vocab = getattr(resolved.hf_config, "vocab_size", None)
    if vocab is not None and len(tok) > vocab:
        raise UserError(
            f"{resolved.label}: tokenizer {resolved.tokenizer_spec!r} has {len(tok)} tokens but the "
            f"model's vocab_size is {vocab}; pair the model with its own tokenizer"
        )


def _check_length(resolved: ResolvedModel, seq_len: int, factor: int) -> None:
    limit = getattr(resolved.hf_config, "max_position_embeddings", None)
    if limit is not None and seq_len * factor > limit:
        need = "data.seq_len" if factor == 1 else f"data.seq_len ({factor}x for a teacher)"
        raise UserError(
            f"{resolved.label}: {need} = {seq_len * factor} exceeds the model's "
            f"max_position_embeddings {limit}; lower data.seq_len"
        )


def _check_scalars(cfg: Config) -> None:
    t = cfg.train
    rules = [
        (0.0 <= t.kd_ratio <= 1.0, f"train.kd_ratio must be in [0, 1], got {t.kd_ratio}"),
        (t.steps >= 1, f"train.steps must be >= 1, got {t.steps}"),
        (
            t.kd_warmup_steps >= 0,
            f"train.kd_warmup_steps must be >= 0 (0: no warm-up), got {t.kd_warmup_steps}",
        ),
        (
            t.kd_warmup_steps <= t.steps,
            f"train.kd_warmup_steps = {t.kd_warmup_steps} is past train.steps = {t.steps}: the "
            "KD weight would never reach train.kd_ratio; give at most train.steps",
        ),
        (t.grad_accum >= 1, f"train.grad_accum must be >= 1, got {t.grad_accum}"),
        (cfg.data.seq_len >= 8, f"data.seq_len must be >= 8, got {cfg.data.seq_len}"),
        (cfg.data.micro_batch_size >= 1, "data.micro_batch_size must be >= 1"),
        (cfg.optim.lr > 0, f"optim.lr must be > 0, got {cfg.optim.lr}"),
        (t.keep_last >= 1, f"train.keep_last must be >= 1, got {t.keep_last}"),
        (bool(cfg.data.train), "data.train is empty; give at least one file or folder"),
        (
            cfg.student.activation_checkpointing_blocks >= 0,
            "student.activation_checkpointing_blocks must be >= 0 (0 = every block)",
        ),
    ]
    for i, teacher in enumerate(cfg.teachers):
        rules += [
            (teacher.top_k >= 1, f"teachers.{i}.top_k must be >= 1, got {teacher.top_k}"),
            (teacher.temperature > 0, f"teachers.{i}.temperature must be > 0"),
            (teacher.weight >= 0, f"teachers.{i}.weight must be >= 0"),
            (
                teacher.loss != "jsd" or 0.0 < teacher.beta < 1.0,
                f"teachers.{i}.beta must be in (0, 1) for jsd, got {teacher.beta}",
            ),
            (
                teacher.loss != "skew_kl" or 0.0 <= teacher.alpha < 1.0,
                f"teachers.{i}.alpha must be in [0, 1) for skew_kl, got {teacher.alpha}",
            ),
            (teacher.ranks >= 1, f"teachers.{i}.ranks must be >= 1, got {teacher.ranks}"),
            (
                teacher.placement == "colocated" or teacher.cache is None,
                f"teachers.{i} reads its targets from a cache, which runs no model: drop "
                f"teachers.{i}.placement=separate or teachers.{i}.cache",
            ),
            (
                teacher.placement == "colocated" or not teacher.offload,
                f"teachers.{i}.offload parks a colocated teacher on the CPU between steps; a "
                f"separate teacher has its own devices: drop teachers.{i}.offload",
            ),
        ]
    rules += [
        (t.teacher_prefetch >= 1, f"train.teacher_prefetch must be >= 1, got {t.teacher_prefetch}"),
        (
            t.teacher_timeout_s > 0,
            f"train.teacher_timeout_s must be > 0, got {t.teacher_timeout_s}",
        ),
    ]
    if cfg.teachers and t.kd_ratio > 0 and sum(x.weight for x in cfg.teachers) <= 0:
        rules.append((False, "all teacher weights are 0 while train.kd_ratio > 0"))
    for ok, message in rules:
        if not ok:
            raise UserError(message)
    from crossdistill.eval.tasks import parse_task

    for i, spec in enumerate(t.eval_tasks):
        parse_task(spec, f"train.eval_tasks.{i}")
    if t.eval_tasks and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError(
            "train.eval_tasks runs in one process; under torchrun, drop it and evaluate the "
            "run's final/ folder with `crossdistill eval`"
        )

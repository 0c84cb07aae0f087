"""`build_loader`: from `DataConfig` and tokenizers to a ready loader, every check done at start.

Split rules: with `data.validation` files the train split is all of `data.train` and the
validation split all of `data.validation`; without them each document of `data.train` goes to
validation with probability `data.val_fraction` (a hash of seed, file and row, so the split is
the same in every run and on every rank).
"""

from __future__ import annotations

from typing import Any, Literal

from crossdistill.config import DataConfig
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.loader import DistillLoader, HeldOut, PackedStream, default_pin_memory
from crossdistill.data.schedule import Plan
from crossdistill.data.sources import open_source
from crossdistill.data.stream import StreamSpec, WorkerState, batch_stream
from crossdistill.data.teacher_cache import CachedTeacher
from crossdistill.errors import UserError


def build_loader(
    data_cfg: DataConfig,
    tok_s: Any,
    toks_t: list[Any],
    split: Literal["train", "validation"] = "train",
    rank: int = 0,
    world_size: int = 1,
    chat_templates: list[str | None] | None = None,
    pin_memory: bool | None = None,
    caches: list[CachedTeacher | None] | None = None,
    fill_one_batch: bool = True,
) -> DistillLoader | HeldOut:
    """A loader of `Batch`es for `split`, this data-parallel rank's share of it: the endless,
    resumable training stream, or the validation split as `HeldOut` (the same batches every
    time, independent of `data.num_workers` and the number of ranks).

    tok_s / toks_t: the student's and each teacher's (fast HF) tokenizer, teachers in config
    order. chat_templates: optional templates for `[student, *teachers]` (None: the
    tokenizer's own). caches: per teacher, the cache it reads its targets from (None: it runs
    live; `Batch.cached`). fill_one_batch: refuse a validation split that does not fill one
    micro-batch (a trainer's validation would be padding; an evaluation takes any size). Raises `UserError` for bad settings, missing files or columns, and a
    validation split too small to fill one micro-batch on this rank.
    """
    _check_settings(data_cfg, split, rank, world_size)
    templates = list(chat_templates or [None] * (1 + len(toks_t)))
    if len(templates) != 1 + len(toks_t):
        raise UserError(f"got {len(templates)} chat templates for {1 + len(toks_t)} tokenizers")
    sides, slots = _sides(tok_s, toks_t, templates)
    chat = data_cfg.messages_field is not None
    if chat:
        for side in sides:
            if side.chat_template is None:
                raise UserError(
                    f"data.messages_field is set but tokenizer {side.name} has no chat template; "
                    "use a tokenizer that has one or give the template"
                )
    field = data_cfg.messages_field if chat else data_cfg.text_field
    paths, split_rule = _paths(data_cfg, split)
    sources = [open_source(p, data_cfg.format, field) for p in paths]
    train = split == "train"
    # validation: one consumer over the whole split, whatever the workers and ranks (`HeldOut`)
    num_workers = max(0, int(data_cfg.num_workers)) if train else 0
    plan = Plan(
        sources,
        split_rule,
        data_cfg.val_fraction,
        data_cfg.seed,
        num_consumers=world_size * max(1, num_workers) if train else 1,
        shuffle=train,
    )
    spec = StreamSpec(
        kind="chat" if chat else "text",
        field=field,
        loss_on=data_cfg.loss_on,
        seq_len=data_cfg.seq_len,
        batch_size=data_cfg.micro_batch_size,
        pad_multiple=data_cfg.pad_multiple,
        bad_input=data_cfg.bad_input,
        slots=tuple(slots),
        caches=tuple(caches) if caches and any(c is not None for c in caches) else (),
    )
    if not train:
        stream = PackedStream(plan, sides, spec, 0, 0, repeat=False)
        if fill_one_batch:
            _check_validation_fills_a_batch(stream, paths)
        return HeldOut(stream, rank, world_size)
    stream = PackedStream(plan, sides, spec, rank, num_workers, repeat=True)
    _check_train_share(stream)
    pin = default_pin_memory() if pin_memory is None else pin_memory
    return DistillLoader(stream, num_workers, pin, resumable=True)


def _check_settings(cfg: DataConfig, split: str, rank: int, world_size: int) -> None:
    if split not in ("train", "validation"):
        raise UserError(f"split must be 'train' or 'validation', got {split!r}")
    if not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is outside world size {world_size}")
    for name in ("seq_len", "micro_batch_size", "pad_multiple"):
        if getattr(cfg, name) < 1:
            raise UserError(f"data.{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.seq_len < 2:
        raise UserError("data.seq_len must be at least 2 (one input and one target)")
    if cfg.num_workers < 0:
        raise UserError(f"data.num_workers must be 0 or more, got {cfg.num_workers}")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise UserError(f"data.val_fraction must be in [0, 1), got {cfg.val_fraction}")


def _paths(cfg: DataConfig, split: str) -> tuple[list[str], Literal["train", "validation", "all"]]:
    if not cfg.train:
        raise UserError("data.train is empty: give at least one file or folder of training data")
    if cfg.validation:
        return (list(cfg.train), "all") if split == "train" else (list(cfg.validation), "all")
    if split == "train":
        return list(cfg.train), "train" if cfg.val_fraction > 0 else "all"
    if cfg.val_fraction == 0:
        raise UserError(
            "no validation data: set data.validation to held-out files, "
            "or data.val_fraction > 0 to hold out part of data.train"
        )
    return list(cfg.train), "validation"


def _sides(tok_s: Any, toks_t: list[Any], templates: list[str | None]):
    """The student's side first, then one side per distinct teacher tokenizer that differs
    from the student's. `slots[i]` is teacher i's index among those, -1 for the student's.
    Teachers with the same tokenizer (fingerprint) share one tokenization, and so one chat
    rendering: the first of them gives the template."""
    student = TokenizerSide(tok_s, templates[0])
    sides, slots, seen = [student], [], {student.fingerprint: -1}
    for tok, template in zip(toks_t, templates[1:]):
        side = TokenizerSide(tok, template)
        if side.fingerprint not in seen:
            seen[side.fingerprint] = len(sides) - 1
            sides.append(side)
        slots.append(seen[side.fingerprint])
    return sides, slots


def _check_train_share(stream: PackedStream) -> None:
    plan = stream.plan
    for logical in range(stream.num_logical):
        consumer = stream.consumer(logical)
        if not any(plan.rows(0, int(b)).size for b in plan.block_order(0, consumer)):
            raise UserError(
                f"training data too small: data reader {consumer} of {plan.num_consumers} "
                "(world size x data workers) gets no document; use more data or fewer workers"
            )


def _check_validation_fills_a_batch(stream: PackedStream, paths: list[str]) -> None:
    """Build the first validation batch now, so a too-small set fails at start."""
    first = next(
        batch_stream(stream.plan, 0, stream.sides, stream.spec, WorkerState(), repeat=False),
        None,
    )
    if first is not None and bool((first[0].student.doc_ids[:, 0] >= 0).all()):
        return
    spec = stream.spec
    raise UserError(
        f"validation data too small: {', '.join(paths)} does not fill one micro-batch "
        f"({spec.batch_size} sequences of up to {spec.seq_len} tokens); give more validation "
        "data, raise data.val_fraction, or lower data.micro_batch_size"
    )


def sample_texts(cfg: DataConfig, num_bytes: int, rows_per_file: int = 256) -> list[str]:
    """About `num_bytes` UTF-8 bytes of the training text: from each file an equal share, read
    from up to `rows_per_file` documents spread evenly over it (a chat document is its
    messages' contents, one per line; a long document gives its start). The same sample on
    every rank and in every run; bad rows are passed over (the loaders report them)."""
    import numpy as np

    from crossdistill.data.documents import check_document

    chat = cfg.messages_field is not None
    field = cfg.messages_field if chat else cfg.text_field
    paths = _paths(cfg, "train")[0]
    per_file = -(-num_bytes // len(paths))
    texts: list[str] = []
    for path in paths:
        source = open_source(path, cfg.format, field)
        n = source.num_rows
        # at least 256 characters a document: fewer documents where the share is small
        count = min(n, rows_per_file, max(per_file // 256, 1))
        rows = np.unique(np.linspace(0, n - 1, count).astype(np.int64))
        per_doc = max(per_file // max(len(rows), 1), 256)
        taken = 0
        for row in rows.tolist():
            doc = check_document(source.read(row, row + 1)[0], "chat" if chat else "text", field)
            if isinstance(doc, list):
                doc = "\n".join(m.content for m in doc if m.content)
            if isinstance(doc, str):
                texts.append(doc[:per_doc])
                taken += len(texts[-1].encode())
            if taken >= per_file:
                break
    return texts

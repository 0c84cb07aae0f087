"""Datasets, packing on common boundaries, collator, resumable loader; the teacher cache's
on-disk format and reader (`teacher_cache.py`: what `crossdistill cache build` writes and the
collator reads for a teacher with `cache:`).

`build_loader(data_cfg, tok_s, toks_t, split)` is the entry point; it returns a `DistillLoader`
of `Batch`es (see `batch.py` for shapes) with `state_dict()` / `load_state_dict()`, or for the
validation split a `HeldOut`. Names are imported on first use: the tokenizer side
(`TokenizerSide`) and the sources need no torch, the batches do.

Imports `errors`, `config`, `cache`, `losses` (the int8 quantisation the cache shares with a
separate teacher's payload, and the top-k rows a target reads), `models` and `alignment`;
never `distributed` or `train`."""

import importlib

_WHERE = {
    "Batch": "batch",
    "StudentBatch": "batch",
    "TeacherBatch": "batch",
    "build_loader": "build",
    "sample_texts": "build",
    "BadInputPolicy": "documents",
    "Message": "documents",
    "check_document": "documents",
    "TokenizerSide": "encoders",
    "DistillLoader": "loader",
    "HeldOut": "loader",
    "detect_format": "sources",
    "open_source": "sources",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"crossdistill.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

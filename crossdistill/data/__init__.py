"""Datasets, packing on common boundaries, chat data, collator, resumable loader.

`build_loader(data_cfg, tok_s, toks_t, split)` is the entry point; it returns a `DistillLoader`
of `Batch`es (see `batch.py` for shapes) with `state_dict()` / `load_state_dict()`.
"""

from crossdistill.data.batch import Batch, StudentBatch, TeacherBatch, block_causal_mask
from crossdistill.data.build import build_loader
from crossdistill.data.documents import BadInputPolicy, Message, check_document
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.loader import DistillLoader
from crossdistill.data.sources import detect_format, open_source

__all__ = [
    "BadInputPolicy",
    "Batch",
    "DistillLoader",
    "Message",
    "StudentBatch",
    "TeacherBatch",
    "TokenizerSide",
    "block_causal_mask",
    "build_loader",
    "check_document",
    "detect_format",
    "open_source",
]

"""Model and tokenizer loading: HF causal LMs built on meta then materialised, the frozen teacher.

Tokenizer loading needs no torch; the model pieces are imported on first use, so that commands
that only tokenize (`crossdistill align`) start without importing torch.

Imports `errors` and `cache` only."""

from crossdistill.models.tokenizers import load_tokenizer, tokenizer_fingerprint

__all__ = [
    "Teacher",
    "build_causal_lm",
    "load_tokenizer",
    "resolve_hf_config",
    "tokenizer_fingerprint",
]

_LAZY = {
    "Teacher": "crossdistill.models.teacher",
    "build_causal_lm": "crossdistill.models.loading",
    "resolve_hf_config": "crossdistill.models.loading",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

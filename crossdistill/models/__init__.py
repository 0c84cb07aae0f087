"""Model and tokenizer loading: HF causal LMs built on meta then materialised, the frozen teacher."""

from crossdistill.models.loading import build_causal_lm, resolve_hf_config
from crossdistill.models.teacher import Teacher
from crossdistill.models.tokenizers import load_tokenizer, tokenizer_fingerprint

__all__ = [
    "Teacher",
    "build_causal_lm",
    "load_tokenizer",
    "resolve_hf_config",
    "tokenizer_fingerprint",
]

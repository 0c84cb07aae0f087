"""Architecture presets in one place: tiny real-architecture configs for tests, and the real
shapes (random init) that benchmarks use. Each is a Hugging Face config dict.

Tiny presets keep every family's distinguishing features (GQA, q/k norm in Qwen3, fused qkv in
Phi-3, sliding window fields in Mistral, tied or untied embeddings) at a few layers and a small
hidden size, so a CPU test runs the same modelling code a cluster run does.
"""

from __future__ import annotations

from typing import Any

_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
}

TINY: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", **_TINY_COMMON, "tie_word_embeddings": True},
    "tiny-qwen2": {"model_type": "qwen2", **_TINY_COMMON, "tie_word_embeddings": True},
    "tiny-qwen3": {
        "model_type": "qwen3",
        **_TINY_COMMON,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
    "tiny-phi3": {
        "model_type": "phi3",
        **_TINY_COMMON,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "tiny-mistral": {
        "model_type": "mistral",
        **_TINY_COMMON,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
}

# Real shapes, for benchmarks (weights are random: only the FLOPs and bytes are real).
REAL: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-3.2-3b": {
        "model_type": "llama",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "qwen3-4b": {
        "model_type": "qwen3",
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
    "phi-4-mini": {
        "model_type": "phi3",
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "vocab_size": 200064,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "tie_word_embeddings": True,
        "pad_token_id": 199999,
        "bos_token_id": 199999,
        "eos_token_id": 199999,
    },
}

PRESETS: dict[str, dict[str, Any]] = {**TINY, **REAL}

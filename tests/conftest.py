"""Shared fixtures. The eight genuine tokenizers come from `$CROSSDISTILL_TOKENIZERS`
(default: `../shared/tokenizers` beside the repository). Where that folder is missing, tests
that need it skip with a message; under CI (`CI=true`) a missing folder fails the run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_NAMES = ["qwen2.5", "qwen3", "llama3", "llama2", "mistral", "gpt2", "phi-4", "phi-4-mini"]


def tokenizers_root() -> Path:
    return Path(os.environ.get("CROSSDISTILL_TOKENIZERS", REPO.parent / "shared" / "tokenizers"))


def _require_root() -> Path:
    root = tokenizers_root()
    if not (root / "llama3" / "hf").is_dir():
        msg = (
            f"real tokenizers not found at {root}: put the eight tokenizer folders "
            "(<name>/hf/tokenizer.json) there or set CROSSDISTILL_TOKENIZERS to their location"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return root


@pytest.fixture(scope="session")
def tokenizer_dir():
    """`tokenizer_dir(name)` -> the plain HF folder of one of the eight genuine tokenizers."""
    root = _require_root()

    def get(name: str) -> Path:
        assert name in TOKENIZER_NAMES, name
        return root / name / "hf"

    return get


@pytest.fixture(scope="session")
def real_tokenizer(tokenizer_dir):
    """`real_tokenizer(name)` -> a loaded fast tokenizer (cached per name)."""
    from crossdistill.models import load_tokenizer

    def get(name: str):
        return load_tokenizer(str(tokenizer_dir(name)))

    return get

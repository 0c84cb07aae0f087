"""Content encoding: the tiktoken fast path gives exactly the `tokenizers` ids, special-token
strings in data stay text, and each tokenizer's document delimiters are detected."""

from __future__ import annotations

import pytest

from crossdistill.data import TokenizerSide
from tests.unit.test_data_helpers import UNICODE_TEXTS, stdlib_texts

TEXTS = (
    stdlib_texts(12, max_chars=4000, skip=2)
    + UNICODE_TEXTS
    + [
        "x<think>y</think> <tool_call>{}</tool_call> <|fim_prefix|>a<|tool|>b",
        "   \n\n\t  ",
        "a" * 3000 + " " + "7" * 40,
    ]
)


def _reference(tok, text):
    backend = tok.backend_tokenizer
    before = backend.encode_special_tokens
    backend.encode_special_tokens = True
    try:
        return backend.encode(text, add_special_tokens=False).ids
    finally:
        backend.encode_special_tokens = before


@pytest.mark.parametrize("name", ["llama3", "qwen3", "phi-4-mini", "gpt2", "llama2"])
def test_content_ids_equal_the_tokenizers_library(real_tokenizer, name):
    tok = real_tokenizer(name)
    side = TokenizerSide(tok)
    assert side.is_fast == (name != "llama2")  # SentencePiece has no tiktoken equivalent
    for text in TEXTS:
        assert side.encode_content(text).tolist() == _reference(tok, text), text[:60]
    # special-token strings in documents are text, never control tokens
    ids = side.encode_content("<|endoftext|><|im_end|><|begin_of_text|></s>").tolist()
    assert not any(side.token_bytes.special[i] for i in ids)


@pytest.mark.parametrize(
    "name,bos,end",
    [
        ("llama3", ["<|begin_of_text|>"], "<|end_of_text|>"),
        ("qwen3", [], "<|endoftext|>"),
        ("phi-4-mini", [], "<|endoftext|>"),
        ("gpt2", [], "<|endoftext|>"),
        ("llama2", ["<s>"], "</s>"),
    ],
)
def test_document_delimiters(real_tokenizer, name, bos, end):
    tok = real_tokenizer(name)
    side = TokenizerSide(tok)
    assert tok.convert_ids_to_tokens(side.bos_ids) == bos
    assert tok.convert_ids_to_tokens(side.doc_end_id) == end

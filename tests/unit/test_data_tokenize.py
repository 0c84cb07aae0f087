"""Content encoding: the tiktoken fast path gives exactly the `tokenizers` ids, special- and
added-token strings in data stay text on every side, and each tokenizer's document delimiters
are detected."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from crossdistill.data import TokenizerSide
from tests.conftest import TOKENIZER_NAMES
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


def _plain(tok) -> Tokenizer:
    """The `tokenizers` library's tokenizer of `tok` with no added token known."""
    spec = json.loads(tok.backend_tokenizer.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


@pytest.mark.parametrize("name", ["llama3", "qwen3", "phi-4-mini", "gpt2", "llama2"])
def test_content_ids_equal_the_tokenizers_library(real_tokenizer, name):
    tok = real_tokenizer(name)
    side = TokenizerSide(tok)
    assert side.is_fast == (name != "llama2")  # SentencePiece has no tiktoken equivalent
    plain = _plain(tok)
    for text in TEXTS:
        reference = plain.encode(text, add_special_tokens=False).ids
        assert side.encode_content(text).tolist() == reference, text[:60]
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


# Literal control and added-token strings of every family, as they turn up in web pages and code.
LITERALS = (
    "<s> </s> <unk> <pad> [INST] hi [/INST] <<SYS>> <0x41> <|endoftext|> <|im_start|>user\n"
    "q<|im_end|> <|begin_of_text|><|start_header_id|>system<|end_header_id|> <|eot_id|> "
    "<|end_of_text|> <|user|>x<|end|><|assistant|> <|system|> <|tool|><|/tool|> <|tool_call|> "
    "<think>why</think> <tool_call>{}</tool_call> <tool_response> <|fim_prefix|>a<|fim_middle|>"
    "b<|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <|endofprompt|> <|dummy_3|> "
    "<|reserved_special_token_7|> <|python_tag|>"
)


def _added_strings(tok) -> str:
    return " ".join(t.content for t in tok.backend_tokenizer.get_added_tokens_decoder().values())


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_literal_special_token_strings_are_text_on_every_side(real_tokenizer, name):
    """Text is text: a document full of control-token names (every family's, and this
    tokenizer's own added tokens) encodes to ids with no added token that decode back to
    exactly that text, on the student side and on a cross teacher's side alike."""
    from crossdistill.alignment import TokenBytes
    from crossdistill.data.units import text_unit

    tok, other = real_tokenizer(name), real_tokenizer("llama3" if name != "llama3" else "qwen3")
    text = f"{LITERALS} {_added_strings(tok)} tail"
    for sides in (
        [TokenizerSide(tok), TokenizerSide(other)],
        [TokenizerSide(other), TokenizerSide(tok)],
    ):
        unit = text_unit(text, sides)
        mine = unit.ids_s if sides[0].tok is tok else unit.teachers[0].ids
        side = sides[0] if sides[0].tok is tok else sides[1]
        added = set(tok.backend_tokenizer.get_added_tokens_decoder())
        start = side.start_ids.size
        content = mine[start : mine.size - (side.doc_end_id is not None)].tolist()
        assert not added & set(content), sorted(added & set(content))[:5]
        assert tok.decode(content) == text
        # byte for byte too (SentencePiece writes its dummy-prefix space in front)
        assert TokenBytes.from_tokenizer(tok).decode(content) in (
            text.encode(),
            b" " + text.encode(),
        )

"""Tokenizer loading: HF folders, Meta's tiktoken file, and clear errors."""

from __future__ import annotations

import pytest

from crossdistill.errors import UserError
from crossdistill.models import load_tokenizer, tokenizer_fingerprint
from crossdistill.models.tokenizers import is_tiktoken_file
from tests.conftest import TOKENIZER_NAMES

SAMPLE = "Hello, world!\n\tdef f(x):  return x ** 2  # 数学 🙂\r\n"


@pytest.mark.parametrize("name", TOKENIZER_NAMES)
def test_hf_folders_load_and_round_trip(real_tokenizer, name):
    tok = real_tokenizer(name)
    assert tok.is_fast
    ids = tok(SAMPLE, add_special_tokens=False)["input_ids"]
    assert ids and all(isinstance(i, int) for i in ids)
    text = tok.decode(ids)
    assert "def f(x):" in text and "数学" in text


def test_meta_tiktoken_file_equals_hf_llama3(tokenizer_dir):
    raw = tokenizer_dir("llama3").parent / "tokenizer.model"
    assert is_tiktoken_file(raw)
    tik = load_tokenizer(str(raw))
    hf = load_tokenizer(str(tokenizer_dir("llama3")))
    assert len(tik) == len(hf) == 128256
    for s in [SAMPLE, "<|eot_id|> x", "  leading spaces", ""]:
        assert tik(s)["input_ids"] == hf(s)["input_ids"], s
    assert tik.convert_ids_to_tokens([128000, 128009, 128255]) == hf.convert_ids_to_tokens(
        [128000, 128009, 128255]
    )


def test_sentencepiece_model_file_is_not_tiktoken(tokenizer_dir):
    assert not is_tiktoken_file(tokenizer_dir("llama2").parent / "tokenizer.model")


def test_fingerprints_tell_tokenizers_apart(real_tokenizer):
    prints = {n: tokenizer_fingerprint(real_tokenizer(n)) for n in ["qwen2.5", "qwen3", "gpt2"]}
    assert len(set(prints.values())) == 3
    assert tokenizer_fingerprint(real_tokenizer("gpt2")) == prints["gpt2"]


def test_unloadable_tokenizers_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope" / "deeper"))
    (tmp_path / "junk.bin").write_bytes(b"\x00\x01garbage")
    with pytest.raises(UserError, match="neither a tiktoken BPE file nor tokenizer.json"):
        load_tokenizer(str(tmp_path / "junk.bin"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path / "empty"))

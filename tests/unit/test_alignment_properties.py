"""Property tests of chunk alignment on the eight real tokenizers: random Unicode and real
text, every ordered pair (few examples each) and a handful of pairs in depth."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crossdistill.alignment import TokenBytes, align, align_batch, align_dp
from crossdistill.alignment.sample_text import mixed_corpus
from tests.conftest import TOKENIZER_NAMES
from tests.unit.test_alignment import check_alignment, reference_chunks, side_bytes

# Characters that stress tokenizers: ASCII, whitespace runs, CRLF, CJK, emoji with ZWJ and
# variation selectors, combining marks (changed by Qwen's NFC), compatibility characters.
_ALPHABET = st.one_of(
    st.characters(min_codepoint=32, max_codepoint=126),
    st.sampled_from([" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u200d", "\ufe0f"]),
    st.sampled_from(["\u0301", "\u0308", "\u0327", "e\u0301", "\u212b", "\ufb01", "\u2460"]),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF),
    st.characters(min_codepoint=0xAC00, max_codepoint=0xACFF),
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1F64F),
    st.characters(codec="utf-8", exclude_categories=["Cs"]),
)
TEXTS = st.lists(_ALPHABET, max_size=60).map("".join)
HEAVY_PAIRS = [
    ("llama3", "qwen3"),
    ("llama2", "phi-4-mini"),
    ("qwen2.5", "mistral"),
    ("gpt2", "phi-4"),
]
_SETTINGS = dict(
    deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


class _Tables(dict):
    def __repr__(self) -> str:  # keeps hypothesis' failure reports short
        return "tables"


@pytest.fixture(scope="module")
def tables(real_tokenizer):
    """name -> (tokenizer, TokenBytes), each loaded once."""
    return _Tables(
        {
            name: (real_tokenizer(name), TokenBytes.from_tokenizer(real_tokenizer(name)))
            for name in TOKENIZER_NAMES
        }
    )


@pytest.fixture(scope="module")
def real_texts():
    return [text[:300] for _, text in mixed_corpus(num_texts=14, seed=3)]


def _check_pair(tables, name_s: str, name_t: str, text: str):
    tok_s, table_s = tables[name_s]
    tok_t, table_t = tables[name_t]
    ids_s, ids_t = tok_s(text)["input_ids"], tok_t(text)["input_ids"]
    result = align(np.asarray(ids_s), ids_t, table_s, table_t)
    check_alignment(result, ids_s, ids_t, table_s, table_t, text)
    pieces_s, skip_s = side_bytes(ids_s, table_s)
    pieces_t, skip_t = side_bytes(ids_t, table_t)
    if b"".join(pieces_s)[skip_s:] == b"".join(pieces_t)[skip_t:]:
        # Identical bytes: exactly the plain reference, no fallback, and the DP agrees.
        lens_s = [len(p) for p in pieces_s]
        lens_t = [len(p) for p in pieces_t]
        _drop_prefix(lens_s, skip_s)
        _drop_prefix(lens_t, skip_t)
        assert [tuple(r) for r in result.chunks.tolist()] == reference_chunks(lens_s, lens_t)
        assert result.exact.all() and result.num_fallback == 0
        assert np.array_equal(align_dp(ids_s, ids_t, table_s, table_t).chunks, result.chunks)
    if name_s == name_t:
        assert result.chunks.tolist() == [[i, i + 1, i, i + 1] for i in range(len(ids_s))] or (
            not any(pieces_s)
        )
    return result


def _drop_prefix(lens: list[int], skip: int) -> None:
    for i, n in enumerate(lens):
        if n:
            lens[i] -= skip
            return


@pytest.mark.parametrize("name_s,name_t", HEAVY_PAIRS)
@settings(max_examples=40, **_SETTINGS)
@given(text=TEXTS)
def test_heavy_pairs_on_random_unicode(tables, name_s, name_t, text):
    _check_pair(tables, name_s, name_t, text)
    _check_pair(tables, name_t, name_s, text)


@pytest.mark.parametrize("name_t", TOKENIZER_NAMES)
@pytest.mark.parametrize("name_s", TOKENIZER_NAMES)
@settings(max_examples=3, **_SETTINGS)
@given(text=TEXTS)
def test_every_pair_on_random_unicode(tables, name_s, name_t, text):
    _check_pair(tables, name_s, name_t, text)


@pytest.mark.parametrize("name_s", TOKENIZER_NAMES)
def test_every_pair_on_real_text(tables, real_texts, name_s):
    tok_s, table_s = tables[name_s]
    for name_t in TOKENIZER_NAMES:
        results = [_check_pair(tables, name_s, name_t, text) for text in real_texts]
        # The batch path gives the same, text by text.
        tok_t, table_t = tables[name_t]
        batch_s = [tok_s(text)["input_ids"] for text in real_texts]
        batch_t = [tok_t(text)["input_ids"] for text in real_texts]
        for one, many in zip(results, align_batch(batch_s, batch_t, table_s, table_t)):
            assert np.array_equal(one.chunks, many.chunks)
            assert np.array_equal(one.exact, many.exact)


def test_nfd_text_against_nfc_tokenizer_uses_the_fallback(tables):
    text = "Vie\u0302\u0323t Nam co\u0301 nhie\u0302\u0300u ca\u0309nh \u0111e\u0323p. " * 8
    result = _check_pair(tables, "llama3", "qwen3", text)
    assert result.num_fallback > 0 and not result.exact.all()
    # The normalised words differ in bytes, yet no chunk spans two words: the diff and the
    # DP fallback found every word boundary.
    tok_s, table_s = tables["llama3"]
    ids_s = tok_s(text)["input_ids"]
    for s0, s1, _, _ in result.chunks.tolist():
        words = table_s.decode(ids_s[s0:s1]).decode().split()
        assert len(words) <= 1, words
    assert result.num_chunks >= len(text.split())

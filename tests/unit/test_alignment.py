"""Token byte tables and chunk alignment: synthetic vocabularies against a plain reference,
the identity, the diff path, bad input, and the `align` command."""

from __future__ import annotations

import json
import unicodedata

import numpy as np
import pytest

from crossdistill.alignment import Alignment, TokenBytes, align, align_batch, align_dp
from crossdistill.alignment.batch import _align_together
from crossdistill.alignment.diff import matching_blocks
from crossdistill.alignment.dp import canonical_text, lcs_pairs
from crossdistill.errors import UserError

# --- helpers shared with test_alignment_properties.py ---------------------------------------


def side_bytes(ids, table: TokenBytes) -> tuple[list[bytes], int]:
    """Each token's bytes, and 1 if the first text-bearing token starts with the dummy prefix
    space this table's tokenizer adds (which alignment drops)."""
    pieces = [table.token_bytes(int(i)) for i in ids]
    first = next((p for p in pieces if p), b"")
    return pieces, int(table.prefix_space and first[:1] == b" ")


def check_alignment(
    result: Alignment, ids_s, ids_t, table_s: TokenBytes, table_t: TokenBytes, text: str = ""
):
    """Every documented property of an alignment, checked plainly token by token.

    Runs of inexact chunks must agree up to normalisation unless `text` holds a special-token
    string of either tokenizer: then one side reads it as a token without text, and only the
    structure and the exact chunks are checked.
    """
    chunks = result.chunks
    n, m = len(ids_s), len(ids_t)
    pieces_s, skip_s = side_bytes(ids_s, table_s)
    pieces_t, skip_t = side_bytes(ids_t, table_t)
    text_s = b"".join(pieces_s)[skip_s:]
    text_t = b"".join(pieces_t)[skip_t:]
    assert chunks.dtype == np.int64 and chunks.ndim == 2 and chunks.shape[1] == 4
    assert result.exact.shape == (chunks.shape[0],) and result.exact.dtype == bool
    if not text_s and not text_t or n == 0 or m == 0:
        assert chunks.shape[0] == 0
        return
    # Contiguous, monotone, every token in exactly one chunk, no empty side.
    assert chunks[0, 0] == 0 and chunks[0, 2] == 0
    assert chunks[-1, 1] == n and chunks[-1, 3] == m
    assert (chunks[1:, 0] == chunks[:-1, 1]).all() and (chunks[1:, 2] == chunks[:-1, 3]).all()
    assert (chunks[:, 1] > chunks[:, 0]).all() and (chunks[:, 3] > chunks[:, 2]).all()
    pos_s = pos_t = 0
    inexact_s, inexact_t = b"", b""
    names = sorted({*table_s.special_text.values(), *table_t.special_text.values()}, key=len)
    literal = any(name in text for name in names)
    # The token that carries the dummy prefix space, if any.
    first_s = next((i for i, p in enumerate(pieces_s) if p), -1) if skip_s else -1
    first_t = next((i for i, p in enumerate(pieces_t) if p), -1) if skip_t else -1
    for (s0, s1, t0, t1), exact in zip(chunks.tolist(), result.exact.tolist()):
        cut_s = int(s0 <= first_s < s1)
        cut_t = int(t0 <= first_t < t1)
        got_s = b"".join(pieces_s[s0:s1])[cut_s:]
        got_t = b"".join(pieces_t[t0:t1])[cut_t:]
        if exact:
            assert got_s == got_t, (s0, s1, t0, t1, got_s, got_t)
            assert_no_finer_boundary(pieces_s[s0:s1], pieces_t[t0:t1], cut_s, cut_t)
            # A run of inexact chunks ends here: it must agree up to normalisation.
            assert literal or same_text(inexact_s, inexact_t), (inexact_s, inexact_t)
            inexact_s, inexact_t = b"", b""
        else:
            inexact_s += got_s
            inexact_t += got_t
        pos_s += len(got_s)
        pos_t += len(got_t)
    assert pos_s == len(text_s) and pos_t == len(text_t)
    assert literal or same_text(inexact_s, inexact_t), (inexact_s, inexact_t)
    return inexact_s, inexact_t


def same_text(a: bytes, b: bytes) -> bool:
    """Equal up to the documented normalisation (NFKC, whitespace dropped)."""
    return canonical_text(a.decode("utf-8", "surrogateescape")) == canonical_text(
        b.decode("utf-8", "surrogateescape")
    )


def assert_no_finer_boundary(pieces_s, pieces_t, skip_s: int, skip_t: int):
    """Inside an exact chunk no byte offset is a token end on both sides (the dummy prefix
    space, `skip_*` = 1, is not part of the chunk's text)."""
    lens_s = _drop_first_byte([len(p) for p in pieces_s], skip_s)
    lens_t = _drop_first_byte([len(p) for p in pieces_t], skip_t)
    ends_s = set(np.cumsum(lens_s).tolist()[:-1]) - {0}
    ends_t = set(np.cumsum(lens_t).tolist()[:-1]) - {0}
    total = sum(lens_s)
    assert not ((ends_s & ends_t) - {total}), (pieces_s, pieces_t)


def _drop_first_byte(lens: list[int], skip: int) -> list[int]:
    out = list(lens)
    for i, n in enumerate(out):
        if n:
            out[i] -= skip
            break
    return out


def reference_chunks(lens_s: list[int], lens_t: list[int]) -> list[tuple[int, int, int, int]]:
    """Plain-Python alignment of two segmentations of one byte string, with the documented
    conventions for zero-byte tokens (pairs at a boundary, others join the next chunk, at the
    end they pair from the end and the rest join the last chunk)."""
    ends_s = np.cumsum(lens_s).tolist()
    ends_t = np.cumsum(lens_t).tolist()
    common = sorted(
        {e for e, n in zip(ends_s, lens_s) if n} & {e for e, n in zip(ends_t, lens_t) if n}
    )
    if not common:
        return []
    bounds = [0, *common]

    def tokens_before(ends, lens, b):  # tokens that start before offset b
        return sum(1 for e, n in zip(ends, lens) if e - n < b)

    def zeros_at(ends, lens, b):
        return sum(1 for e, n in zip(ends, lens) if n == 0 and e == b)

    starts = []
    for b in bounds:
        a_s, a_t = tokens_before(ends_s, lens_s, b), tokens_before(ends_t, lens_t, b)
        starts.append((a_s, a_t, min(zeros_at(ends_s, lens_s, b), zeros_at(ends_t, lens_t, b))))
    out = []
    for k in range(len(bounds) - 1):
        a_s, a_t, pairs = starts[k]
        out += [(a_s + i, a_s + i + 1, a_t + i, a_t + i + 1) for i in range(pairs)]
        next_s, next_t, _ = starts[k + 1]
        out.append((a_s + pairs, next_s, a_t + pairs, next_t))
    pairs = starts[-1][2]
    n, m = len(lens_s), len(lens_t)
    s0, _, t0, _ = out[-1]
    out[-1] = (s0, n - pairs, t0, m - pairs)
    out += [
        (n - pairs + i, n - pairs + i + 1, m - pairs + i, m - pairs + i + 1) for i in range(pairs)
    ]
    return out


def random_segmentation(rng, text: bytes, num_zero: int, max_len: int = 6):
    """A vocabulary of the pieces of a random segmentation of `text`, plus zero-byte specials
    inserted at random places. Returns (table, ids)."""
    pieces, pos = [], 0
    while pos < len(text):
        step = int(rng.integers(1, max_len + 1))
        pieces.append(text[pos : pos + step])
        pos += step
    for _ in range(num_zero):
        pieces.insert(int(rng.integers(0, len(pieces) + 1)), None)
    vocab = [b"<unused>"] + [p for p in pieces if p is not None]
    specials = {len(vocab): "<bos>"}
    ids, next_id = [], 1
    for p in pieces:
        if p is None:
            ids.append(len(vocab))
        else:
            ids.append(next_id)
            next_id += 1
    table = TokenBytes.from_pieces([*vocab, b""], special=specials)
    return table, np.asarray(ids, dtype=np.int64)


# --- synthetic vocabularies against the reference -----------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_matches_plain_reference_on_random_segmentations(seed):
    rng = np.random.default_rng(seed)
    text = rng.integers(0, 256, size=int(rng.integers(1, 300)), dtype=np.uint8).tobytes()
    table_s, ids_s = random_segmentation(rng, text, int(rng.integers(0, 4)))
    table_t, ids_t = random_segmentation(rng, text, int(rng.integers(0, 4)), max_len=9)
    result = align(ids_s, ids_t, table_s, table_t)
    expected = reference_chunks(table_s.lengths[ids_s].tolist(), table_t.lengths[ids_t].tolist())
    assert [tuple(r) for r in result.chunks.tolist()] == expected
    assert result.exact.all() and result.num_fallback == 0
    check_alignment(result, ids_s, ids_t, table_s, table_t)
    dp = align_dp(ids_s, ids_t, table_s, table_t)
    assert np.array_equal(dp.chunks, result.chunks)
    assert dp.num_fallback == len(ids_s) + len(ids_t)


def test_identical_tokenizations_are_the_identity():
    rng = np.random.default_rng(7)
    text = rng.integers(0, 256, size=200, dtype=np.uint8).tobytes()
    table, ids = random_segmentation(rng, text, 3)
    result = align(ids, ids, table, table)
    expected = [[i, i + 1, i, i + 1] for i in range(len(ids))]
    assert result.chunks.tolist() == expected
    # The same through the general path (a second, equal table object).
    twin = TokenBytes.from_pieces(table.pieces(), special=table.special_text)
    assert align(ids, ids, table, twin).chunks.tolist() == expected


def test_zero_byte_tokens_pair_and_attach():
    table = TokenBytes.from_pieces([b"ab", b"c", b"", b"", b"abc"], special={2: "<s>", 3: "</s>"})
    # student: <s> <s> ab c </s>     teacher: <s> abc </s> </s>
    result = align([2, 2, 0, 1, 3], [2, 4, 3, 3], table, table)
    assert result.chunks.tolist() == [[0, 1, 0, 1], [1, 4, 1, 3], [4, 5, 3, 4]]
    # The unpaired BOS joined the following chunk; the unpaired EOS (paired from the end) the
    # last text chunk.
    assert result.exact.all()


def test_equal_lengths_are_not_equal_bytes():
    """Identical bytes are decided per chunk; equal lengths, ids or duplicates must not fool it."""
    table_s = TokenBytes.from_pieces([b"ab", b"c", b"abc", b"x"])
    table_t = TokenBytes.from_pieces([b"x", b"abd", b"a", b"bd", b"ab", b"ab", b"c", b"abc"])
    for ids_s, ids_t in [([2, 3], [1, 0]), ([0, 1, 3], [2, 3, 0]), ([3, 2], [0, 1])]:
        result = align(ids_s, ids_t, table_s, table_t)  # "abc" against "abd": not exact
        assert not result.exact.all()
        for (s0, s1, t0, t1), exact in zip(result.chunks.tolist(), result.exact.tolist()):
            bytes_s, bytes_t = table_s.decode(ids_s[s0:s1]), table_t.decode(ids_t[t0:t1])
            assert (bytes_s == bytes_t) >= exact
    # The same bytes under different ids, and twice in one vocabulary: exact, one per token.
    for ids_t in ([4, 6, 0], [5, 6, 0], [7, 0]):
        result = align([0, 1, 3], ids_t, table_s, table_t)
        assert result.exact.all() and result.num_fallback == 0
        assert len(result) == len(ids_t) and result.chunks[-1].tolist()[1::2] == [3, len(ids_t)]


def test_empty_and_degenerate_inputs():
    table = TokenBytes.from_pieces([b"a", b""], special={1: "<s>"})
    for ids_s, ids_t in [([], []), ([1], [1]), ([1], []), ([0], []), ([], [0])]:
        result = align(ids_s, ids_t, table, table)
        assert result.chunks.shape == (0, 4) and result.exact.shape == (0,)
    one_sided = align([1], [0], table, table)  # no bytes on one side only
    assert one_sided.chunks.tolist() == [[0, 1, 0, 1]] and not one_sided.exact[0]


def test_bad_ids_are_user_errors():
    table = TokenBytes.from_pieces([b"a", b"b"])
    with pytest.raises(UserError, match="outside this tokenizer's vocabulary of 2"):
        align([0, 5], [0], table, table)
    with pytest.raises(UserError, match="outside"):
        align([0], [-1], table, table)
    with pytest.raises(UserError, match="1-D"):
        align([[0, 1]], [0], table, table)
    with pytest.raises(UserError, match="one of each per text"):
        align_batch([[0]], [], table, table)


@pytest.mark.parametrize(
    "case", ["plain", "bos_one_side", "bos_both", "bos_both_eos", "empty_text", "differ"]
)
def test_align_batch_equals_align(case):
    """The one-pass batch path and its text-by-text fallbacks give what `align` gives."""
    rng = np.random.default_rng(len(case))
    vocab = [*_byte_vocab(), b""]
    bos = len(vocab) - 1
    table = TokenBytes.from_pieces(vocab, special={bos: "<s>"})
    twin = TokenBytes.from_pieces(vocab, special={bos: "<s>"}, name="twin")
    alphabet = list("the cat sat é")
    texts = ["".join(rng.choice(alphabet, size=int(n))).encode() for n in rng.integers(1, 60, 6)]
    batch_s = [_tokens(vocab, t, rng) for t in texts]
    batch_t = [_tokens(vocab, t, rng) for t in texts]
    if case in ("bos_one_side", "bos_both", "bos_both_eos"):
        batch_s = [[bos, *ids] for ids in batch_s]
    if case in ("bos_both", "bos_both_eos"):
        batch_t = [[bos, *ids] for ids in batch_t]
    if case == "bos_both_eos":  # zero-byte tokens after the text: they pair up text by text
        batch_s[1] = [*batch_s[1], bos]
    if case == "empty_text":
        batch_s[2], batch_t[2] = [], []
    if case == "differ":
        batch_t[3] = _tokens(vocab, texts[3] + b"!", rng)
    got = align_batch(batch_s, batch_t, table, twin)
    assert len(got) == len(texts)
    one_pass = _align_together(batch_s, batch_t, table, twin) is not None
    assert one_pass == (case in ("plain", "bos_one_side", "bos_both"))
    for k, (result, ids_s, ids_t) in enumerate(zip(got, batch_s, batch_t)):
        expected = align(ids_s, ids_t, table, twin)
        assert np.array_equal(result.chunks, expected.chunks)
        assert np.array_equal(result.exact, expected.exact)
        if not (case == "differ" and k == 3):  # that text really differs
            check_alignment(result, ids_s, ids_t, table, twin)


# --- the diff path ----------------------------------------------------------------------


def _tokens(table_pieces: list[bytes], text: bytes, rng) -> list[int]:
    """Greedy random segmentation of `text` into ids of a vocabulary of all single bytes and
    every piece in `table_pieces`."""
    lookup = {p: i for i, p in enumerate(table_pieces)}
    ids, pos = [], 0
    while pos < len(text):
        for end in range(min(len(text), pos + int(rng.integers(1, 5))), pos, -1):
            if text[pos:end] in lookup:
                ids.append(lookup[text[pos:end]])
                pos = end
                break
    return ids


def _byte_vocab() -> list[bytes]:
    words = [b"the", b"cat", b" sat", b" on", b" mat", b"caf", b"\xc3\xa9", b"e\xcc\x81", b"  "]
    return [bytes([b]) for b in range(256)] + words


@pytest.mark.parametrize("seed", range(12))
def test_different_bytes_keep_every_property(seed):
    rng = np.random.default_rng(100 + seed)
    vocab = _byte_vocab()
    table = TokenBytes.from_pieces(vocab)
    words = ["the cat", " sat on", " the mat", " café", " naïve", "  ", "x"]
    text = "".join(rng.choice(words, size=40))
    nfd = unicodedata.normalize("NFD", text).encode()
    nfc = unicodedata.normalize("NFC", text).encode()
    # Teacher normalises to NFC and drops a few spaces; student keeps NFD.
    dropped = bytearray(nfc)
    for _ in range(3):
        spaces = [i for i, c in enumerate(dropped) if c == 0x20]
        del dropped[int(rng.choice(spaces))]
    ids_s = _tokens(vocab, nfd, rng)
    ids_t = _tokens(vocab, bytes(dropped), rng)
    result = align(ids_s, ids_t, table, table)
    inexact = check_alignment(result, ids_s, ids_t, table, table)
    assert same_text(*inexact)
    assert not result.exact.all()
    assert result.exact.mean() > 0.5  # differences stay local


def test_dp_fallback_splits_replaced_stretches_and_is_counted():
    vocab = _byte_vocab()
    table = TokenBytes.from_pieces(vocab)
    # NFD on the student side, NFC on the teacher side, no byte in common in the middle.
    ids_s = [vocab.index(b"e\xcc\x81")] * 3 + [ord("x")]
    ids_t = [vocab.index(b"\xc3\xa9")] * 3 + [ord("x")]
    result = align(ids_s, ids_t, table, table)
    assert result.chunks.tolist() == [[0, 1, 0, 1], [1, 2, 1, 2], [2, 3, 2, 3], [3, 4, 3, 4]]
    assert result.exact.tolist() == [False, False, False, True]
    assert result.num_fallback > 0


def test_matching_blocks_are_valid_and_local():
    rng = np.random.default_rng(11)
    for trial in range(30):
        a = rng.integers(
            0, 4 if trial % 2 else 256, size=int(rng.integers(0, 3000)), dtype=np.uint8
        )
        b = a.copy()
        edits = int(rng.integers(0, 6))
        for _ in range(edits):
            pos = int(rng.integers(0, len(b) + 1))
            b = np.concatenate(
                (
                    b[:pos],
                    rng.integers(0, 256, size=int(rng.integers(0, 4)), dtype=np.uint8),
                    b[pos + int(rng.integers(0, 3)) :],
                )
            )
        blocks = matching_blocks(a, b)
        last_i = last_j = 0
        for i, j, n in blocks.tolist():
            assert n > 0 and i >= last_i and j >= last_j
            assert np.array_equal(a[i : i + n], b[j : j + n])
            last_i, last_j = i + n, j + n
        if trial % 2 == 0 and len(a) > 100:  # random bytes: nearly everything matches
            assert blocks[:, 2].sum() >= len(a) - 6 * edits - 8


def test_lcs_pairs_against_plain_dynamic_program():
    rng = np.random.default_rng(5)
    for _ in range(30):
        a = rng.integers(0, 4, size=int(rng.integers(0, 25))).tolist()
        b = rng.integers(0, 4, size=int(rng.integers(0, 25))).tolist()
        pairs = lcs_pairs(a, b)
        table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
        for i in range(len(a)):
            for j in range(len(b)):
                table[i + 1][j + 1] = (
                    table[i][j] + 1 if a[i] == b[j] else max(table[i][j + 1], table[i + 1][j])
                )
        assert len(pairs) == table[len(a)][len(b)]
        assert all(a[i] == b[j] for i, j in pairs)
        assert all(i1 < i2 and j1 < j2 for (i1, j1), (i2, j2) in zip(pairs, pairs[1:]))


# --- real tokenizers ---------------------------------------------------------------------

SAMPLES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\r\n\treturn x**2  # 数学 🙂\n",
    "   leading spaces and trailing   ",
    "café naïve — ﬁ ① Å",
    "👨\u200d👩\u200d👧 🇯🇵 1️⃣ 한국어 テキスト",
    "<think>reasoning</think> <tool_call>",
]


@pytest.mark.parametrize("name", ["qwen3", "llama3", "llama2", "gpt2", "phi-4", "phi-4-mini"])
def test_token_bytes_reproduce_the_text(real_tokenizer, name):
    tok = real_tokenizer(name)
    table = TokenBytes.from_tokenizer(tok)
    assert TokenBytes.from_tokenizer(tok) is table  # cached per fingerprint
    assert table.lengths.shape == (table.vocab_size,) and table.lengths.dtype == np.int32
    for text in SAMPLES:
        ids = tok(text)["input_ids"]
        expected = unicodedata.normalize("NFC", text) if name.startswith("qwen") else text
        prefix = b" " if table.prefix_space else b""
        assert table.decode(ids) == prefix + expected.encode()
    special_ids = [i for i in tok.all_special_ids if i < table.vocab_size]
    assert special_ids and (table.lengths[special_ids] == 0).all()


def test_token_bytes_details(real_tokenizer):
    qwen = TokenBytes.from_tokenizer(real_tokenizer("qwen3"))
    think = real_tokenizer("qwen3").convert_tokens_to_ids("<think>")
    assert qwen.token_bytes(think) == b"<think>"  # non-special added token: its text
    llama2 = TokenBytes.from_tokenizer(real_tokenizer("llama2"))
    assert llama2.prefix_space and llama2.kind == "sentencepiece"
    assert llama2.token_bytes(real_tokenizer("llama2").convert_tokens_to_ids("<0x0A>")) == b"\n"
    assert llama2.byte_piece.sum() == 256


@pytest.mark.parametrize("name", ["qwen3", "llama2", "phi-4"])
def test_real_tokenizer_identity(real_tokenizer, name):
    tok = real_tokenizer(name)
    table = TokenBytes.from_tokenizer(tok)
    for text in [*SAMPLES, "a <|im_end|> b<s>x<|endoftext|>"]:
        ids = tok(text)["input_ids"]
        result = align(ids, ids, table, table)
        n = len(ids)
        assert result.chunks.tolist() == [[i, i + 1, i, i + 1] for i in range(n)]


def test_literal_special_token_strings(real_tokenizer):
    text = "x<|endoftext|>y<s>z <|im_end|>\n<|begin_of_text|></s> w"
    for name_s, name_t in [("llama2", "qwen3"), ("phi-4", "llama3"), ("gpt2", "phi-4-mini")]:
        tok_s, tok_t = real_tokenizer(name_s), real_tokenizer(name_t)
        table_s, table_t = TokenBytes.from_tokenizer(tok_s), TokenBytes.from_tokenizer(tok_t)
        ids_s, ids_t = tok_s(text)["input_ids"], tok_t(text)["input_ids"]
        result = align(ids_s, ids_t, table_s, table_t)
        check_alignment(result, ids_s, ids_t, table_s, table_t, text)
        empty = align(tok_s("")["input_ids"], tok_t("")["input_ids"], table_s, table_t)
        assert empty.num_chunks == 0


# --- the command line ----------------------------------------------------------------------


def test_align_command_text_and_jsonl(tokenizer_dir, tmp_path, capsys):
    from crossdistill.cli import main
    from crossdistill.data.aligned import Pipeline

    student, teacher = str(tokenizer_dir("gpt2")), str(tokenizer_dir("llama2"))
    args = ["align", "--student-tokenizer", student, "--teacher-tokenizer", teacher]
    assert main([*args, "--text", "def f(x):\n    return 1"]) == 0
    out = capsys.readouterr().out
    assert "[ return]" in out and "chunks" in out

    texts = ["Hello  world", "", "数学 🙂 café", "x" * 3000]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n\n")
    target = tmp_path / "out.jsonl"
    assert main([*args, "--input", str(source), "--output", str(target), "--workers", "2"]) == 0
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    pipeline = Pipeline.load(student, teacher)
    assert len(rows) == len(texts)
    for text, row in zip(texts, rows):  # as training encodes a document
        for side, ids in (
            (pipeline.side_s, row["student_ids"]),
            (pipeline.side_t, row["teacher_ids"]),
        ):
            content = side.encode_content(text).tolist()
            assert ids == side.start_ids.tolist() + content + [side.doc_end_id]
        expected = align(row["student_ids"], row["teacher_ids"], pipeline.bytes_s, pipeline.bytes_t)
        assert row["chunks"] == expected.chunks.tolist()


def test_align_command_reports_bad_lines(tokenizer_dir, tmp_path, capsys):
    from crossdistill.cli import main

    args = ["align", "--student-tokenizer", str(tokenizer_dir("gpt2"))]
    args += ["--teacher-tokenizer", str(tokenizer_dir("llama2"))]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "bad \xff byte"}\n')
    out = tmp_path / "out.jsonl"
    assert main([*args, "--input", str(bad), "--output", str(out), "--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:3: non-UTF-8 bytes" in err and not out.exists()
    bad.write_text('{"text": "fine"}\n{"txt": "x"}\n')
    assert main([*args, "--input", str(bad), "--output", str(out)]) == 2
    assert "bad.jsonl:2: missing field 'text'" in capsys.readouterr().err
    assert main([*args, "--input", str(tmp_path / "missing.jsonl"), "--output", str(out)]) == 2


def test_align_command_reads_every_training_format_and_keeps_literals_as_text(
    tokenizer_dir, tmp_path
):
    """Plain text files, a folder of them and Parquet as well as JSONL; and a literal `<s>` in
    a document is text, as in training (Llama-2 would read it as its BOS otherwise)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from crossdistill.cli import main
    from crossdistill.data.aligned import Pipeline

    student, teacher = str(tokenizer_dir("llama2")), str(tokenizer_dir("qwen3"))
    texts = ["<s> is text </s> <think>here</think>", "naïve café 数学\n  indented"]
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, t in enumerate(texts):
        (folder / f"{i}.txt").write_text(t, encoding="utf-8")
    pq.write_table(pa.table({"body": texts}), tmp_path / "docs.parquet")
    args = ["align", "--student-tokenizer", student, "--teacher-tokenizer", teacher]
    runs = {
        "folder": ["--input", str(folder), "--format", "text"],
        "parquet": ["--input", str(tmp_path / "docs.parquet"), "--field", "body"],
    }
    pipeline = Pipeline.load(student, teacher)
    bos = pipeline.side_s.start_ids.tolist()
    for name, extra in runs.items():
        out = tmp_path / f"{name}.jsonl"
        assert main([*args, *extra, "--output", str(out), "--workers", "1"]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(rows) == 2
        for text, row in zip(texts, rows):
            assert row["student_ids"][: len(bos)] == bos and bos[0] not in row["student_ids"][1:]
            assert pipeline.bytes_s.decode(row["student_ids"]).decode() == " " + text
            assert pipeline.bytes_t.decode(row["teacher_ids"]).decode() == text


def test_warm_start_reads_the_caches_and_a_damaged_entry_is_rebuilt(tokenizer_dir, tmp_path):
    """A second start reads the converted tokenizer and its byte table from the disk cache
    (no torch, no transformers imported); a damaged cache entry is rebuilt, never trusted."""
    import os
    import subprocess
    import sys

    from crossdistill.cache import cache_path

    env = {**os.environ, "CROSSDISTILL_CACHE": str(tmp_path / "cache")}
    code = (
        "import sys, json\n"
        "from crossdistill.data.aligned import Pipeline\n"
        f"p = Pipeline.load({str(tokenizer_dir('llama3'))!r}, {str(tokenizer_dir('qwen3'))!r}, fast=False)\n"
        "ids = p.encode(['x <|im_start|> y'])\n"
        "print(json.dumps([ids, 'torch' in sys.modules, 'transformers' in sys.modules]))\n"
    )

    def run():
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold = run()
    warm = run()
    assert warm[0] == cold[0] and warm[1:] == [False, False]
    for entry in (cache_path("tokenizers", "x").parent, cache_path("token-bytes", "x").parent):
        entry = tmp_path / "cache" / entry.name
        files = sorted(entry.iterdir())
        assert files
        for f in files:
            f.write_bytes(b"damaged")
    assert run()[0] == cold[0]

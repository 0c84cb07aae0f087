"""Demo ingredients: the stdlib corpus split by file, and the two demo tokenizers (trained small
here), which must differ, round-trip text exactly, load through `load_tokenizer`, and be cached."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from crossdistill.errors import UserError
from crossdistill.models import load_tokenizer
from crossdistill.train.demo_assets import (
    DEMO_SIZES,
    FINGERPRINT_FILE,
    SPIECE_SPACE,
    STUDENT_ALPHABET,
    stdlib_corpus,
    train_demo_tokenizers,
)

SMALL = {"teacher_vocab": 700, "student_vocab": 600}


def _fake_stdlib(root: Path) -> dict[str, str]:
    """A stdlib-shaped tree: what must be read, and what must be skipped."""
    keep = {
        "os.py": "import sys\n\ndef f(x):\n    return x\n",
        "json/decoder.py": "class D:\n    pass\n",
        "email/mime/text.py": "X = 'text'\n",
        "a.py": "a = 1\n",
        "b.py": "b = 2\n",
    }
    skip = {
        "test/test_os.py": "assert 1\n",
        "unittest/tests/t.py": "assert 2\n",
        "idlelib/editor.py": "ed = 1\n",
        "site-packages/pkg/m.py": "pkg = 1\n",
        "__pycache__/x.py": "cache = 1\n",
        "notes.txt": "not python\n",
        "empty.py": "\n\n",
    }
    for rel, text in {**keep, **skip}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "latin1.py").write_bytes("s = 'caf\xe9'\n".encode("latin-1"))  # not UTF-8
    (root / "huge.py").write_text("x = 1\n" * (DEMO_SIZES["max_file_bytes"] // 6 + 10))
    return keep


def test_corpus_reads_only_what_it_should(tmp_path):
    keep = _fake_stdlib(tmp_path)
    train, val = stdlib_corpus(max_files=100, seed=0, root=tmp_path)
    assert sorted(train + val) == sorted(keep.values())
    assert len(val) == 1  # at least one file held out, at most a tenth of the files


def test_corpus_split_is_by_file_and_seeded():
    a_train, a_val = stdlib_corpus(max_files=40, seed=0, train_bytes=200_000, val_bytes=30_000)
    b_train, b_val = stdlib_corpus(max_files=40, seed=0, train_bytes=200_000, val_bytes=30_000)
    c_train, c_val = stdlib_corpus(max_files=40, seed=1, train_bytes=200_000, val_bytes=30_000)
    assert (a_train, a_val) == (b_train, b_val)
    assert (a_train, a_val) != (c_train, c_val)
    assert a_val and a_train and not set(a_val) & set(a_train)
    assert len(a_train) + len(a_val) <= 40 and len(a_val) <= 4
    val_bytes = sum(len(t.encode()) for t in a_val)
    train_bytes = sum(len(t.encode()) for t in a_train)
    # Byte budgets are met by whole files: at most one file over them.
    assert val_bytes < 30_000 + DEMO_SIZES["max_file_bytes"]
    assert train_bytes < 200_000 + DEMO_SIZES["max_file_bytes"]
    assert all(len(t.encode()) <= DEMO_SIZES["max_file_bytes"] for t in a_train + a_val)


def test_default_corpus_sizes_fit_the_description():
    train, val = stdlib_corpus()
    train_mb = sum(len(t.encode()) for t in train) / 1e6
    val_kb = sum(len(t.encode()) for t in val) / 1e3
    assert 2.0 < train_mb < 4.0 and 100 < val_kb < 600, (train_mb, val_kb)


def test_missing_stdlib_sources_is_a_user_error(tmp_path):
    (tmp_path / "only.pyc").write_bytes(b"\0")
    with pytest.raises(UserError, match="standard library"):
        stdlib_corpus(root=tmp_path)
    with pytest.raises(UserError, match="standard library"):
        stdlib_corpus(root=tmp_path / "absent")


@pytest.fixture(scope="module")
def small_tokenizers(tmp_path_factory):
    train, val = stdlib_corpus(max_files=30, seed=3, train_bytes=150_000, val_bytes=20_000)
    out = tmp_path_factory.mktemp("demo_tok")
    student_dir, teacher_dir = train_demo_tokenizers(train, out, val_texts=val, **SMALL)
    return train, val, out, student_dir, teacher_dir


def test_tokenizers_load_and_differ(small_tokenizers):
    _, val, _, student_dir, teacher_dir = small_tokenizers
    tok_s, tok_t = load_tokenizer(str(student_dir)), load_tokenizer(str(teacher_dir))
    assert len(tok_s) == SMALL["student_vocab"] and len(tok_t) == SMALL["teacher_vocab"]
    for tok in (tok_s, tok_t):
        assert None not in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    text = "def area(radius):\n    return 3.14159 * radius ** 2\n"
    pieces_s = tok_s.convert_ids_to_tokens(tok_s(text, add_special_tokens=False)["input_ids"])
    pieces_t = tok_t.convert_ids_to_tokens(tok_t(text, add_special_tokens=False)["input_ids"])
    assert pieces_s[0].startswith(SPIECE_SPACE)  # SentencePiece style, with the dummy prefix
    assert any("Ġ" in p for p in pieces_t)  # byte-level BPE
    assert pieces_s != pieces_t
    # Same held-out text, different cuts: the byte offsets of token ends differ somewhere.
    ends_s = {e for _, e in tok_s(val[0], return_offsets_mapping=True)["offset_mapping"]}
    ends_t = {e for _, e in tok_t(val[0], return_offsets_mapping=True)["offset_mapping"]}
    assert ends_s != ends_t and len(ends_s & ends_t) > 0.3 * min(len(ends_s), len(ends_t))


def _content_ids(tok, text: str) -> list[int]:
    """Encoded as the data pipeline encodes document text: special-token names are plain text."""
    backend = type(tok.backend_tokenizer).from_str(tok.backend_tokenizer.to_str())
    backend.encode_special_tokens = True
    return backend.encode(text, add_special_tokens=False).ids


def test_tokenizers_round_trip_any_text(small_tokenizers):
    _, val, _, student_dir, teacher_dir = small_tokenizers
    texts = [
        *val,
        " leading space",
        "  two\n\n\ttabs\t\r\n",
        "naïve ünïcödé Ωμέγα 漢字 😀 \x00\x7f",
        "<0x41> looks like a byte token",
    ]
    specials = "<bos> <eos> <pad> <unk> <|endoftext|> <|pad|>"
    for folder in (student_dir, teacher_dir):
        tok = load_tokenizer(str(folder))
        for text in texts:
            assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
            assert tok.decode(_content_ids(tok, text)) == text
        assert tok.decode(_content_ids(tok, specials)) == specials


def test_only_the_student_adds_a_bos(small_tokenizers):
    *_, student_dir, teacher_dir = small_tokenizers
    tok_s, tok_t = load_tokenizer(str(student_dir)), load_tokenizer(str(teacher_dir))
    ids_s = tok_s("x = 1")["input_ids"]
    assert ids_s[0] == tok_s.bos_token_id and ids_s[1:] == _content_ids(tok_s, "x = 1")
    assert tok_t("x = 1")["input_ids"] == _content_ids(tok_t, "x = 1")


def test_student_uses_byte_fallback_for_unseen_characters(small_tokenizers):
    *_, student_dir, _ = small_tokenizers
    tok = load_tokenizer(str(student_dir))
    pieces = tok.convert_ids_to_tokens(tok("😀", add_special_tokens=False)["input_ids"])
    assert pieces[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert tok.unk_token_id not in tok("😀 漢字 \x00", add_special_tokens=False)["input_ids"]


def test_the_documented_exception_of_the_student(small_tokenizers):
    *_, student_dir, _ = small_tokenizers
    tok = load_tokenizer(str(student_dir))
    assert tok.decode(tok(f"a{SPIECE_SPACE}b", add_special_tokens=False)["input_ids"]) == "a b"


def test_tokenizers_are_cached_by_corpus(small_tokenizers):
    train, val, out, student_dir, teacher_dir = small_tokenizers
    before = {d: os.stat(d / "tokenizer.json").st_ino for d in (student_dir, teacher_dir)}
    assert train_demo_tokenizers(train, out, val_texts=val, **SMALL) == (student_dir, teacher_dir)
    assert {d: os.stat(d / "tokenizer.json").st_ino for d in before} == before  # reused
    fingerprint = (student_dir / FINGERPRINT_FILE).read_text()
    train_demo_tokenizers(train[:-1], out, val_texts=val, **SMALL)  # another corpus: retrained
    assert (student_dir / FINGERPRINT_FILE).read_text() != fingerprint
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []


def test_student_alphabet_does_not_depend_on_the_process(tmp_path):
    """More distinct characters than the student's alphabet holds, most of them seen once: which
    of the tied ones the student keeps must not change from one training to the next (the
    trainer's own cut-off picks among ties in hash-map order, new in every training)."""
    rare = [chr(0x4E00 + i) for i in range(2 * STUDENT_ALPHABET)]
    train = ["def f(x):\n    return x + 1\n" * 40, "".join(rare)]
    val = ["def g(y):\n    return y\n"]
    vocabs = []
    for i in range(3):
        student_dir, _ = train_demo_tokenizers(train, tmp_path / str(i), val_texts=val, **SMALL)
        vocabs.append(load_tokenizer(str(student_dir)).get_vocab())
    assert vocabs[0] == vocabs[1] == vocabs[2]
    kept = sorted(c for c in rare if c in vocabs[0])
    common = set(SPIECE_SPACE + train[0].replace(" ", SPIECE_SPACE))
    assert kept == rare[: STUDENT_ALPHABET - len(common)]  # ties go to the lowest code points


def test_empty_corpus_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="empty corpus"):
        train_demo_tokenizers([], tmp_path)

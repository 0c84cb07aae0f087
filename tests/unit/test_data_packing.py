"""Packing on common boundaries with real tokenizer pairs: every row holds the same text for the
student and each teacher, chunk arrays index valid positions only, labels and positions are
right, long documents are split and never dropped."""

from __future__ import annotations

import unicodedata

import numpy as np
import pytest
import torch

from crossdistill.alignment import TokenBytes
from crossdistill.config import DataConfig
from crossdistill.data import build_loader
from crossdistill.models.attention import block_causal_mask
from tests.conftest import TOKENIZER_NAMES
from tests.unit.test_data_helpers import (
    UNICODE_TEXTS,
    check_same_decoded_text,
    check_same_text,
    check_student,
    check_teacher,
    doc_segments,
    row_texts,
    stdlib_texts,
    write_jsonl,
)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSDISTILL_CACHE", str(tmp_path / "cache"))


def _take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    texts = stdlib_texts(10, max_chars=3000) + UNICODE_TEXTS
    rng = np.random.default_rng(0)
    texts = [texts[i] for i in rng.permutation(len(texts))]
    return write_jsonl(tmp_path_factory.mktemp("packing") / "docs.jsonl", texts), texts


def test_llama3_student_with_qwen3_and_phi4_mini_teachers(real_tokenizer, corpus):
    path, _ = corpus
    tok_s, teachers = (
        real_tokenizer("llama3"),
        [real_tokenizer("qwen3"), real_tokenizer("phi-4-mini")],
    )
    cfg = DataConfig(
        train=[str(path)],
        seq_len=192,
        micro_batch_size=3,
        pad_multiple=32,
        num_workers=0,
        val_fraction=0.0,
    )
    tb_s = TokenBytes.from_tokenizer(tok_s)
    tbs = [TokenBytes.from_tokenizer(t) for t in teachers]
    segments = 0
    for batch in _take(build_loader(cfg, tok_s, teachers), 6):
        check_student(batch, tb_s, 192)
        for k, (tb_t, nfc) in enumerate(zip(tbs, [True, False])):
            check_teacher(batch, k, tb_s, tb_t, 32)
            segments += check_same_text(batch, k, tb_s, tb_t, nfc=nfc)
            check_same_decoded_text(batch, k, tok_s, teachers[k])
            assert batch.teachers[k].num_kd > 0.8 * batch.student.num_target_tokens
    assert segments > 20


def test_llama2_student_with_gpt2_teacher(real_tokenizer, corpus):
    path, _ = corpus
    tok_s, tok_t = real_tokenizer("llama2"), real_tokenizer("gpt2")
    cfg = DataConfig(
        train=[str(path)],
        seq_len=160,
        micro_batch_size=2,
        pad_multiple=16,
        num_workers=0,
        val_fraction=0.0,
    )
    tb_s, tb_t = TokenBytes.from_tokenizer(tok_s), TokenBytes.from_tokenizer(tok_t)
    for batch in _take(build_loader(cfg, tok_s, [tok_t]), 5):
        check_student(batch, tb_s, 160)
        check_teacher(batch, 0, tb_s, tb_t, 16)
        check_same_text(batch, 0, tb_s, tb_t, nfc=False)
        # each tokenizer's own delimiters: a document inside a row starts with <s> (llama2,
        # which adds it) right after </s>; gpt2 has no BOS: its documents end with
        # <|endoftext|> and start with one too, so that their first token is predicted
        for b in range(2):
            ids_s, ids_t = batch.student.input_ids[b], batch.teachers[0].input_ids[b]
            segs_s = doc_segments(batch.student.doc_ids[b].numpy())
            segs_t = doc_segments(batch.teachers[0].doc_ids[b].numpy())
            for (a_s, _), (a_t, _) in zip(segs_s[1:], segs_t[1:]):
                assert ids_s[a_s] == tok_s.bos_token_id and ids_s[a_s - 1] == tok_s.eos_token_id
                assert ids_t[a_t - 1] == tok_t.convert_tokens_to_ids("<|endoftext|>")
                assert ids_t[a_t] == tok_t.convert_tokens_to_ids("<|endoftext|>")


def test_same_tokenizer_teacher_reuses_student_tensors(real_tokenizer, corpus):
    path, _ = corpus
    tok = real_tokenizer("gpt2")
    cfg = DataConfig(
        train=[str(path)], seq_len=96, micro_batch_size=2, num_workers=0, val_fraction=0.0
    )
    batch = _take(build_loader(cfg, tok, [tok, real_tokenizer("llama2")]), 1)[0]
    s, t = batch.student, batch.teachers[0]
    assert t.same_as_student and t.input_ids is s.input_ids and t.labels is s.labels
    flat = np.flatnonzero(s.doc_ids.numpy().reshape(-1) >= 0)
    assert t.chunks.numpy().tolist() == [[i, i + 1, i, i + 1] for i in flat]
    # KD at exactly the ordinary positions: position i predicts token i + 1
    lab = s.labels.numpy().reshape(-1)
    assert t.kd_valid.numpy().tolist() == [bool(i % 96 and lab[i - 1] != -100) for i in flat]
    check_teacher(
        batch,
        1,
        TokenBytes.from_tokenizer(tok),
        TokenBytes.from_tokenizer(real_tokenizer("llama2")),
        64,
    )


def test_long_document_is_split_on_common_boundaries_never_dropped(real_tokenizer, tmp_path):
    long_text = "\n".join(stdlib_texts(6, max_chars=4000, skip=3)) + "\n" + UNICODE_TEXTS[1] * 3
    path = write_jsonl(tmp_path / "long.jsonl", [long_text])
    tok_s, tok_t = real_tokenizer("llama3"), real_tokenizer("qwen3")
    cfg = DataConfig(
        train=[str(path)],
        seq_len=128,
        micro_batch_size=4,
        num_workers=0,
        val_fraction=0.0,
        pad_multiple=8,
    )
    tb_s, tb_t = TokenBytes.from_tokenizer(tok_s), TokenBytes.from_tokenizer(tok_t)
    n_tokens = len(tok_s(long_text, add_special_tokens=False)["input_ids"])
    num_batches = -(-n_tokens // (128 * 4)) + 1
    got_s, got_t = b"", b""
    for batch in _take(build_loader(cfg, tok_s, [tok_t]), num_batches):
        check_teacher(batch, 0, tb_s, tb_t, 8)
        for segs_s, segs_t in zip(row_texts(batch, None, tb_s), row_texts(batch, 0, tb_t)):
            got_s += b"".join(segs_s)
            got_t += b"".join(segs_t)
    # the stream repeats the one document; its first copy must be whole and in order
    assert got_s.decode().startswith(long_text) and got_s.count(long_text.encode()) >= 1
    assert got_t.decode().startswith(unicodedata.normalize("NFC", long_text))


def test_chat_loss_on_assistant_and_all(real_tokenizer, tmp_path):
    import json

    convs = [
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "It is 4. Café ☕ and 数学."},
            {"role": "user", "content": "And <|im_end|> 3 + 3?"},
            {"role": "assistant", "content": "  6, of course.\n"},
        ],
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue 🟦."},
        ],
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    tok_s = real_tokenizer("llama3")
    teachers = [real_tokenizer("qwen3"), real_tokenizer("phi-4-mini")]
    tb_s = TokenBytes.from_tokenizer(tok_s)
    tbs = [TokenBytes.from_tokenizer(t) for t in teachers]
    assistant = [m["content"].strip() for c in convs for m in c if m["role"] == "assistant"]
    for loss_on in ("assistant", "all"):
        cfg = DataConfig(
            train=[str(path)],
            messages_field="messages",
            loss_on=loss_on,
            seq_len=256,
            micro_batch_size=2,
            num_workers=0,
            val_fraction=0.0,
        )
        batch = _take(build_loader(cfg, tok_s, teachers), 1)[0]
        check_student(batch, tb_s, 256, text_only=False)
        s = batch.student
        lab = s.labels.numpy()
        targets = tok_s.decode(lab[lab >= 0].tolist())
        if loss_on == "assistant":
            # assistant contents and their end-of-turn tokens, nothing of the prompts
            for a in assistant:
                assert a in targets
            assert "What is 2 + 2?" not in targets and "Name a colour" not in targets
            # the stream repeats the two conversations; three assistant turns per repeat
            assert targets.count("<|eot_id|>") == 3 * targets.count("Blue 🟦.") > 0
        else:
            assert "What is 2 + 2?" in targets and "You answer briefly." in targets
        for k, tb_t in enumerate(tbs):
            check_teacher(batch, k, tb_s, tb_t, 64, text_only=False)
            t = batch.teachers[k]
            kd_chunks = t.chunks.numpy()[t.kd_valid.numpy()]
            ids_s, ids_t = s.input_ids.numpy().reshape(-1), t.input_ids.numpy().reshape(-1)
            for s0, s1, t0, t1 in kd_chunks.tolist():
                a, z = tb_s.decode(ids_s[s0:s1]), tb_t.decode(ids_t[t0:t1])
                assert a and unicodedata.normalize(
                    "NFC", a.decode("utf-8", "replace")
                ) == unicodedata.normalize("NFC", z.decode("utf-8", "replace"))
                assert not tb_s.special[ids_s[s0:s1]].any()  # template tokens get no KD
            kd_text = b"".join(tb_s.decode(ids_s[s0:s1]) for s0, s1, _, _ in kd_chunks.tolist())
            if loss_on == "assistant":
                assert "What is" not in kd_text.decode()
                assert "It is 4." in kd_text.decode() or "is 4." in kd_text.decode()


def test_block_causal_mask_matches_plain_reference():
    gen = torch.Generator().manual_seed(0)
    doc = torch.full((3, 17), -1, dtype=torch.int64)
    for b in range(3):
        cuts = sorted(torch.randint(1, 15, (3,), generator=gen).tolist())
        n = int(torch.randint(10, 18, (1,), generator=gen))
        for i in range(n):
            doc[b, i] = sum(i >= c for c in cuts)
    mask = block_causal_mask(doc)
    assert mask.shape == (3, 1, 17, 17) and mask.dtype == torch.bool
    for b in range(3):
        for q in range(17):
            for k in range(17):
                assert bool(mask[b, 0, q, k]) == (k <= q and int(doc[b, q]) == int(doc[b, k]))
        assert mask[b, 0].any(dim=-1).all()  # no empty row: SDPA would give NaN


@pytest.mark.parametrize("student", TOKENIZER_NAMES)
def test_every_side_scores_every_byte_of_the_text(real_tokenizer, tmp_path, student):
    """Bits per byte divide by the text's own UTF-8 bytes on every side: each tokenizer (with
    or without a BOS, with a SentencePiece dummy prefix, with Unicode normalisation) predicts
    every text token, also the first of a document and of a row that continues one, and the
    bytes credited to its labels add up to the bytes of the documents' text. The student takes
    the other seven tokenizers as teachers, so every ordered pair is covered."""
    docs = [
        "Hello world.",
        "  two leading spaces, then tabs\t\tand a CRLF\r\n",
        "naïve café, e\u0301 decomposed, \u1100\u1161\u11a8 jamo, ﬁ ligature, 数学 🙂",
        "def f(x):\n    return {'a': [1, 2.5e-3]}  # comment\n" * 3,
        "<s> literal </s> <|endoftext|> <think> text",
        UNICODE_TEXTS[0],
    ]
    val = write_jsonl(tmp_path / "v.jsonl", docs)
    cfg = DataConfig(
        train=[str(val)], validation=[str(val)], seq_len=48, micro_batch_size=2,
        pad_multiple=8, num_workers=0,
    )  # fmt: skip
    teachers = [real_tokenizer(n) for n in TOKENIZER_NAMES if n != student]
    held_out = build_loader(cfg, real_tokenizer(student), teachers, split="validation")
    batches = list(held_out)
    text_bytes = sum(len(d.encode()) for d in docs)
    assert sum(int(b.student.target_bytes.sum()) for b in batches) == text_bytes
    assert sum(b.student.num_target_bytes for b in batches) == text_bytes
    for k, name in enumerate(n for n in TOKENIZER_NAMES if n != student):
        got = sum(int(b.teachers[k].target_bytes.sum()) for b in batches)
        assert got == text_bytes, (student, name, got, text_bytes)
    # documents were cut: more row segments than documents (the rest behind start tokens)
    pieces = sum(len(doc_segments(row)) for b in batches for row in b.student.doc_ids.numpy())
    assert pieces > len(docs)

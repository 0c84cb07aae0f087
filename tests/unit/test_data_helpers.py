"""Shared helpers for the data-pipeline tests: real text from this machine, corpus writers, and
a plain, loop-based checker of every batch invariant (no test functions here)."""

from __future__ import annotations

import json
import sysconfig
import unicodedata
from pathlib import Path

import numpy as np

# Text the byte-level tokenizers disagree on: NFD marks (Qwen normalises to NFC), CJK split into
# partial UTF-8 bytes, emoji sequences, whitespace runs, and literal special-token strings that
# must stay plain text.
UNICODE_TEXTS = [
    "Cafe\u0301 cre\u0300me bru\u0302le\u0301e, an\u0303o, Ångström and ﬁne ligatures.",
    "東京都の天気は晴れです。明日は雨が降るでしょう。한국어 문장입니다. 数学很有趣！",
    "Family 👩‍👩‍👧‍👦, flags 🇫🇷🇯🇵, keycap 1️⃣, skin tone 👍🏽 and text after.",
    "tabs\t\tand   spaces    \n\n\n   and a line\r\nwith CRLF\u00a0nbsp\u3000wide",
    "A page that quotes <|endoftext|> and <|im_end|> and <think> and <s> literally.",
    "Numbers 1234567890 3.14159 1e-9 0x1F and URLs https://example.com/a?b=c&d=e#f",
]


def stdlib_texts(count: int, max_chars: int = 6000, skip: int = 0) -> list[str]:
    """`count` Python standard-library sources (deterministic choice), cut to `max_chars`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 2000)
    step = max(1, len(files) // (count + skip))
    texts = []
    for p in files[skip * step :: step][:count]:
        texts.append(p.read_text(encoding="utf-8", errors="replace")[:max_chars])
    return texts


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({field: t}) + "\n")
    return path


def doc_segments(doc_row: np.ndarray) -> list[tuple[int, int]]:
    """[(start, stop)] of each document in one row (doc ids >= 0), by a plain scan."""
    out = []
    i = 0
    while i < len(doc_row):
        if doc_row[i] < 0:
            i += 1
            continue
        j = i
        while j < len(doc_row) and doc_row[j] == doc_row[i]:
            j += 1
        out.append((i, j))
        i = j
    return out


def normalised(data: bytes, nfc: bool) -> str:
    text = data.decode("utf-8")
    return unicodedata.normalize("NFC", text) if nfc else text


def check_student(batch, tb_s, seq_len: int, text_only: bool = True) -> None:
    """Labels, positions, target bytes of the student, against plain loops (positions: a
    segment's start tokens in front of a continued document restart them like a new one)."""
    s = batch.student
    ids, lab = s.input_ids.numpy(), s.labels.numpy()
    doc, pos, tgt = s.doc_ids.numpy(), s.position_ids.numpy(), s.target_bytes.numpy()
    b_size, width = ids.shape
    assert width == seq_len
    for b in range(b_size):
        for i in range(width):
            same_next = i + 1 < width and doc[b, i] >= 0 and doc[b, i + 1] == doc[b, i]
            if text_only:
                assert lab[b, i] == (ids[b, i + 1] if same_next else -100), (b, i)
            else:
                assert lab[b, i] == -100 or (same_next and lab[b, i] == ids[b, i + 1])
            if doc[b, i] >= 0 and (i == 0 or doc[b, i - 1] != doc[b, i]):
                assert pos[b, i] == 0
            elif doc[b, i] >= 0:
                assert pos[b, i] == pos[b, i - 1] + 1
            # text bytes: none without a label (the totals are checked against the text in
            # test_data_packing.py::test_every_side_scores_every_byte_of_the_text)
            assert tgt[b, i] >= 0 and (lab[b, i] >= 0 or tgt[b, i] == 0)
    assert s.num_target_tokens == int((lab != -100).sum())
    assert s.num_target_bytes == int(tgt.sum())


def check_teacher(batch, k: int, tb_s, tb_t, pad_multiple: int, text_only: bool = True) -> None:
    """Chunk indices valid, contiguous, covering every token once, same text on both sides,
    and `kd_valid` as documented; teacher labels shifted like the student's."""
    s, t = batch.student, batch.teachers[k]
    b_size, t_s = s.input_ids.shape
    t_t = t.input_ids.shape[1]
    assert t_t % pad_multiple == 0 or t.same_as_student
    ids_s = s.input_ids.numpy().reshape(-1)
    doc_s, doc_t = s.doc_ids.numpy().reshape(-1), t.doc_ids.numpy().reshape(-1)
    lab_s = s.labels.numpy().reshape(-1)
    chunks, kd = t.chunks.numpy(), t.kd_valid.numpy()
    assert chunks.dtype == np.int64 and kd.dtype == bool and chunks.shape == (kd.size, 4)
    covered_s, covered_t = [], []
    for c, (s0, s1, t0, t1) in enumerate(chunks.tolist()):
        assert 0 <= s0 < s1 <= b_size * t_s and 0 <= t0 < t1 <= b_size * t_t, c
        assert s0 // t_s == (s1 - 1) // t_s and t0 // t_t == (t1 - 1) // t_t, c
        assert s0 // t_s == t0 // t_t, c  # same row
        assert len(set(doc_s[s0:s1])) == 1 and doc_s[s0] >= 0, c
        assert len(set(doc_t[t0:t1])) == 1 and doc_t[t0] >= 0, c
        covered_s.extend(range(s0, s1))
        covered_t.extend(range(t0, t1))
        has_pos = (
            s0 % t_s and t0 % t_t and doc_s[s0 - 1] == doc_s[s0] and doc_t[t0 - 1] == doc_t[t0]
        )
        if kd[c]:
            assert has_pos and lab_s[s0 - 1] != -100, c
        elif text_only and not t.same_as_student:
            # text data: only document starts and the zero-byte end-of-document chunk lack KD
            assert not has_pos or tb_s.lengths[ids_s[s0:s1]].sum() == 0, c
    assert covered_s == np.flatnonzero(doc_s >= 0).tolist()
    assert covered_t == np.flatnonzero(doc_t >= 0).tolist()
    assert t.num_kd == int(kd.sum())
    if not t.same_as_student:  # the non-pad tokens and their segments, padding dropped
        assert t.real_index.tolist() == np.flatnonzero(doc_t >= 0).tolist()
        lengths = [b - a for row in t.doc_ids.numpy() for a, b in doc_segments(row)]
        assert t.real_cu_seqlens.tolist() == np.cumsum([0] + lengths).tolist()
        assert t.real_max_seqlen == max(lengths, default=0)
    lab_t = t.labels.numpy()
    ids_t2, doc_t2 = t.input_ids.numpy(), t.doc_ids.numpy()
    for b in range(b_size):
        for i in range(t_t - 1):
            if lab_t[b, i] != -100:
                assert doc_t2[b, i + 1] == doc_t2[b, i] and lab_t[b, i] == ids_t2[b, i + 1]
            elif text_only:
                assert doc_t2[b, i] < 0 or doc_t2[b, i + 1] != doc_t2[b, i]


def row_texts(batch, k: int | None, tb) -> list[list[bytes]]:
    """Per row, the bytes of each document segment for the student (k None) or teacher k."""
    side = batch.student if k is None else batch.teachers[k]
    ids, doc = side.input_ids.numpy(), side.doc_ids.numpy()
    return [[tb.decode(ids[b, a:z]) for a, z in doc_segments(doc[b])] for b in range(ids.shape[0])]


def check_same_text(batch, k: int, tb_s, tb_t, nfc: bool) -> int:
    """Every document segment of every row decodes to the same text for student and teacher
    `k` (NFC-normalised when `nfc`; a SentencePiece side may have one more leading space, its
    dummy prefix at a document start). Returns the number of segments compared."""
    rows_s, rows_t = row_texts(batch, None, tb_s), row_texts(batch, k, tb_t)
    n = 0
    for b, (segs_s, segs_t) in enumerate(zip(rows_s, rows_t)):
        assert len(segs_s) == len(segs_t)
        for j, (a, z) in enumerate(zip(segs_s, segs_t)):
            if tb_s.prefix_space and a.startswith(b" ") and not z.startswith(b" "):
                a = a[1:]
            if tb_t.prefix_space and z.startswith(b" ") and not a.startswith(b" "):
                z = z[1:]
            assert normalised(a, nfc) == normalised(z, nfc), (b, j, a[:80], z[:80])
            n += 1
    return n


def check_same_decoded_text(batch, k: int, tok_s, tok_t) -> None:
    """The tokenizers' own `decode` (special tokens skipped) gives the same NFC text for every
    document segment of every row, student vs teacher `k` (byte-level tokenizers only)."""
    sides = (batch.student, batch.teachers[k])
    for b in range(batch.student.input_ids.shape[0]):
        texts = []
        for side, tok in zip(sides, (tok_s, tok_t)):
            ids, doc = side.input_ids[b].tolist(), side.doc_ids[b].numpy()
            texts.append(
                [tok.decode(ids[a:z], skip_special_tokens=True) for a, z in doc_segments(doc)]
            )
        for x, y in zip(*texts):
            assert unicodedata.normalize("NFC", x) == unicodedata.normalize("NFC", y)

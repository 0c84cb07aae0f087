"""Corpus readers, the bad-input policy, and the split / shuffle / shard schedule."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from crossdistill.config import DataConfig
from crossdistill.data import build_loader, open_source
from crossdistill.data.documents import text_pieces
from crossdistill.data.schedule import Cursor, Plan
from crossdistill.data.sources import Bad, jsonl_index
from crossdistill.errors import UserError
from tests.unit.test_data_helpers import UNICODE_TEXTS, row_texts, stdlib_texts, write_jsonl

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSDISTILL_CACHE", str(tmp_path / "cache"))


def _docs(n: int = 30) -> list[str]:
    base = stdlib_texts(8, max_chars=400) + UNICODE_TEXTS
    return [f"{i}: {base[i % len(base)]}" for i in range(n)]


def test_jsonl_index_matches_plain_split(tmp_path):
    rng = np.random.default_rng(1)
    for trailing in (True, False):
        lines = [json.dumps({"text": "x" * int(rng.integers(0, 50))}) for _ in range(200)]
        lines[7] = ""  # a blank line is a row that reads as None
        body = "\n".join(lines) + ("\n" if trailing else "")
        path = tmp_path / f"f{trailing}.jsonl"
        path.write_text(body)
        offsets = np.asarray(jsonl_index(str(path)))
        starts = [0]
        for i, ch in enumerate(body):
            if ch == "\n" and i + 1 < len(body):
                starts.append(i + 1)
        assert offsets.tolist() == starts + [len(body)]
        assert np.asarray(jsonl_index(str(path))).tolist() == offsets.tolist()  # from the cache
        src = open_source(str(path), "auto", "text")
        values = src.read(0, src.num_rows)
        want = [json.loads(x)["text"] if x else None for x in lines]
        assert values == want
        assert src.read(150, 160) == want[150:160]


def test_a_changed_jsonl_keeps_one_index_and_a_mapped_one_still_reads(tmp_path):
    """Each version of a plain JSONL file gets its own index; writing one removes the same
    path's earlier ones, not another file's, and an index already mapped reads on."""
    indexes = tmp_path / "cache" / "jsonl-index"
    path, other = tmp_path / "c.jsonl", tmp_path / "d.jsonl"
    write_jsonl(other, _docs(5))
    jsonl_index(str(other))
    mapped = None
    for n in (10, 20, 30):
        write_jsonl(path, _docs(n))
        os.utime(path, ns=(n * 10**9, n * 10**9))  # a new mtime even on a coarse clock
        offsets = jsonl_index(str(path))
        assert len(offsets) == n + 1
        if mapped is None:
            mapped, first_size = offsets, path.stat().st_size
        assert len(list(indexes.glob("*.npy"))) == 2  # this version's and the other file's
    assert len(np.asarray(jsonl_index(str(other)))) == 6
    assert len(mapped) == 11 and int(mapped[-1]) == first_size  # removed, and still mapped


def test_writing_an_index_removes_those_of_the_earlier_naming(tmp_path):
    """Indexes named by 32 hex digits of path, size and mtime together can no longer be found
    by any path; the next index written removes them, and nothing else in the folder."""
    indexes = tmp_path / "cache" / "jsonl-index"
    indexes.mkdir(parents=True)
    stale = indexes / f"{'0123456789abcdef' * 2}.npy"
    kept = [indexes / "notes.npy", indexes / f"{'a' * 31}.npy"]
    for f in [stale, *kept]:
        np.save(f, np.arange(3))
    path = write_jsonl(tmp_path / "c.jsonl", _docs(4))
    assert len(jsonl_index(str(path))) == 5
    assert not stale.exists() and all(f.exists() for f in kept)
    assert len(list(indexes.glob("*.npy"))) == 3  # the new index and the two kept


def _write_all_formats(tmp_path, docs):
    jl = write_jsonl(tmp_path / "d.jsonl", docs)
    table = pa.table({"text": docs, "other": list(range(len(docs)))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=7)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=9):
            w.write_batch(batch)
    disk = tmp_path / "hf_disk"
    disk.mkdir()
    out = pa.OSFile(str(disk / "data-00000-of-00001.arrow"), "wb")
    with out, pa.ipc.new_stream(out, table.schema) as w:  # `datasets` writes the stream format
        w.write_table(table)
    (disk / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    (disk / "dataset_info.json").write_text("{}")
    txt = tmp_path / "txt"
    txt.mkdir()
    for i, d in enumerate(docs):
        (txt / f"{i:03d}.txt").write_text(d)
    return [jl, tmp_path / "d.parquet", tmp_path / "d.arrow", disk, txt]


def test_every_format_reads_the_same_documents(tmp_path):
    docs = _docs(30)
    for path in _write_all_formats(tmp_path, docs):
        src = open_source(str(path), "auto", "text")
        assert src.num_rows == 30, path
        got = []
        for a, b in src.groups():
            got.extend(src.read(a, b))
        assert got == docs, path
        assert src.read(11, 23) == docs[11:23], path


def test_missing_column_and_dataset_dict_fail_at_open(tmp_path):
    paths = _write_all_formats(tmp_path, _docs(5))
    for path in paths[1:4]:
        with pytest.raises(UserError, match="no column 'content'"):
            open_source(str(path), "auto", "content")
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    with pytest.raises(UserError, match="DatasetDict"):
        open_source(str(tmp_path / "dd"), "auto", "text")
    with pytest.raises(UserError, match="not found"):
        open_source(str(tmp_path / "nope.jsonl"), "auto", "text")


def _bad_corpus(tmp_path):
    good = _docs(6)
    lines = [
        json.dumps({"text": good[0]}).encode(),
        b'{"text": "unterminated',
        json.dumps({"title": "x"}).encode(),
        json.dumps({"text": good[1]}).encode(),
        b'{"text": "caf\xe9 latin-1"}',
        json.dumps({"text": "  \n "}).encode(),
        json.dumps({"text": good[2]}).encode(),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path, good[:3]


def test_bad_input_skip_warns_with_file_line_and_count(tmp_path, real_tokenizer, caplog):
    path, good = _bad_corpus(tmp_path)
    tok = real_tokenizer("gpt2")
    cfg = DataConfig(
        train=[str(path)],
        seq_len=64,
        micro_batch_size=1,
        num_workers=0,
        val_fraction=0.0,
        bad_input="skip",
    )
    from crossdistill.alignment import TokenBytes

    tb = TokenBytes.from_tokenizer(tok)
    with caplog.at_level(logging.WARNING, logger="crossdistill.data"):
        loader = build_loader(cfg, tok, [])
        text = b""
        for batch in islice(loader, 40):  # the rows come shuffled: read until all are seen
            text += b"".join(row_texts(batch, None, tb)[0])
            if loader.num_skipped >= 4 and all(g.encode() in text for g in good):
                break
    messages = [r.getMessage() for r in caplog.records]
    for line, reason in [
        (2, "malformed JSON"),
        (3, "missing field 'text'"),
        (5, "non-UTF-8"),
        (6, "empty document"),
    ]:
        assert any(f"bad.jsonl:{line}: {reason}" in m for m in messages), (line, messages)
    assert any("(4 skipped so far)" in m for m in messages)
    assert loader.num_skipped >= 4
    decoded = text.decode()
    assert (
        good[0] in decoded
        and good[1] in decoded
        and "latin-1" not in decoded
        and "title" not in decoded
    )


@pytest.mark.parametrize(
    "line,content",
    [
        (2, b'{"text": "unterminated'),
        (2, b'{"title": 1}'),
        (2, b'{"text": "\xff"}'),
        (2, b'{"text": ""}'),
    ],
)
def test_bad_input_error_names_file_and_line(tmp_path, real_tokenizer, line, content):
    path = tmp_path / "e.jsonl"
    path.write_bytes(json.dumps({"text": "fine text"}).encode() + b"\n" + content + b"\n")
    cfg = DataConfig(
        train=[str(path)],
        seq_len=32,
        micro_batch_size=1,
        num_workers=0,
        val_fraction=0.0,
        bad_input="error",
    )
    with pytest.raises(UserError, match=rf"e\.jsonl:{line}: .*data\.bad_input=skip"):
        for _ in islice(build_loader(cfg, real_tokenizer("gpt2"), []), 5):
            pass


def test_non_utf8_text_file_is_bad_with_its_line(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_bytes(b"line one\nline two\nbad \xff byte\n")
    src = open_source(str(tmp_path / "t"), "auto", "text")
    (value,) = src.read(0, 1)
    assert isinstance(value, Bad) and "line 3" in value.reason


def _plan_rows(plan: Plan, consumer: int, epoch: int = 0) -> list[tuple[int, int]]:
    out = []
    for block_id in plan.block_order(epoch, consumer):
        src = int(plan.blocks[block_id, 0])
        out.extend((src, int(r)) for r in plan.rows(epoch, int(block_id)))
    return out


def test_split_is_disjoint_deterministic_and_near_the_fraction(tmp_path):
    srcs = [
        open_source(str(write_jsonl(tmp_path / f"{i}.jsonl", _docs(700))), "jsonl", "text")
        for i in range(2)
    ]
    train = Plan(srcs, "train", 0.1, seed=3, num_consumers=1, shuffle=True)
    val = Plan(srcs, "validation", 0.1, seed=3, num_consumers=1, shuffle=False)
    rows_t, rows_v = _plan_rows(train, 0), _plan_rows(val, 0)
    assert not set(rows_t) & set(rows_v)
    assert sorted(rows_t + rows_v) == [(s, r) for s in range(2) for r in range(700)]
    assert 0.06 < len(rows_v) / 1400 < 0.14
    assert (
        _plan_rows(Plan(srcs, "validation", 0.1, seed=3, num_consumers=1, shuffle=False), 0)
        == rows_v
    )
    assert set(
        _plan_rows(Plan(srcs, "validation", 0.1, seed=4, num_consumers=1, shuffle=False), 0)
    ) != set(rows_v)


def test_shards_are_disjoint_and_cover_everything_each_epoch(tmp_path):
    src = open_source(str(write_jsonl(tmp_path / "s.jsonl", _docs(500))), "jsonl", "text")
    plan = Plan([src], "all", 0.0, seed=0, num_consumers=6, shuffle=True)
    for epoch in (0, 1):
        shares = [_plan_rows(plan, c, epoch) for c in range(6)]
        flat = [r for s in shares for r in s]
        assert sorted(flat) == [(0, r) for r in range(500)] and all(shares)
    order0 = [r for c in range(6) for r in _plan_rows(plan, c, 0)]
    order1 = [r for c in range(6) for r in _plan_rows(plan, c, 1)]
    assert order0 != order1  # reshuffled every epoch
    # the stream from a cursor is the tail of the stream from the start
    whole = list(_take_stream(plan, 2, Cursor(), 120))
    start = whole[50][0]
    assert list(_take_stream(plan, 2, start, 70)) == whole[50:]


def test_training_mixes_a_corpus_stored_in_order(tmp_path):
    # two halves of a corpus, as a file sorted by language or source holds them: the first
    # tenth of every consumer's stream already draws from both, in about their shares
    src = open_source(str(write_jsonl(tmp_path / "s.jsonl", _docs(2000))), "jsonl", "text")
    for seed in range(3):
        plan = Plan([src], "train", 0.05, seed=seed, num_consumers=2, shuffle=True)
        for consumer in range(2):
            first = [r for _, r in _plan_rows(plan, consumer)[:100]]
            assert 0.35 < np.mean(np.asarray(first) < 1000) < 0.65, (seed, consumer)
    held_out = Plan([src], "validation", 0.05, seed=0, num_consumers=1, shuffle=False)
    assert held_out.blocks.shape[0] <= 8  # read in order, in runs of rows


def _take_stream(plan, consumer, cursor, n):
    for i, (cur, value, _) in enumerate(plan.stream(consumer, cursor, repeat=True)):
        if i == n:
            return
        yield cur, value


def test_parquet_row_groups_stay_whole_when_there_are_enough(tmp_path):
    docs = _docs(60)
    pq.write_table(pa.table({"text": docs}), tmp_path / "p.parquet", row_group_size=5)
    src = open_source(str(tmp_path / "p.parquet"), "auto", "text")
    plan = Plan([src], "all", 0.0, seed=0, num_consumers=2, shuffle=True)
    assert plan.blocks[:, 1].tolist() == list(range(0, 60, 5))


def test_text_pieces_cover_the_text_and_cut_after_newlines():
    text = "".join(stdlib_texts(5, max_chars=5000))
    for size in (257, 1000, 4096):
        pieces = text_pieces(text, size)
        assert "".join(pieces) == text
        assert all(0 < len(p) <= size + size // 4 for p in pieces)
        assert sum(p.endswith("\n") for p in pieces[:-1]) >= 0.9 * (len(pieces) - 1)
    assert text_pieces("short", 100) == ["short"]


def test_an_error_in_a_worker_process_reaches_the_trainer_as_one_user_error(
    tmp_path, real_tokenizer
):
    path = tmp_path / "w.jsonl"
    path.write_bytes(b'{"text": "fine"}\n{"text": 3}\n')
    cfg = DataConfig(
        train=[str(path)],
        seq_len=32,
        micro_batch_size=1,
        num_workers=1,
        val_fraction=0.0,
        bad_input="error",
    )
    with pytest.raises(UserError) as info:
        next(iter(build_loader(cfg, real_tokenizer("gpt2"), [])))
    message = str(info.value)
    assert "w.jsonl:2: field 'text' is a int, not a string" in message
    assert "Traceback" not in message and "\n" not in message


def _compress(path, kind: str):
    import bz2
    import gzip
    import lzma

    opener = {"gz": gzip.open, "bz2": bz2.open, "xz": lzma.open}[kind]
    out = path.with_name(f"{path.name}.{kind}")
    with opener(out, "wb") as f:
        f.write(path.read_bytes())
    return out


@pytest.mark.parametrize("kind", ["gz", "bz2", "xz"])
def test_compressed_jsonl_reads_as_the_plain_file_and_names_itself(tmp_path, kind):
    docs = _docs(50)
    plain = write_jsonl(tmp_path / "c.jsonl", docs)
    packed = _compress(plain, kind)
    src = open_source(str(packed), "auto", "text")
    assert src.num_rows == 50 and src.read(0, 50) == docs
    assert src.where(3) == f"{packed}:4"  # the user's file, not the decompressed copy
    again = open_source(str(packed), "jsonl", "text")  # a named format decompresses too
    assert again.path == src.path and again.read(10, 12) == docs[10:12]  # one copy, reused
    plan = Plan([src], "all", 0.0, seed=0, num_consumers=2, shuffle=True)
    assert sorted(r for c in range(2) for _, r in _plan_rows(plan, c)) == list(range(50))


def test_compressed_text_files_are_documents(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("first document\n")
    _compress(tmp_path / "t" / "a.txt", "gz").rename(tmp_path / "t" / "b.txt.gz")
    (tmp_path / "t" / "c.gz").write_bytes(b"\x1f\x8b broken")
    src = open_source(str(tmp_path / "t"), "auto", "text")
    assert src.read(0, 2) == ["first document\n"] * 2
    (bad,) = src.read(2, 3)  # a bad row, for the bad-input policy: the others still read
    assert isinstance(bad, Bad) and bad.reason.startswith("cannot decompress it (gzip)")


def _holder(packed, cache):
    """Another process that opens `packed` and reads it until its stdin closes."""
    code = (
        "import sys; from crossdistill.data import open_source; "
        f"src = open_source({str(packed)!r}, 'auto', 'text'); "
        "print(src.path, src.num_rows, flush=True); sys.stdin.read()"
    )
    env = {**os.environ, "CROSSDISTILL_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    path, rows = proc.stdout.readline().split()
    return proc, path, int(rows)


def test_a_changed_source_leaves_no_copy_behind_once_no_run_reads_it(tmp_path):
    cache = tmp_path / "cache"
    copies = cache / "decompressed"

    def version(n):  # the same file, rewritten with n documents
        return _compress(write_jsonl(tmp_path / "c.jsonl", _docs(n)), "gz")

    def left():
        names = sorted(p.name for p in copies.iterdir() if not p.name.startswith("."))
        indexes = len(list((cache / "jsonl-index").glob("*.npy")))
        return names, indexes

    first, path_1, _ = _holder(version(10), cache)
    first.communicate("")  # that run ends: nothing holds the first copy
    second, path_2, rows = _holder(version(20), cache)  # a run that goes on reading
    assert rows == 20 and not Path(path_1).exists()  # the first copy went when the second came
    src = open_source(str(version(30)), "auto", "text")
    assert src.num_rows == 30 and src.read(0, 30) == _docs(30)
    assert Path(path_2).exists()  # still read by the run of the second version
    assert left() == (sorted([Path(path_2).name, Path(src.path).name]), 2)
    second.communicate("")
    open_source(str(tmp_path / "c.jsonl.gz"), "auto", "text")  # the next open removes it
    assert left() == ([Path(src.path).name], 1)
    assert not list(copies.glob(f".{Path(path_2).name}*"))  # its lock and lease too


def test_a_damaged_compressed_jsonl_is_one_error_and_leaves_no_copy(tmp_path):
    packed = _compress(write_jsonl(tmp_path / "c.jsonl", _docs(200)), "gz")
    packed.write_bytes(packed.read_bytes()[:-40])  # cut short
    with pytest.raises(UserError, match=r"cannot decompress .*c\.jsonl\.gz \(gzip\)"):
        open_source(str(packed), "auto", "text")
    leftovers = list((tmp_path / "cache").rglob("*c.jsonl*"))
    assert [p.name for p in leftovers if not p.name.endswith(".lock")] == []


def test_an_unwritable_cache_names_the_setting(tmp_path, monkeypatch):
    packed = _compress(write_jsonl(tmp_path / "c.jsonl", _docs(5)), "gz")
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("CROSSDISTILL_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(UserError, match="set CROSSDISTILL_CACHE to a writable folder"):
        open_source(str(packed), "auto", "text")


def test_zstandard_is_read_or_names_its_package(tmp_path):
    docs = _docs(20)
    plain = write_jsonl(tmp_path / "c.jsonl", docs)
    path = tmp_path / "c.jsonl.zst"
    try:
        import zstandard
    except ImportError:
        path.write_bytes(b"\x28\xb5\x2f\xfd")
        with pytest.raises(UserError, match="pip install zstandard"):
            open_source(str(path), "auto", "text")
        return
    path.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    assert open_source(str(path), "auto", "text").read(0, 20) == docs

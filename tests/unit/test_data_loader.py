"""The resumable loader: kill-and-resume gives the uninterrupted stream (in-process and with
worker processes), data-parallel ranks get disjoint data, and start-up checks fail early."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from itertools import islice

import pytest
import torch

from crossdistill.alignment import TokenBytes
from crossdistill.config import DataConfig
from crossdistill.data import build_loader
from crossdistill.errors import UserError
from tests.unit.test_data_helpers import UNICODE_TEXTS, row_texts, stdlib_texts, write_jsonl


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CROSSDISTILL_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def pair(real_tokenizer):
    """A cross-tokenizer pair that loads fast: GPT-2 student, Llama-2 teacher."""
    return real_tokenizer("gpt2"), real_tokenizer("llama2")


def _corpus(tmp_path, n: int = 40, max_chars: int = 700):
    base = stdlib_texts(12, max_chars=max_chars) + UNICODE_TEXTS
    docs = [f"document {i}. {base[i % len(base)]}" for i in range(n)]
    return write_jsonl(tmp_path / "c.jsonl", docs), docs


def _flat(batch) -> list[torch.Tensor]:
    s = batch.student
    out = [s.input_ids, s.labels, s.position_ids, s.doc_ids, s.target_bytes]
    for t in batch.teachers:
        out += [t.input_ids, t.labels, t.position_ids, t.doc_ids, t.chunks, t.kd_valid]
    return out


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        fx, fy = _flat(x), _flat(y)
        assert all(p.shape == q.shape and torch.equal(p, q) for p, q in zip(fx, fy))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_kill_and_resume_gives_the_uninterrupted_stream(tmp_path, pair, num_workers):
    path, _ = _corpus(tmp_path, n=16, max_chars=200)
    cfg = DataConfig(
        train=[str(path)],
        seq_len=96,
        micro_batch_size=2,
        pad_multiple=16,
        num_workers=num_workers,
        val_fraction=0.1,
        seed=5,
    )
    tok_s, tok_t = pair
    total, cut = 14, 5  # 16 short documents: the run crosses epoch boundaries
    whole = list(islice(build_loader(cfg, tok_s, [tok_t, tok_s]), total))
    first = build_loader(cfg, tok_s, [tok_t, tok_s])
    head = list(islice(first, cut))  # islice takes no batch beyond `cut`
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    assert state["batches_yielded"] == cut and len(state["workers"]) == max(1, num_workers)
    del first
    resumed = build_loader(cfg, tok_s, [tok_t, tok_s])
    resumed.load_state_dict(state)
    tail = list(islice(resumed, total - cut))
    _assert_same(head + tail, whole)
    assert max(st["epoch"] for st in resumed.state_dict()["workers"]) >= 1


def test_resume_with_other_settings_is_refused(tmp_path, pair):
    path, _ = _corpus(tmp_path)
    cfg = DataConfig(
        train=[str(path)], seq_len=64, micro_batch_size=2, num_workers=0, val_fraction=0.0
    )
    loader = build_loader(cfg, *pair[:1], [pair[1]])
    next(iter(loader))
    state = loader.state_dict()
    other = DataConfig(
        train=[str(path)], seq_len=64, micro_batch_size=2, num_workers=3, val_fraction=0.0
    )
    with pytest.raises(UserError, match="num_workers"):
        build_loader(other, pair[0], [pair[1]]).load_state_dict(state)


def test_data_parallel_ranks_get_disjoint_documents(tmp_path, pair):
    path, docs = _corpus(tmp_path, n=24)
    tok_s = pair[0]
    tb = TokenBytes.from_tokenizer(tok_s)
    cfg = DataConfig(
        train=[str(path)], seq_len=512, micro_batch_size=1, num_workers=0, val_fraction=0.0
    )
    seen = []
    for rank in range(2):
        loader = build_loader(cfg, tok_s, [], rank=rank, world_size=2)
        text = b""
        for batch in islice(loader, 4):
            text += b"".join(row_texts(batch, None, tb)[0])
        seen.append({i for i, d in enumerate(docs) if d.encode()[:40] in text})
    assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_validation_is_repeatable_and_a_too_small_one_fails_at_start(tmp_path, pair):
    path, _ = _corpus(tmp_path)
    val = write_jsonl(tmp_path / "v.jsonl", ["A tiny held-out document."])
    cfg = DataConfig(
        train=[str(path)], validation=[str(val)], seq_len=64, micro_batch_size=2, num_workers=0
    )
    with pytest.raises(UserError, match="validation data too small"):
        build_loader(cfg, pair[0], [pair[1]], split="validation")
    cfg = DataConfig(
        train=[str(path)], seq_len=64, micro_batch_size=2, num_workers=0, val_fraction=0.2
    )
    loader = build_loader(cfg, pair[0], [pair[1]], split="validation")
    once, twice = list(loader), list(loader)
    assert len(once) >= 1
    _assert_same(once, twice)
    _assert_same(loader.take(2 * len(once) + 1), once)  # the split once, no batch repeated
    _assert_same(loader.take(2), once[:2])
    no_val = DataConfig(train=[str(path)], seq_len=64, micro_batch_size=2, val_fraction=0.0)
    with pytest.raises(UserError, match="no validation data"):
        build_loader(no_val, pair[0], [], split="validation")


def test_too_few_documents_for_the_readers_fails_at_start(tmp_path, pair):
    path = write_jsonl(tmp_path / "one.jsonl", ["just one document"])
    cfg = DataConfig(
        train=[str(path)], seq_len=32, micro_batch_size=1, num_workers=2, val_fraction=0.0
    )
    with pytest.raises(UserError, match="training data too small"):
        build_loader(cfg, pair[0], [], rank=1, world_size=2)


def test_resume_inside_a_long_document_read_in_pieces(tmp_path, pair):
    from crossdistill.data.build import build_loader as build
    from crossdistill.data.stream import StreamSpec, WorkerState, batch_stream

    long_doc = "\n".join(stdlib_texts(4, max_chars=1500, skip=1))
    path = write_jsonl(tmp_path / "long.jsonl", [long_doc, "A short one.", long_doc[::-1]])
    cfg = DataConfig(
        train=[str(path)], seq_len=80, micro_batch_size=2, num_workers=0, val_fraction=0.0
    )
    stream = build(cfg, pair[0], [pair[1]]).stream
    spec = StreamSpec(**{**stream.spec.__dict__, "piece_chars": 300})  # many pieces per document

    def run(start, n):
        return list(islice(batch_stream(stream.plan, 0, stream.sides, spec, start, True), n))

    whole = run(WorkerState(), 16)
    assert any(st.cursor.piece > 0 for _, st in whole)  # some states point inside a piece
    # pieces (~75 tokens) of one document continue its document id and positions within a
    # row (rows are 80 tokens): most rows hold a single document with positions 0..79 or
    # continuing from where they restart
    single = [
        b.student.doc_ids[r]
        for b, _ in whole
        for r in range(2)
        if bool((b.student.doc_ids[r] == 0).all())
    ]
    assert len(single) >= 16
    for b, _ in whole:
        for r in range(2):
            if bool((b.student.doc_ids[r] == 0).all()):
                assert b.student.position_ids[r].tolist() == list(range(80))
    for k in (3, 7, 11):
        _assert_same([b for b, _ in run(whole[k - 1][1], 16 - k)], [b for b, _ in whole[k:]])


def test_a_batch_is_one_buffer_and_moves_as_one(tmp_path, pair):
    from crossdistill.data.batch import _map_buffers

    path, _ = _corpus(tmp_path, n=8)
    cfg = DataConfig(
        train=[str(path)], seq_len=64, micro_batch_size=2, num_workers=0, val_fraction=0.0
    )
    batch = next(iter(build_loader(cfg, pair[0], [pair[1], pair[0]])))
    tensors = _flat(batch)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one IPC segment
    copies = []
    moved = _map_buffers(batch, lambda t: copies.append(t) or t.clone())
    assert len(copies) == 1
    for a, b in zip(tensors, _flat(moved)):
        assert a.dtype == b.dtype and torch.equal(a, b)
        assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    shared = moved.teachers[1].input_ids  # the same-tokenizer teacher still shares the buffer
    assert (
        shared.untyped_storage().data_ptr() == moved.student.input_ids.untyped_storage().data_ptr()
    )
    assert shared.storage_offset() == moved.student.input_ids.storage_offset()


class _Witness:
    """Garbage in a reference cycle whose finaliser records the process that collects it: a
    stand-in for the trainer's CUDA tensors, which abort the process that frees them if that
    is a loader worker forked from a parent that had initialised CUDA."""

    def __init__(self, log):
        self.log, self.cycle = log, self

    def __del__(self):
        with open(self.log, "a", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")


_COLLECT_IN_FORKED_CHILD = []  # while set, a forked child collects garbage at once


def _collect_in_child() -> None:
    if _COLLECT_IN_FORKED_CHILD:
        gc.collect()


os.register_at_fork(after_in_child=_collect_in_child)


def test_loader_workers_do_not_inherit_the_trainers_objects(tmp_path, pair):
    """A forked worker holds a copy of the whole parent heap and frees whatever garbage its
    collector finds there (on a GPU: CUDA tensors, fatally; seen as random worker aborts).
    Workers must start from a fresh interpreter instead. The collection that would otherwise
    happen at some random later point is run at once in a forked child."""
    path, _ = _corpus(tmp_path, n=12, max_chars=300)
    cfg = DataConfig(
        train=[str(path)], seq_len=128, micro_batch_size=2, num_workers=2, val_fraction=0.0
    )
    loader = build_loader(cfg, pair[0], [pair[1]])
    log = tmp_path / "finalised.txt"
    gc.collect()
    gc.disable()  # the witness stays uncollected here until the end
    _COLLECT_IN_FORKED_CHILD.append(True)
    try:
        _Witness(log)
        batches = iter(loader)
        for _ in range(2):
            next(batches)
        del batches
    finally:
        _COLLECT_IN_FORKED_CHILD.clear()
        gc.enable()
    gc.collect()
    pids = log.read_text().split()
    assert pids == [str(os.getpid())], f"parent {os.getpid()}, collected in {pids}"


def test_validation_batches_do_not_depend_on_workers_or_ranks(tmp_path, pair):
    """The same held-out documents packed the same way, whatever `num_workers` and the number
    of data-parallel ranks: rank r of D takes batches r, r + D, ... of the first N, and every
    rank gets as many batches (padding where the split runs out), for the collectives."""
    path, _ = _corpus(tmp_path, n=40)

    def cfg(workers: int) -> DataConfig:
        return DataConfig(
            train=[str(path)], seq_len=64, micro_batch_size=2, num_workers=workers,
            val_fraction=0.3, seed=3,
        )  # fmt: skip

    one = build_loader(cfg(0), pair[0], [pair[1]], split="validation").take(7)
    assert len(one) == 7
    for workers in (1, 2, 4):
        _assert_same(
            build_loader(cfg(workers), pair[0], [pair[1]], split="validation").take(7), one
        )
    for size in (2, 3):
        shares = [
            build_loader(cfg(2), pair[0], [pair[1]], "validation", rank=r, world_size=size).take(7)
            for r in range(size)
        ]
        assert {len(x) for x in shares} == {-(-7 // size)}
        _assert_same([shares[j % size][j // size] for j in range(7)], one)
        for r in range(7 % size, size):  # the ranks short of a batch: one of padding
            pad = shares[r][-1].student
            assert bool((pad.doc_ids < 0).all()) and int((pad.labels >= 0).sum()) == 0


# a program whose loader workers cannot start: each spawned worker runs the program's top level
# as it starts (as `__mp_main__`), and here that exits, as when the script was moved or edited
# while it ran, or a worker is killed at start
_WORKERS_DIE_AT_START = """
    import multiprocessing, sys
    if multiprocessing.parent_process() is not None:
        raise SystemExit(3)
    from crossdistill.config import DataConfig
    from crossdistill.data import build_loader
    from crossdistill.models import load_tokenizer

    corpus, student, teacher = sys.argv[1:]
    cfg = DataConfig(train=[corpus], seq_len=64, micro_batch_size=2, num_workers=2, val_fraction=0.0)
    loader = build_loader(cfg, load_tokenizer(student), [load_tokenizer(teacher)])
    next(iter(loader))
"""


def test_workers_that_cannot_start_fail_the_loader_instead_of_hanging(tmp_path, tokenizer_dir):
    """The stream pickles to megabytes (the tokenizers); sent whole to a worker that died
    before reading it, it blocked the trainer for good inside `Process.start`. Now the loader
    fails within seconds, names the dead workers, and leaves no file behind."""
    path, _ = _corpus(tmp_path)
    script = tmp_path / "workers_die.py"
    script.write_text(textwrap.dedent(_WORKERS_DIE_AT_START))
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    args = [str(path), str(tokenizer_dir("gpt2")), str(tokenizer_dir("llama2"))]
    try:
        done = subprocess.run(
            [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120,
            env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the loader hung on workers that could not start")
    assert done.returncode != 0
    assert "exited unexpectedly" in done.stderr, done.stderr[-2000:]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_the_workers_stream_file_is_gone_once_every_worker_has_answered(
    tmp_path, monkeypatch, pair
):
    """The file each worker reads its stream from is deleted by the loader's n-th batch, so a
    run killed later (SIGKILL skips every `finally`) leaves nothing in the temp folder."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    path, _ = _corpus(tmp_path)
    cfg = DataConfig(train=[str(path)], seq_len=64, micro_batch_size=2, num_workers=2)
    batches = iter(build_loader(cfg, pair[0], [pair[1]]))
    first = next(batches)
    assert [f.name.startswith("crossdistill-stream-") for f in folder.iterdir()] == [True]
    assert first.student.input_ids.shape == (2, 64)
    next(batches)
    assert list(folder.iterdir()) == []
    assert all(b.student.input_ids.shape == (2, 64) for b in islice(batches, 6))


def test_a_loader_removes_the_stream_files_of_processes_that_are_gone(tmp_path, monkeypatch, pair):
    """A run killed while its workers start leaves its stream file; the next loader on the
    machine deletes the old files of writers no longer running, and keeps a running one's and
    any written within the hour."""
    from crossdistill.data.loader import STALE_STREAM_S, STREAM_PREFIX

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its process id names no process now
    stale = folder / f"{STREAM_PREFIX}{gone.pid}-abc.pkl"
    recent = folder / f"{STREAM_PREFIX}{gone.pid}-new.pkl"  # perhaps a writer it cannot see
    live = folder / f"{STREAM_PREFIX}{os.getppid()}-def.pkl"
    unnamed = folder / f"{STREAM_PREFIX}abc.pkl"  # an older name, without a process id
    other = folder / "notes.pkl"
    hours_ago = time.time() - 2 * STALE_STREAM_S
    for f in (stale, recent, live, unnamed, other):
        f.write_bytes(b"x")
        if f is not recent:
            os.utime(f, (hours_ago, hours_ago))
    path, _ = _corpus(tmp_path)
    cfg = DataConfig(train=[str(path)], seq_len=64, micro_batch_size=2, num_workers=1)
    batches = iter(build_loader(cfg, pair[0], [pair[1]]))
    assert next(batches).student.input_ids.shape == (2, 64)
    assert not stale.exists()
    assert recent.exists() and live.exists() and unnamed.exists() and other.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_workers_survive_cuda_garbage_in_the_trainer(tmp_path, pair):
    """On a GPU: CUDA tensors left in garbage cycles while 4 workers pack batches, as a
    trainer leaves them; every batch arrives and no worker aborts."""
    path, _ = _corpus(tmp_path, n=80, max_chars=1500)
    cfg = DataConfig(
        train=[str(path)], seq_len=128, micro_batch_size=2, num_workers=4, val_fraction=0.2
    )
    loader = build_loader(cfg, pair[0], [pair[1]])
    held_out = build_loader(cfg, pair[0], [pair[1]], split="validation")
    batches = iter(loader)
    for step in range(200):
        for _ in range(20):
            _Witness(tmp_path / "gc.txt").tensor = torch.ones(64, device="cuda")
        batch = next(batches).to("cuda", non_blocking=True)
        assert batch.student.input_ids.is_cuda
        if step % 50 == 0:
            assert len(held_out.take(2)) == 2
    torch.cuda.synchronize()

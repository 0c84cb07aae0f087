"""The teacher cache: the record format against its inputs, the build on tiny checkpoints, and
training from a cache against training with the live teacher (CPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from crossdistill.config import Config
from crossdistill.data.teacher_cache import (
    SHARDS,
    CacheReader,
    DocTargets,
    decode_record,
    encode_record,
    read_footer,
)
from crossdistill.errors import UserError
from crossdistill.models import build_causal_lm, load_tokenizer
from crossdistill.train.cache_build import BuildOptions, build_cache, windows
from crossdistill.train.loop import train
from crossdistill.train.metrics import read_metrics
from crossdistill.train.teacher_cache import inspect_cache
from tests.unit.test_train import _cfg as train_cfg

OPTS = BuildOptions(quantization="none", progress=False)


def _random_targets(n: int, k: int, vocab: int, seed: int) -> DocTargets:
    g = np.random.default_rng(seed)
    logits = g.normal(size=(n, vocab)) * 3
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ids = np.argsort(-logp, axis=1)[:, :k]
    top = np.take_along_axis(logp, ids, axis=1)
    tail = np.log1p(-np.exp(top).sum(1))
    return DocTargets(
        g.integers(0, vocab, n),
        g.integers(0, 9, n),
        g.normal(size=n).astype(np.float32) - 3,
        ids.astype(np.int32),
        top.astype(np.float32),
        tail.astype(np.float32),
    )


def test_records_round_trip_exactly_unquantised_and_within_steps_quantised():
    t = _random_targets(37, 8, 3000, 0)
    blob, raw = encode_record(t, "none")
    back = decode_record(blob, raw, 37, 8, "none")
    for f in dataclasses.fields(DocTargets):
        np.testing.assert_array_equal(getattr(back, f.name), getattr(t, f.name))
    blob, raw = encode_record(t, "int8")
    q = decode_record(blob, raw, 37, 8, "int8")
    np.testing.assert_array_equal(q.ids, t.ids)
    np.testing.assert_array_equal(q.text_bytes, t.text_bytes)
    # the same ids by descending (quantised) log-prob, each within half a step plus the
    # renormalisation (values that round to one step may change places)
    assert np.array_equal(np.sort(q.topk_ids, 1), np.sort(t.topk_ids, 1))
    assert np.all(np.diff(q.topk_logprobs, axis=1) <= 0)
    mass = np.exp(q.topk_logprobs).sum(1) + np.exp(q.tail_logprob)
    np.testing.assert_allclose(mass, 1.0, rtol=1e-5)
    ref = np.take_along_axis(t.topk_logprobs, np.argsort(t.topk_ids, 1), 1)
    got = np.take_along_axis(q.topk_logprobs, np.argsort(q.topk_ids, 1), 1)
    assert np.abs(got - ref).max() < 0.15
    np.testing.assert_allclose(q.next_logprobs, t.next_logprobs, atol=3e-3)
    assert np.isfinite(q.topk_logprobs).all() and np.isfinite(q.tail_logprob).all()


def test_windows_cover_every_position_once_with_context():
    for n, c in [(5, 16), (16, 16), (17, 16), (100, 16), (1000, 64)]:
        ws = windows(n, c)
        kept = np.concatenate([np.arange(a, b) for _, _, a, b in ws])
        np.testing.assert_array_equal(kept, np.arange(n))
        for i, (s, e, a, b) in enumerate(ws):
            assert e - s <= c and s <= a < b <= e
            assert b < e or e == n  # a kept position's next token is in its window
            if i:
                assert a - s >= c // 4


# ---------------------------------------------------------------- tiny checkpoints


WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "and",
    "ran",
    "to",
    "big",
    "red",
    "old",
    "new",
    "man",
    "car",
    "sun",
]
DOC_TOKENS = 15  # GPT-2: start (its end-of-text), 12 words, ".", end of document


def write_corpus(folder: Path, gpt2) -> Path:
    """Documents of exactly DOC_TOKENS student tokens, so that rows of 2·DOC_TOKENS hold two
    whole documents each: no document is cut by packing, and a live teacher sees every
    document whole, as the cache's teacher does."""
    g = np.random.default_rng(0)
    texts = [" ".join(g.permutation(WORDS)[:12]) + "." for _ in range(80)]
    assert all(len(gpt2.encode(t)) == DOC_TOKENS - 2 for t in texts)
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", texts[:64]), ("val.jsonl", texts[64:])):
        (folder / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, real_tokenizer) -> Path:
    return write_corpus(tmp_path_factory.mktemp("cache_corpus"), real_tokenizer("gpt2"))


def _checkpoint(folder: Path, tokenizer: Path, vocab: int, seed: int) -> Path:
    """A tiny teacher whose predictions are far from uniform (large initial weights), so that
    its top-k order is not decided by rounding."""
    model = build_causal_lm(
        arch="tiny-qwen3",
        overrides={
            "vocab_size": vocab,
            "hidden_size": 32,
            "intermediate_size": 64,
            "initializer_range": 0.5,
        },
        seed=seed,
    )
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(str(tokenizer)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("teachers")
    return {
        "llama2": _checkpoint(d / "llama2", tokenizer_dir("llama2"), 32000, 1),
        "gpt2": _checkpoint(d / "gpt2", tokenizer_dir("gpt2"), 50304, 2),
    }


def _cfg(corpus: Path, out: Path, tokenizer_dir, teachers: list[dict], **train) -> Config:
    """The trainer tests' run, with rows of two whole documents."""
    cfg = train_cfg(corpus, out, tokenizer_dir, teachers, **train)
    cfg.data.seq_len = 2 * DOC_TOKENS
    return cfg


def _teachers(checkpoints, **cache) -> list[dict]:
    # the target named, not `auto`: on this text Llama-2 is between near and far for the
    # student, where `auto` takes lookahead_split
    base = {"dtype": "float32", "top_k": 16, "target": "first_piece"}
    return [
        {"name": "llama2", "path": str(checkpoints["llama2"]), "loss": "forward_kl", **base},
        {"name": "gpt2", "path": str(checkpoints["gpt2"]), "loss": "jsd", "weight": 0.5, **base},
    ]


def _metrics(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r or "val/loss/ce" in r]


def assert_same_metrics(live: Path, cached: Path, keys: tuple[str, ...], least: int) -> None:
    """The two runs logged more than `least` records, equal on `keys` wherever logged."""
    a, b = _metrics(live), _metrics(cached)
    assert len(a) == len(b) > least
    for ra, rb in zip(a, b):
        for key in keys:
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], rel=2e-5, abs=1e-6), key


@pytest.fixture(scope="module")
def built(corpus, checkpoints, tokenizer_dir, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("caches")
    cfg = _cfg(corpus, out / "run", tokenizer_dir, _teachers(checkpoints))
    build_cache(cfg, {0: out / "llama2", 1: out / "gpt2"}, OPTS)
    return {"llama2": out / "llama2", "gpt2": out / "gpt2"}


def test_build_writes_every_document_once_with_the_live_teachers_numbers(
    built, corpus, tokenizer_dir, tmp_path
):
    info = inspect_cache(built["llama2"])
    texts = [(corpus / f"{f}.jsonl").read_text().splitlines() for f in ("train", "val")]
    distinct = len({json.loads(line)["text"] for lines in texts for line in lines})
    assert info["documents"] == distinct and not info["damaged_shards"]
    assert info["quantization"] == "none" and info["top_k"] == 16
    assert 0 < info["teacher_bpb"] < 40 and info["bytes_per_token"] > 0
    reader = CacheReader(built["llama2"])
    doc = reader.get(next(iter(reader.index)))
    assert doc.topk_ids.shape == (doc.num_tokens, 16)
    assert np.isfinite(doc.topk_logprobs).all() and (doc.next_logprobs[:-1] < 0).all()


def test_training_from_the_cache_equals_training_with_the_live_teachers(
    built, corpus, checkpoints, tokenizer_dir, tmp_path
):
    live = _cfg(corpus, tmp_path / "live", tokenizer_dir, _teachers(checkpoints))
    final_live = train(live)
    teachers = _teachers(checkpoints)
    for t in teachers:
        t["cache"] = str(built[t["name"]])  # path kept: checked against the cache
    cached = _cfg(corpus, tmp_path / "cached", tokenizer_dir, teachers)
    final_cached = train(cached)
    a, b = _metrics(tmp_path / "live"), _metrics(tmp_path / "cached")
    assert len(a) == len(b) > 4
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if isinstance(value, float) and not key.startswith(
                ("time", "throughput", "tokens_per")
            ):
                assert rb[key] == pytest.approx(value, rel=2e-5, abs=1e-6), key
    for key in final_live:
        assert final_cached[key] == pytest.approx(final_live[key], rel=2e-5, abs=1e-6), key
    # one cached and one live teacher in one run, and a resume from the cache
    mixed = _teachers(checkpoints)
    mixed[0]["cache"] = str(built["llama2"])
    part = _cfg(corpus, tmp_path / "part", tokenizer_dir, mixed)
    train(part, stop_after=3)
    resumed = train(part, resume=True)
    for key in final_live:
        assert resumed[key] == pytest.approx(final_live[key], rel=2e-5, abs=1e-6), key


@pytest.fixture(scope="module")
def first_piece_run(corpus, checkpoints, tokenizer_dir, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("first_piece")
    return train(_cfg(corpus, out, tokenizer_dir, _teachers(checkpoints)))


@pytest.mark.parametrize("target", ["auto", "lookahead_mix"])
def test_a_lookahead_target_reads_the_same_rows_from_the_cache_as_from_the_live_teacher(
    built, corpus, checkpoints, tokenizer_dir, tmp_path, first_piece_run, target
):
    """The lookahead targets read the teacher's top-k at several rows per chunk, and past the
    end the row after it: the cache holds every position's, so training from it equals
    training with the live teacher step for step. `auto` takes `lookahead_split` for this
    pair either way; `lookahead_mix` lays out its two parts from the same rows. (Every word of
    this corpus is one token on both sides, so the rows read are the KD row and the one past
    the end.)"""
    teachers = _teachers(checkpoints)
    teachers[0]["target"] = target
    live = train(_cfg(corpus, tmp_path / "live", tokenizer_dir, teachers))
    for t in teachers:
        t["cache"] = str(built[t["name"]])
    cached = train(_cfg(corpus, tmp_path / "cached", tokenizer_dir, teachers))
    keys = ("loss", "loss/kd/llama2", "val/loss/kd/llama2")
    assert_same_metrics(tmp_path / "live", tmp_path / "cached", keys, least=4)
    for key in live:
        assert cached[key] == pytest.approx(live[key], rel=2e-5, abs=1e-6), key
    assert abs(first_piece_run["val/loss/kd/llama2"] - live["val/loss/kd/llama2"]) > 1e-4


def test_mismatches_are_refused_before_training(
    built, corpus, checkpoints, tokenizer_dir, tmp_path, caplog
):
    def run(**change):
        teachers = _teachers(checkpoints)
        teachers[0].update({"cache": str(built["llama2"]), **change})
        return train(_cfg(corpus, tmp_path / "x", tokenizer_dir, teachers, steps=1))

    with pytest.raises(UserError, match="fewer than teachers.0.top_k"):
        run(top_k=32)
    with pytest.raises(UserError, match="temperature"):
        run(temperature=2.0)
    with pytest.raises(UserError, match="another teacher"):
        run(path=str(checkpoints["gpt2"]))
    with pytest.raises(UserError, match="another tokenizer"):
        run(tokenizer=str(tokenizer_dir("mistral")))
    with pytest.raises(UserError, match="not a teacher cache"):
        run(cache=str(tmp_path))
    import shutil

    old = tmp_path / "old"
    shutil.copytree(built["llama2"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "format": 0}))
    with pytest.raises(UserError, match="has format 0.*rebuild it"):
        run(cache=str(old))
    # a document the cache lacks: an error naming it, or skipped and counted
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"text": "a document the cache has never seen"}) + "\n")
    teachers = _teachers(checkpoints)
    teachers[0]["cache"] = str(built["llama2"])
    cfg = _cfg(corpus, tmp_path / "y", tokenizer_dir, teachers, steps=1)
    cfg.data.train.append(str(extra))
    cfg.data.bad_input = "error"
    with pytest.raises(UserError, match="extra.jsonl:1: not in teacher llama2's cache"):
        train(cfg)
    cfg.data.bad_input = "skip"
    cfg.run.out_dir = str(tmp_path / "z")
    cfg.train.steps = 20  # long enough to meet the extra document
    with caplog.at_level("WARNING"):
        train(cfg)
    assert "not in teacher llama2's cache" in caplog.text


def test_a_smaller_top_k_is_read_from_a_larger_cache(
    built, corpus, checkpoints, tokenizer_dir, tmp_path
):
    teachers = _teachers(checkpoints)
    for t in teachers:
        t["top_k"] = 8
    live = train(_cfg(corpus, tmp_path / "live", tokenizer_dir, teachers, steps=2))
    for t in teachers:
        t["cache"] = str(built[t["name"]])
    cached = train(_cfg(corpus, tmp_path / "cached", tokenizer_dir, teachers, steps=2))
    for key in live:
        assert cached[key] == pytest.approx(live[key], rel=2e-5, abs=1e-6), key


def test_damaged_and_partial_shards_are_named_never_read(built, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(built["llama2"], copy)
    shard = next((copy / SHARDS).glob("*.cdc"))
    footer = read_footer(shard)
    key, off = footer["records"][0][0], footer["records"][0][1]
    data = bytearray(shard.read_bytes())
    data[off] ^= 0xFF
    shard.write_bytes(bytes(data))
    reader = CacheReader(copy)
    with pytest.raises(UserError, match=f"{shard}.*damaged"):
        reader.get(key)
    assert inspect_cache(copy)["damaged_shards"] == [shard.name]
    shard.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(UserError, match=f"{shard}.*damaged"):
        _ = CacheReader(copy).index


def test_a_killed_build_resumes_and_ends_with_the_same_cache(
    built, corpus, checkpoints, tokenizer_dir, tmp_path, monkeypatch
):
    cfg = _cfg(corpus, tmp_path / "run", tokenizer_dir, _teachers(checkpoints))
    small = dataclasses.replace(OPTS, batch_tokens=200, shard_bytes=1)  # a shard per forward
    import crossdistill.train.cache_build as tc

    real, calls = tc._run, {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(tc, "_run", dying)
    with pytest.raises(KeyboardInterrupt):
        build_cache(cfg, {0: tmp_path / "c"}, small)
    monkeypatch.setattr(tc, "_run", real)
    shards = list((tmp_path / "c" / SHARDS).glob("*.cdc"))
    assert shards and not (tmp_path / "c" / "manifest.json").exists()
    assert not list((tmp_path / "c" / SHARDS).glob(".*"))  # no partial shard left behind
    build_cache(cfg, {0: tmp_path / "c"}, small)
    a, b = CacheReader(tmp_path / "c"), CacheReader(built["llama2"])
    assert set(a.index) == set(b.index)
    for key in b.index:
        x, y = a.get(key), b.get(key)
        for f in dataclasses.fields(DocTargets):
            np.testing.assert_allclose(getattr(x, f.name), getattr(y, f.name), rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="other settings"):
        build_cache(cfg, {0: tmp_path / "c"}, dataclasses.replace(small, quantization="int8"))


def test_a_full_disk_is_one_clear_error_and_earlier_shards_stay(tmp_path):
    from crossdistill.data.teacher_cache import ShardWriter

    w = ShardWriter(tmp_path / "a.cdc")
    w.add("k", b"xyz", 3, 1, 0.0, 0)
    w.close()

    class FullDisk:  # what a write to a full filesystem raises
        def write(self, _data):
            raise OSError(28, "No space left on device")

        def close(self):
            pass

    w2 = ShardWriter(tmp_path / "b.cdc")
    w2._file.close()
    w2._file = FullDisk()
    with pytest.raises(UserError, match="disk full.*b.cdc.*run the same"):
        w2.add("k2", b"abc", 3, 1, 0.0, 0)
    assert (tmp_path / "a.cdc").exists() and not (tmp_path / "b.cdc").exists()
    assert not list(tmp_path.glob(".b.cdc*"))
    assert read_footer(tmp_path / "a.cdc")["records"][0][0] == "k"


@pytest.mark.parametrize("mode", ["dynamic", "best"])
def test_teacher_modes_read_the_cache_as_they_read_live_teachers(
    built, corpus, checkpoints, tokenizer_dir, tmp_path, mode
):
    teachers = _teachers(checkpoints)
    live = train(_cfg(corpus, tmp_path / "live", tokenizer_dir, teachers, teacher_mode=mode))
    for t in teachers:
        t["cache"] = str(built[t["name"]])
    cfg = _cfg(corpus, tmp_path / "cached", tokenizer_dir, teachers, teacher_mode=mode)
    cached = train(cfg)
    for key in live:
        assert cached[key] == pytest.approx(live[key], rel=2e-5, abs=1e-6), key


def test_a_quantised_cache_trains_within_one_percent_of_the_live_teachers(
    corpus, checkpoints, tokenizer_dir, tmp_path
):
    teachers = _teachers(checkpoints)
    cfg = _cfg(corpus, tmp_path / "live", tokenizer_dir, teachers)
    folders = {0: tmp_path / "q0", 1: tmp_path / "q1"}
    build_cache(cfg, folders, dataclasses.replace(OPTS, quantization="int8"))
    info = inspect_cache(folders[0])
    assert info["quantization"] == "int8"
    live = train(cfg)
    for i, t in enumerate(teachers):
        t["cache"] = str(folders[i])
    cached = train(_cfg(corpus, tmp_path / "cached", tokenizer_dir, teachers))
    a, b = _metrics(tmp_path / "live"), _metrics(tmp_path / "cached")
    for ra, rb in zip(a, b):
        if "loss" in ra:
            assert rb["loss"] == pytest.approx(ra["loss"], rel=0.01)
    for key in ("val/loss/kd/llama2", "val/loss/kd/gpt2", "val/bpb/student"):
        assert cached[key] == pytest.approx(live[key], rel=0.01), key


def test_the_record_index_finds_every_key_and_only_those():
    from crossdistill.data.teacher_cache import RecordIndex

    g = np.random.default_rng(3)
    keys = [bytes(g.integers(0, 256, 16, dtype=np.uint8)).hex() for _ in range(500)]
    keys += ["ab" * 15 + "00", "00" * 16]  # numpy's byte strings drop trailing NULs
    shards = [(s, [[k, i, 1, 2, 3, 4] for i, k in enumerate(keys) if i % 3 == s]) for s in range(3)]
    index = RecordIndex(shards)
    assert len(index) == len(keys) and sorted(index) == sorted(keys)
    for i, k in enumerate(keys):
        assert k in index and index[k] == (i % 3, i, 1, 2, 3, 4)
    assert "ab" * 15 + "01" not in index and "ff" * 16 not in index

"""A teacher cache built by two gloo processes (the documents dealt out over the ranks, each
writing its own shards, rank 0 the manifest) holds what a one-process build holds, and a run
of two data-parallel ranks trains from it as from the live teacher."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.distributed import _harness as h
from tests.unit.test_teacher_cache import (
    OPTS,
    _cfg,
    _checkpoint,
    _teachers,
    assert_same_metrics,
    write_corpus,
)

pytestmark = pytest.mark.distributed


def build_worker(rank: int, cfg, folder: str) -> None:
    from crossdistill.train.cache_build import build_cache

    build_cache(cfg, {0: Path(folder)}, OPTS)


def train_worker(rank: int, cfg) -> None:
    from crossdistill.train.loop import train

    train(cfg)


def test_two_ranks_build_the_cache_one_process_builds(tmp_path, tokenizer_dir, real_tokenizer):
    from crossdistill.data.teacher_cache import SHARDS, CacheReader, DocTargets
    from crossdistill.train.cache_build import build_cache

    corpus = write_corpus(tmp_path / "data", real_tokenizer("gpt2"))
    checkpoints = {
        "llama2": _checkpoint(tmp_path / "llama2", tokenizer_dir("llama2"), 32000, 1),
        "gpt2": _checkpoint(tmp_path / "gpt2", tokenizer_dir("gpt2"), 50304, 2),
    }
    cfg = _cfg(corpus, tmp_path / "run", tokenizer_dir, _teachers(checkpoints)[:1])
    build_cache(cfg, {0: tmp_path / "one"}, OPTS)
    h.spawn(build_worker, 2, cfg, str(tmp_path / "two"), errors=tmp_path / "e")
    one, two = CacheReader(tmp_path / "one"), CacheReader(tmp_path / "two")
    ranks = {p.name[:4] for p in (tmp_path / "two" / SHARDS).glob("*.cdc")}
    assert ranks == {"r000", "r001"}  # each rank wrote its own share
    assert set(one.index) == set(two.index)
    assert two.manifest["docs"] == one.manifest["docs"]
    for key in one.index:
        a, b = one.get(key), two.get(key)
        for f in dataclasses.fields(DocTargets):
            np.testing.assert_allclose(getattr(a, f.name), getattr(b, f.name), rtol=1e-5, atol=1e-5)
    # two data-parallel ranks train from the cache as they do with the live teacher, under the
    # target `auto` takes for this pair (lookahead_prefix_end: four rows per chunk)
    cfg.teachers[0].target = "auto"
    live = copy.deepcopy(cfg)
    live.run.out_dir = str(tmp_path / "live")
    cached = copy.deepcopy(cfg)
    cached.run.out_dir = str(tmp_path / "cached")
    cached.teachers[0].cache = str(tmp_path / "two")
    for c in (live, cached):
        h.spawn(train_worker, 2, c, errors=tmp_path / "e2")
    keys = ("loss", "val/loss/kd/llama2", "val/bpb/teacher")
    assert_same_metrics(tmp_path / "live", tmp_path / "cached", keys, least=2)

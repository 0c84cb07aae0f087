"""The multi-process harness itself: its workers fork from a server that preloaded torch, so what a
fresh process would get they must get too: the caller's environment as it is at each spawn, their
own rank variables, what they print on the caller's descriptors, and a failure that reaches the
caller with the worker's traceback."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.distributed import _harness as h

pytestmark = pytest.mark.distributed
VARIABLE = "CROSSDISTILL_TEST_SPAWN"


def _report(rank: int, out: str) -> None:
    keys = (VARIABLE, "RANK", "WORLD_SIZE")
    Path(out, f"{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def _say(rank: int, word: str) -> None:
    print(f"{word} out {rank}", flush=True)
    print(f"{word} err {rank}", file=sys.stderr, flush=True)
    os.write(2, f"{word} fd {rank}\n".encode())  # as a C library writes


def _reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def test_workers_see_the_environment_of_each_spawn(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.setenv(VARIABLE, "before")
    h.spawn(_report, 2, str(first), errors=tmp_path / "e1", group=False)
    # the fork server runs from the first spawn on (this one, or an earlier test's): a variable
    # changed after it started must still reach the next workers
    monkeypatch.setenv(VARIABLE, "after")
    h.spawn(_report, 3, str(second), errors=tmp_path / "e2", group=False)
    one, two = _reports(first, 2), _reports(second, 3)
    assert [r[VARIABLE] for r in one] == ["before"] * 2
    assert [r[VARIABLE] for r in two] == ["after"] * 3
    assert [r["RANK"] for r in two] == ["0", "1", "2"] and {r["WORLD_SIZE"] for r in two} == {"3"}


def test_what_workers_print_reaches_the_callers_output_at_each_spawn(tmp_path, capfd):
    # a worker's descriptors are the fork server's, which are those of the first spawn's caller:
    # here a spawn outside this test's capture (if no earlier test started the server), then two
    # under it, whose output must reach it
    with capfd.disabled():
        h.spawn(_report, 1, str(tmp_path), errors=tmp_path / "before", group=False)
    for word in ("first", "second"):
        h.spawn(_say, 2, word, errors=tmp_path / word, group=False)
        got = capfd.readouterr()
        assert got.out.splitlines() == [f"{word} out 0", f"{word} out 1"]
        assert got.err.splitlines() == [f"{word} {k} {r}" for r in (0, 1) for k in ("err", "fd")]
    assert not list((tmp_path / "second").iterdir())


def test_a_failing_worker_fails_the_caller_with_its_traceback(tmp_path):
    with pytest.raises(AssertionError, match="rank one refuses") as info:
        h.spawn(_fail, 2, errors=tmp_path / "errors", group=False)
    assert "ValueError" in str(info.value)

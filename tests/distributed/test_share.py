"""Teacher work shared among ranks that read the same batch (`distributed/share.py`), on two
gloo processes: each rank computes its share of the window's micro-batches for a teacher that
runs whole on it, every rank ends with every target exactly, a teacher marked otherwise (its
targets read or computed jointly elsewhere) and an uneven window are computed on every rank."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.distributed import _harness as h

pytestmark = pytest.mark.distributed
TEACHERS = 2  # teacher 0 runs whole on each rank (shared); teacher 1 does not


def _targets(i: int, k: int):
    """Targets of micro-batch i, teacher k: sizes and values that tell them apart."""
    from crossdistill.losses.targets import TeacherTargets

    g = torch.Generator().manual_seed(100 * i + k)
    m, n, top = 3 + i, 5 + 2 * i, 4
    return TeacherTargets(
        topk_ids=torch.randint(0, 1000, (m, top), generator=g, dtype=torch.int32),
        topk_logprobs=-torch.rand(m, top, generator=g),
        tail_logprob=-torch.rand(m, generator=g),
        next_logprobs=-torch.rand(n, generator=g),
        next_valid=torch.rand(n, generator=g) > 0.3,
        temperature=1.5,
    )


def _batch(i: int):  # what the receiver sizes a payload from: M chunks, N_t labels
    return SimpleNamespace(
        chunks=torch.zeros(3 + i, 4, dtype=torch.long), labels=torch.zeros(5 + 2 * i)
    )


def _share_worker(rank: int, out: str) -> None:
    import torch.distributed as dist

    from crossdistill.distributed.share import share_window_targets

    results = {}
    for n in (4, 3):  # a window the two ranks split, and one they do not
        calls: list[tuple[int, int]] = []

        def compute(i: int, k: int, calls: list = calls):
            calls.append((i, k))
            return _targets(i, k)

        batches = [[_batch(i)] * TEACHERS for i in range(n)]
        got = share_window_targets(batches, [True, False], compute, dist.group.WORLD, rank, 2)
        fields = ("topk_ids", "topk_logprobs", "tail_logprob", "next_logprobs", "next_valid")
        got = [
            [{f: getattr(t, f).clone() for f in fields} | {"t": t.temperature} for t in row]
            for row in got
        ]
        results[n] = {"calls": calls, "got": got}
    torch.save(results, f"{out}/rank{rank}.pt")


def test_ranks_share_a_teachers_window_and_all_get_every_target(tmp_path):
    h.spawn(_share_worker, 2, str(tmp_path), errors=tmp_path / "errors")
    for rank in (0, 1):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        split = results[4]["calls"]
        assert sorted(i for i, k in split if k == 0) == [rank, rank + 2]  # its share only
        assert sorted(i for i, k in split if k == 1) == [0, 1, 2, 3]  # not shared: all
        uneven = results[3]["calls"]
        assert sorted(uneven) == sorted((i, k) for i in range(3) for k in range(TEACHERS))
        for n in (4, 3):
            for i, row in enumerate(results[n]["got"]):
                for k, got in enumerate(row):
                    want = _targets(i, k)
                    assert got["t"] == want.temperature
                    for f in ("topk_ids", "topk_logprobs", "tail_logprob", "next_logprobs"):
                        a, b = got[f], getattr(want, f)
                        assert a.dtype == b.dtype and torch.equal(a, b), (rank, n, i, k, f)
                    assert torch.equal(got["next_valid"].bool(), want.next_valid)

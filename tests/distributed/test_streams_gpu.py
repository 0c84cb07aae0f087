"""Separate teachers on one GPU: two processes share it, and the targets travel as CUDA IPC
handles (the student copies the teacher's buffer on the GPU) instead of through host memory.

- the link: both processes find each other as IPC peers at start; buffers of many sizes, sent
  and dropped by the sender at once while it keeps allocating and overwriting memory, arrive
  intact (the cross-process reference count keeps them alive until the receiver's copy);
- the trainer: the `_harness` scenario on the GPU with the qwen teacher separate gives the
  colocated run's losses and held-out metrics to 1e-5, over IPC and over host memory
  (`train.teacher_link: host`), each run saying at start which way its targets travel.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import _harness as h
from tests.distributed.test_streams import _assert_same, _metrics, _train_worker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SIZES = [1, 7, 4096, 1 << 20, 3 << 20, 123_457, 8 << 20]


@pytest.fixture(autouse=True)
def one_gpu(monkeypatch):
    """The workers see one GPU, so that both processes share it (on a machine with several)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def _payload(i: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _link_worker(rank: int, results: str) -> None:
    import torch.distributed as dist

    from crossdistill.distributed.streams import init_roles, wait

    env = init_roles("cuda", (1,))
    link, peer = env.link, 1 - rank
    assert link.ipc == frozenset({peer}), link.ipc
    deadline = time.monotonic() + 60
    if rank == 1:  # the teacher: sends, then frees and overwrites its memory at once
        for i, n in enumerate(SIZES * 3):
            buf = _payload(i, n).cuda()
            work, _ = link.isend(buf, 0, "student")
            wait(work, deadline, "student")
            del buf, work
            torch.full((n,), 255, dtype=torch.uint8, device="cuda")  # reuses the freed block
    else:
        for i, n in enumerate(SIZES * 3):
            got = link.recv(n, 1, deadline, "teacher")
            time.sleep(0.01)  # the sender has freed its buffer by now
            assert torch.equal(got.cpu(), _payload(i, n)), (i, n)
        Path(results).write_text("ok")
    dist.destroy_process_group()


def test_processes_on_one_gpu_exchange_buffers_by_ipc(tmp_path):
    results = tmp_path / "result.txt"
    h.spawn(_link_worker, 2, str(results), errors=tmp_path / "errors", group=False)
    assert results.read_text() == "ok"


def test_a_separate_teacher_on_the_same_gpu_gives_the_colocated_run(tmp_path, tokenizer_dir, capfd):
    cfg = h.trainer_config(tmp_path, tokenizer_dir, 4, eval_every=2)
    cfg.train.device, cfg.train.teacher_timeout_s = "cuda", 120.0
    runs, said = {}, {}
    for name, processes, link in (
        ("colocated", 1, "auto"),
        ("ipc", 2, "auto"),
        ("host", 2, "host"),
    ):
        c = copy.deepcopy(cfg)
        c.run.out_dir = str(tmp_path / name)
        c.train.teacher_link = link
        if processes > 1:
            c.teachers[0].placement = "separate"
        h.spawn(_train_worker, processes, c, None, errors=tmp_path / f"e-{name}", group=False)
        runs[name] = _metrics(Path(c.run.out_dir))
        said[name] = capfd.readouterr().err  # the workers' log (stderr)
    assert "targets from rank 1 of the job over CUDA IPC" in said["ipc"]
    assert "over gloo through host memory" in said["host"]
    assert len(runs["colocated"]) >= 4
    _assert_same(runs["ipc"], runs["colocated"], "separate over CUDA IPC")
    _assert_same(runs["host"], runs["colocated"], "separate through host memory")

"""Checkpoints (one DCP-based format for every layout; these tests run the one-rank case, the
gloo tests in tests/distributed the others): exact resume, atomic layout, pruning, refusal of
non-finite models, and survival of runs killed mid-save (a real SIGKILL, leftover temp folders,
damaged files), in the loop and in the background."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from crossdistill.errors import UserError
from crossdistill.models import build_causal_lm
from crossdistill.train.checkpoint import (
    CHECKPOINTS_DIR,
    DCP_DIR,
    LATEST_MARKER,
    META_FILE,
    Checkpointer,
    NonFiniteStateError,
    capture_rng_state,
    check_writable,
    load_latest,
    read_checkpoint,
    restore_rng_state,
)

REPO = Path(__file__).resolve().parents[2]


def _small_state(step: int, value: float = 1.0) -> dict:
    return {
        "model": {"w": torch.full((4, 3), value), "b": torch.arange(3.0)},
        "loader": {"epoch": 0, "position": step * 8},
        "config": {"lr": 1e-3, "name": "run"},
    }


def save_checkpoint(run_dir, step: int, state: dict, keep_last: int = 2, background=False):
    """`state` of `_small_state`'s form through the checkpointer, as the trainer saves: the
    model to DCP, the config as JSON, the loader as the one data rank's state."""
    saver = Checkpointer(run_dir, keep_last=keep_last, background=background)
    rest = {"model": state["model"]} if "model" in state else {}
    folder = saver.save(step, rest, state.get("config", {}), (0, state.get("loader")))
    saver.wait()
    return folder


def _latest(run_dir) -> tuple[int, dict] | None:
    """The newest checkpoint as (step, {model, loader, config}), read whole."""
    found = load_latest(run_dir)
    if found is None:
        return None
    content = read_checkpoint(found.folder)
    return found.step, {
        "model": content.get("model", {}),
        "loader": found.data_state(0, 1),
        "config": found.state,
    }


def _step_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / CHECKPOINTS_DIR).iterdir() if p.is_dir())


# ----------------------------------------------------------------------------- exact resume


class _TinyLM(torch.nn.Module):
    """Embedding, one hidden layer with dropout (it draws from the torch RNG), tied output head."""

    def __init__(self, vocab: int = 97, dim: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.hidden = torch.nn.Linear(dim, dim)
        self.drop = torch.nn.Dropout(0.1)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.hidden(self.embed(ids[:, :-1]))))  # [B, T-1, D]
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids[:, 1:].flatten())


def _make_training(seed: int):
    torch.manual_seed(seed)
    model = _TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[3])
    return model, opt, sched


def _train_steps(model, opt, sched, num_steps: int) -> list[float]:
    """Batches come from the global RNGs (torch, numpy, random), so resuming must restore them."""
    losses = []
    for _ in range(num_steps):
        length = 8 + random.randrange(8) + int(np.random.randint(0, 4))
        loss = model.loss(torch.randint(0, 97, (4, length)))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_resume_reproduces_uninterrupted_run_exactly(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    np.random.seed(1)
    random.seed(1)
    model, opt, sched = _make_training(seed=0)
    _train_steps(model, opt, sched, 3)
    msd, osd = get_state_dict(model, opt)
    saver = Checkpointer(tmp_path)
    saver.save(3, {"model": msd, "optimizer": osd}, {"scheduler": sched.state_dict()}, None,
               capture_rng_state())  # fmt: skip
    expected = _train_steps(model, opt, sched, 4)

    model2, opt2, sched2 = _make_training(seed=7)  # other weights, another RNG state
    msd2, osd2 = get_state_dict(model2, opt2)
    sharded = {"model": msd2, "optimizer": osd2}
    found = load_latest(tmp_path, sharded)
    assert found.step == 3
    set_state_dict(
        model2, opt2, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"]
    )
    sched2.load_state_dict(found.state["scheduler"])
    restore_rng_state(found.rng_state())
    resumed = _train_steps(model2, opt2, sched2, 4)
    assert resumed == expected  # bit-identical, not merely close
    assert model2.head.weight is model2.embed.weight  # still tied after loading
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), model2.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_rng_capture_restore_replays_every_generator():
    state = capture_rng_state()
    first = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    restore_rng_state(state)
    again = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    assert first == again
    assert not torch.cuda.is_available() or "cuda" in state


# ----------------------------------------------------------------------------- layout


def test_layout_marker_and_meta(tmp_path):
    path = save_checkpoint(tmp_path, 100, _small_state(100))
    assert path == tmp_path / CHECKPOINTS_DIR / "step_000100"
    assert sorted(p.name for p in path.iterdir()) == ["data_00000.pt", DCP_DIR, META_FILE]
    marker = (tmp_path / CHECKPOINTS_DIR / LATEST_MARKER).read_text().strip()
    assert marker == "step_000100"
    meta = json.loads((path / META_FILE).read_text())
    assert meta["step"] == 100 and meta["format"] == "dcp"
    assert meta["state"] == {"lr": 1e-3, "name": "run"}  # readable without torch
    assert meta["files"]["data_00000.pt"] == (path / "data_00000.pt").stat().st_size
    assert any(name.startswith(f"{DCP_DIR}/") for name in meta["files"])
    step, state = _latest(tmp_path)
    assert step == 100
    assert torch.equal(state["model"]["w"], torch.ones(4, 3))
    assert state["loader"] == {"epoch": 0, "position": 800}


def test_hf_model_in_bf16_round_trips(tmp_path):
    model = build_causal_lm(arch="tiny-llama", seed=3).to(torch.bfloat16)
    sd = model.state_dict()
    save_checkpoint(tmp_path, 1, {"model": sd})
    _, state = _latest(tmp_path)
    assert set(state["model"]) == set(sd)
    for key, value in sd.items():
        assert state["model"][key].dtype == value.dtype
        assert torch.equal(state["model"][key], value), key
    fresh = build_causal_lm(arch="tiny-llama", seed=4).to(torch.bfloat16)
    fresh.load_state_dict(state["model"])
    for (n1, p1), (n2, p2) in zip(model.named_parameters(), fresh.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_keep_last_prunes_only_older_checkpoints(tmp_path):
    for step in range(10, 60, 10):
        save_checkpoint(tmp_path, step, _small_state(step), keep_last=2)
    assert _step_dirs(tmp_path) == ["step_000040", "step_000050"]
    assert load_latest(tmp_path).step == 50


def test_saving_the_same_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 5, _small_state(5, value=1.0))
    save_checkpoint(tmp_path, 5, _small_state(5, value=2.0))
    step, state = _latest(tmp_path)
    assert step == 5 and torch.equal(state["model"]["w"], torch.full((4, 3), 2.0))
    assert [p.name for p in (tmp_path / CHECKPOINTS_DIR).iterdir() if p.name.startswith(".")] == []


def test_newer_checkpoints_of_an_abandoned_run_are_removed(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, _small_state(step), keep_last=3)
    save_checkpoint(tmp_path, 15, _small_state(15), keep_last=3)
    assert _step_dirs(tmp_path) == ["step_000010", "step_000015"]
    assert load_latest(tmp_path).step == 15


def test_state_that_would_not_load_is_refused_at_save_time(tmp_path):
    with pytest.raises(TypeError, match=r"state\['data'\]\[1\]\['pos'\].*numpy"):
        save_checkpoint(tmp_path, 1, {"loader": {"pos": np.int64(3)}})
    with pytest.raises(TypeError, match="plain JSON"):
        Checkpointer(tmp_path).save(1, {}, {"lr": np.float32(1.0)})
    assert not (tmp_path / CHECKPOINTS_DIR).exists()


# ----------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_model_is_never_saved(tmp_path, bad, dtype):
    save_checkpoint(tmp_path, 1, _small_state(1))
    state = _small_state(2)
    state["model"] = {k: v.to(dtype) for k, v in state["model"].items()}
    state["model"]["w"][2, 1] = bad
    with pytest.raises(NonFiniteStateError, match=r"NaN or Inf.*\bw\b"):
        save_checkpoint(tmp_path, 2, state)
    assert not list((tmp_path / CHECKPOINTS_DIR).glob(".tmp-*"))
    assert _step_dirs(tmp_path) == ["step_000001"]
    assert (tmp_path / CHECKPOINTS_DIR / LATEST_MARKER).read_text().strip() == "step_000001"


def test_large_finite_values_are_accepted(tmp_path):
    # Their float32 sum overflows to inf; the exact check must still let them through.
    state = {"model": {"w": torch.full((1000,), 3.0e38)}}
    save_checkpoint(tmp_path, 1, state)
    assert load_latest(tmp_path).step == 1


# ----------------------------------------------------------------------------- crashes


def test_no_checkpoint_gives_none(tmp_path):
    assert load_latest(tmp_path) is None
    (tmp_path / CHECKPOINTS_DIR).mkdir()
    assert load_latest(tmp_path) is None


def test_leftover_temp_folder_is_ignored_and_removed(tmp_path):
    save_checkpoint(tmp_path, 1, _small_state(1))
    save_checkpoint(tmp_path, 2, _small_state(2))
    root = tmp_path / CHECKPOINTS_DIR
    # What a kill in the middle of saving step 3 leaves: a temp folder with a truncated file.
    partial = root / ".tmp-step_000003"
    shutil.copytree(root / "step_000002", partial)
    (partial / META_FILE).unlink()
    shard = next((partial / DCP_DIR).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:20])
    (root / f"{LATEST_MARKER}.tmp").write_text("step_0000")
    step, state = _latest(tmp_path)
    assert step == 2 and state["loader"]["position"] == 16
    assert not partial.exists() and not (root / f"{LATEST_MARKER}.tmp").exists()


def _damage(folder: Path, how: str) -> None:
    shard = next((folder / DCP_DIR).glob("*.distcp"))
    if how == "truncate_shard":
        shard.write_bytes(shard.read_bytes()[:-7])
    elif how == "garbage_shard":  # the right size, not the right bytes
        shard.write_bytes(b"\xff" * shard.stat().st_size)
    elif how == "garbage_metadata":
        md = folder / DCP_DIR / ".metadata"
        md.write_bytes(b"\xff" * md.stat().st_size)
    elif how == "bad_meta":
        (folder / META_FILE).write_text('{"format": "dcp", "st')
    elif how == "missing_data":
        (folder / "data_00000.pt").unlink()


@pytest.mark.parametrize(
    "how", ["truncate_shard", "garbage_shard", "garbage_metadata", "bad_meta", "missing_data"]
)
def test_damaged_latest_falls_back_to_previous(tmp_path, caplog, how):
    save_checkpoint(tmp_path, 1, _small_state(1, value=1.0), keep_last=3)
    save_checkpoint(tmp_path, 2, _small_state(2, value=2.0), keep_last=3)
    root = tmp_path / CHECKPOINTS_DIR
    _damage(root / "step_000002", how)
    template = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
    with caplog.at_level(logging.WARNING, logger="crossdistill.train.checkpoint"):
        found = load_latest(tmp_path, template)
    assert found.step == 1 and torch.equal(template["model"]["w"], torch.ones(4, 3))
    assert "step_000002" in caplog.text and "falling back" in caplog.text
    assert (root / "step_000002.corrupt").is_dir()
    # The run goes on: saving step 2 again works and is then the latest.
    save_checkpoint(tmp_path, 2, _small_state(2, value=5.0), keep_last=3)
    assert load_latest(tmp_path).step == 2


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path):
    save_checkpoint(tmp_path, 1, _small_state(1))
    _damage(tmp_path / CHECKPOINTS_DIR / "step_000001", "truncate_shard")
    with pytest.raises(UserError, match="no checkpoint .* could be loaded"):
        load_latest(tmp_path)


def test_checkpoint_completed_before_marker_is_used(tmp_path, caplog):
    # A kill between renaming step 2 into place and replacing `latest` leaves the marker behind.
    save_checkpoint(tmp_path, 1, _small_state(1), keep_last=3)
    save_checkpoint(tmp_path, 2, _small_state(2), keep_last=3)
    (tmp_path / CHECKPOINTS_DIR / LATEST_MARKER).write_text("step_000001\n")
    with caplog.at_level(logging.WARNING, logger="crossdistill.train.checkpoint"):
        assert load_latest(tmp_path).step == 2
    assert "'latest' names step_000001" in caplog.text


_SAVER = textwrap.dedent(
    """
    import sys, torch
    from crossdistill.train.checkpoint import Checkpointer
    run_dir, background = sys.argv[1], sys.argv[2] == "1"
    saver = Checkpointer(run_dir, keep_last=2, background=background)
    for step in range(1, 10_000):
        model = {f"w{i}": torch.full((256, 1024), float(step)) for i in range(8)}
        saver.save(step, {"model": model}, {}, (0, {"position": step}))
        saver.wait()
        print(step, flush=True)
    """
)


@pytest.mark.parametrize("written", ["data_00000.pt", f"{DCP_DIR}/*.distcp"])
@pytest.mark.parametrize("background", [False, True], ids=["in-loop", "background"])
def test_sigkill_during_saves_leaves_a_loadable_checkpoint(tmp_path, written, background):
    """A real SIGKILL as soon as a save in progress has started writing `written`."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tmp_path), str(int(background))],
        stdout=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
    )
    root = tmp_path / CHECKPOINTS_DIR
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if int(line) >= 3:
                break
        deadline = time.monotonic() + 30
        while not any(root.glob(f".tmp-*/{written}")) and time.monotonic() < deadline:
            time.sleep(0.0002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    step, state = _latest(tmp_path)
    assert step >= 3 and state["loader"]["position"] == step
    for value in state["model"].values():
        assert torch.equal(value, torch.full((256, 1024), float(step)))
    assert [p for p in root.iterdir() if p.name.startswith(".")] == []


_FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from crossdistill.errors import UserError
    from crossdistill.train.checkpoint import Checkpointer
    run_dir = sys.argv[1]
    for background in (False, True):
        saver = Checkpointer(run_dir, background=background)
        saver.save(1, {"model": {"w": torch.ones(10)}}, {}, (0, {"position": 1}))
        saver.wait()
    # Files may not grow past 200 kB from here on: writes fail as on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
    big = torch.zeros(200_000)
    # The shards fail in the loop and in the background, then the loader state file
    cases = [(False, {"w": big}, None), (True, {"w": big}, None), (False, {"w": big[:10]}, big)]
    for background, model, loader in cases:
        saver = Checkpointer(run_dir, background=background)
        try:
            saver.save(2, {"model": model}, {}, (0, {"position": 2, "big": loader}))
            saver.wait()
        except UserError as e:
            print("USERERROR", e)
    """
)


def test_disk_full_during_save_keeps_previous_latest(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.stdout.count("USERERROR disk full") == 3, out.stdout + out.stderr
    assert _step_dirs(tmp_path) == ["step_000001"]  # no temp folder, no partial step 2
    assert (tmp_path / CHECKPOINTS_DIR / LATEST_MARKER).read_text().strip() == "step_000001"
    assert load_latest(tmp_path).step == 1


# ----------------------------------------------------------------------------- write probe


def test_check_writable_accepts_a_fresh_folder(tmp_path):
    check_writable(tmp_path / "a" / "b", min_free_bytes=1)
    assert (tmp_path / "a" / "b").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the probe cleans up


def test_check_writable_refuses_an_uncreatable_folder(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(UserError, match="not writable"):
        check_writable(blocker / "run", min_free_bytes=1)


def test_check_writable_refuses_a_nearly_full_disk(tmp_path):
    import shutil

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(UserError, match="GiB free"):
        check_writable(tmp_path, min_free_bytes=free + 2**40)


# ----------------------------------------------------------------------------- background saves


def test_background_save_writes_the_state_as_it_was_when_saved(tmp_path, monkeypatch):
    """Training goes on (and changes the tensors in place) while the thread writes: what lands
    on disk is the state at `save` time (the writer is held until the tensors have changed)."""
    from torch.distributed.checkpoint import FileSystemWriter

    release, writing = threading.Event(), threading.Event()
    write = FileSystemWriter.write_data

    def held(self, *args, **kwargs):
        writing.set()
        assert release.wait(30)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", held)
    saver = Checkpointer(tmp_path, keep_last=2, background=True)
    state = _small_state(5, value=2.0)
    saver.save(5, {"model": state["model"]}, {}, (0, state["loader"]))
    assert writing.wait(30)  # the thread is writing; the loop has its state back
    state["model"]["w"].fill_(99.0)
    state["loader"]["position"] = -1
    release.set()
    saver.wait()
    step, loaded = _latest(tmp_path)
    assert step == 5 and loaded["loader"]["position"] == 40
    assert torch.equal(loaded["model"]["w"], torch.full((4, 3), 2.0))


def test_background_save_error_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    save_checkpoint(tmp_path, 1, _small_state(1), background=True)

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    saver = Checkpointer(tmp_path, keep_last=2, background=True)
    saver.save(2, {"model": _small_state(2)["model"]}, {})  # returns: the error is the thread's
    with pytest.raises(UserError, match="disk full"):
        saver.wait()
    saver.wait()  # raised once
    assert load_latest(tmp_path).step == 1 and _step_dirs(tmp_path) == ["step_000001"]


def test_background_save_refuses_a_non_finite_model_at_once(tmp_path):
    saver = Checkpointer(tmp_path, background=True)
    state = _small_state(1)
    state["model"]["w"][0, 0] = float("nan")
    with pytest.raises(NonFiniteStateError):
        saver.save(1, {"model": state["model"]}, {})
    saver.wait()
    assert load_latest(tmp_path) is None

"""`bench quality --jobs N`: the runs in processes of their own, and what happens when one of
them fails, is killed, or cannot start. Real processes, spawned (runs on `auto`) or forked from
a preloaded server (runs all on the CPU); the run itself is injected (the functions below),
since what is tested is the scheduling and the reporting; real training runs go through the
same processes in `test_quality_bench.py`'s `student_noise.py` test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from crossdistill.bench.quality import _run_context, train_many
from crossdistill.cli import run_reporting
from crossdistill.config import Config
from crossdistill.errors import UserError

# runs on `auto` start as spawned processes, runs all on the CPU fork from a preloaded server
DEVICES = ["auto", "cpu"]


def _cfg(seed: int, out: Path | None = None, device: str = "auto") -> Config:
    cfg = Config()
    cfg = replace(cfg, train=replace(cfg.train, seed=seed, device=device))
    return replace(cfg, run=replace(cfg.run, out_dir=str(out))) if out else cfg


def pid_and_seed(raw) -> float:
    """The run's process and its config's seed, in one number."""
    return os.getpid() * 1000 + raw["train"]["seed"]


def fails_on_seed_1_others_sleep(raw) -> float:
    if raw["train"]["seed"] == 1:
        raise ValueError("the loss is NaN at step 3")
    time.sleep(600)
    return 0.5


def user_error_on_seed_1(raw) -> float:
    if raw["train"]["seed"] == 1:
        raise UserError("corpus.jsonl: line 2 is not JSON; fix or remove it")
    return 0.5


def killed_on_seed_1_others_sleep(raw) -> float:
    """Seed 1 dies as the kernel's out-of-memory killer would end it; the others write their
    process id where the test can find it and sleep far past the test's time limit."""
    if raw["train"]["seed"] == 1:
        time.sleep(1.0)  # the sleepers are running by then
        os.kill(os.getpid(), signal.SIGKILL)
    Path(raw["run"]["out_dir"]).write_text(str(os.getpid()))
    time.sleep(600)
    return 0.5


class CannotStart:
    """A run that cannot be unpickled in the child: its process ends before it runs, like a
    worker whose script was replaced on disk under it."""

    def __call__(self, raw) -> float:
        return 0.5

    def __reduce__(self):
        return (_refuse_to_load, ())


def _refuse_to_load():
    raise ImportError("the module changed on disk")  # only the child unpickles it


@pytest.mark.parametrize("device", DEVICES)
def test_every_run_once_in_a_process_of_its_own(device):
    cfgs = {f"seed {s}": _cfg(s, device=device) for s in range(5)}
    got = dict(train_many(cfgs, 2, run=pid_and_seed))
    assert sorted(got) == sorted(cfgs)
    for key, value in got.items():
        assert int(value) % 1000 == int(key.split()[1])  # each key's own config
    pids = {int(v) // 1000 for v in got.values()}
    assert len(pids) == 5 and os.getpid() not in pids  # a fresh process per run


def says_its_word(raw) -> float:
    """Prints its out_dir's name and its seed, through Python's streams and straight to the
    descriptors."""
    word, seed = Path(raw["run"]["out_dir"]).name, raw["train"]["seed"]
    print(f"{word} out {seed}", flush=True)
    print(f"{word} err {seed}", file=sys.stderr, flush=True)
    os.write(2, f"{word} fd {seed}\n".encode())
    return float(seed)


@pytest.mark.parametrize("device", DEVICES)
def test_what_runs_print_reaches_the_callers_output_at_each_call(tmp_path, capfd, device):
    """A run forked from the server must not write to the descriptors the server inherited
    when it started (here outside this test's capture, if no earlier test started it), but to
    those of the call that starts it."""
    with capfd.disabled():
        dict(train_many({"before": _cfg(9, tmp_path / "before", device)}, 1, run=says_its_word))
    for word in ("first", "second"):
        cfgs = {s: _cfg(s, tmp_path / word, device) for s in range(2)}
        assert dict(train_many(cfgs, 2, run=says_its_word)) == {0: 0.0, 1: 1.0}
        got = capfd.readouterr()
        assert sorted(got.out.splitlines()) == [f"{word} out 0", f"{word} out 1"]
        expected = sorted(f"{word} {kind} {s}" for s in (0, 1) for kind in ("err", "fd"))
        assert sorted(got.err.splitlines()) == expected


def sleeps_then_seed(raw) -> float:
    time.sleep(0.5)
    return float(raw["train"]["seed"])


def test_each_run_is_announced_as_its_process_starts():
    """`on_start` marks each run when its process starts, not when it is queued: at most `jobs`
    runs are started and not finished, and each run's time from its start covers its sleep
    (`bench quality` logs and times each student so)."""
    events, started = [], {}

    def begin(key):
        events.append(("start", key))
        started[key] = time.monotonic()

    cfgs = {f"seed {s}": _cfg(s) for s in range(5)}
    for key, value in train_many(cfgs, 2, run=sleeps_then_seed, on_start=begin):
        events.append(("done", key))
        assert value == float(key.split()[1])
        assert time.monotonic() - started[key] >= 0.5
    assert sorted(k for e, k in events if e == "start") == sorted(cfgs)
    running = 0
    for event, _ in events:
        running += 1 if event == "start" else -1
        assert 0 <= running <= 2
    assert [e for e, _ in events[:2]] == ["start", "start"]  # two at a time from the first


def test_a_run_that_raises_stops_the_experiment_at_once_with_its_name_and_traceback():
    """Not after every other run has trained, as a standard process pool's exit would wait."""
    cfgs = {f"seed {s}": _cfg(s) for s in range(4)}
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"run seed 1 failed") as e:
        dict(train_many(cfgs, 2, run=fails_on_seed_1_others_sleep))
    assert "ValueError: the loss is NaN at step 3" in str(e.value)
    assert time.monotonic() - start < 60  # seed 0 and the two queued runs would take 600 s each


def fails_on_seed_0(raw) -> float:
    if raw["train"]["seed"] == 0:
        raise ValueError("the loss is NaN at step 3")
    return 0.5


def test_the_cli_prints_a_failed_runs_own_traceback_and_not_its_own(capsys):
    """The child's traceback says where the run failed; the parent's would say only where the
    bench waited, above it."""

    def bench(_):
        dict(train_many({f"seed {s}": _cfg(s) for s in range(2)}, 2, run=fails_on_seed_0))

    assert run_reporting(bench, None) == 1
    err = capsys.readouterr().err
    assert err.startswith("crossdistill: error: run seed 0 failed; its traceback:\nTraceback")
    assert err.count("Traceback") == 1 and "in fails_on_seed_0" in err
    assert err.rstrip().endswith("ValueError: the loss is NaN at step 3")
    assert "train_many" not in err  # nothing of the reporting process's stack


def test_a_user_error_in_a_run_stays_one_line():
    with pytest.raises(UserError) as e:
        dict(train_many({f"seed {s}": _cfg(s) for s in range(3)}, 3, run=user_error_on_seed_1))
    assert str(e.value) == "run seed 1: corpus.jsonl: line 2 is not JSON; fix or remove it"


@pytest.mark.parametrize("device", DEVICES)
def test_a_killed_run_fails_at_once_and_stops_the_others(tmp_path, device):
    cfgs = {f"seed {s}": _cfg(s, tmp_path / f"pid{s}", device) for s in range(3)}
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"run seed 1: its process ended \(killed by signal 9\)"):
        dict(train_many(cfgs, 3, run=killed_on_seed_1_others_sleep))
    assert time.monotonic() - start < 60  # the sleepers would take 600 s
    for s in (0, 2):
        pid = int((tmp_path / f"pid{s}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped, not left running


@pytest.mark.parametrize("device", DEVICES)
def test_a_run_that_cannot_start_fails_instead_of_waiting_forever(device):
    start = time.monotonic()
    cfgs = {f"seed {s}": _cfg(s, device=device) for s in range(2)}
    with pytest.raises(RuntimeError, match=r"run seed 0: its process ended \(exit code 1\)"):
        dict(train_many(cfgs, 1, run=CannotStart()))
    assert time.monotonic() - start < 60


def wait_for_go_then_fail_on_seed_1(raw) -> float:
    """Seed 0 returns at once; seeds 1 and 2 wait for the file `go` beside their out_dir, then
    seed 2 returns and seed 1 raises: both end while the parent is busy elsewhere."""
    seed, out = raw["train"]["seed"], Path(raw["run"]["out_dir"])
    if seed:
        while not (out.parent / "go").exists():
            time.sleep(0.01)
    if seed == 1:
        raise ValueError("the loss is NaN at step 3")
    return float(seed)


@pytest.mark.parametrize("order", [(0, 1, 2), (0, 2, 1)])
def test_a_run_that_ends_with_a_failing_one_is_still_reported(tmp_path, order):
    """Seeds 1 and 2 end while the consumer of the results is busy (as `run_jobs` is, writing
    cells.jsonl), so one wait finds both: seed 2's result comes out before seed 1's error,
    whichever of the two started first."""
    cfgs = {f"seed {s}": _cfg(s, tmp_path / f"run{s}") for s in order}
    got = []
    with pytest.raises(RuntimeError, match="run seed 1 failed") as err:
        for key, value in train_many(cfgs, 3, run=wait_for_go_then_fail_on_seed_1):
            got.append((key, value))
            if key == "seed 0":
                (tmp_path / "go").touch()
                time.sleep(3.0)  # seeds 1 and 2 both end meanwhile
    assert got == [("seed 0", 0.0), ("seed 2", 2.0)]
    assert "ValueError: the loss is NaN at step 3" in str(err.value)


_KILLED_PARENT = """
import sys, time
from pathlib import Path
from crossdistill.bench.quality import train_many
from crossdistill.config import Config


def write_pid_and_sleep(raw):
    import os
    Path(raw["run"]["out_dir"]).write_text(str(os.getpid()))
    time.sleep(600)
    return 0.5


if __name__ == "__main__":
    from dataclasses import replace
    cfgs = {}
    for s in range(2):
        cfg = Config()
        cfg = replace(cfg, train=replace(cfg.train, device=sys.argv[2]))
        cfgs[s] = replace(cfg, run=replace(cfg.run, out_dir=f"{sys.argv[1]}/pid{s}"))
    dict(train_many(cfgs, 2, run=write_pid_and_sleep))
"""


def _running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie waiting for a parent that
    does not reap it has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_runs_end_when_the_bench_is_killed(tmp_path, sig, device):
    """A bench killed from outside (no `finally` runs) takes its runs with it, instead of
    leaving them to train into the folders a rerun is about to use."""
    script = tmp_path / "bench.py"
    script.write_text(_KILLED_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path), device])
    try:
        pidfiles = [tmp_path / f"pid{s}" for s in range(2)]
        deadline = time.monotonic() + 120
        while not all(p.is_file() and p.read_text() for p in pidfiles):
            assert time.monotonic() < deadline and parent.poll() is None, "the runs never started"
            time.sleep(0.05)
        children = [int(p.read_text()) for p in pidfiles]
        assert all(_running(pid) for pid in children)
        parent.send_signal(sig)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while any(_running(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_running(pid) for pid in children), "runs left running"
    finally:
        parent.kill()
        parent.wait()


def test_runs_all_on_the_cpu_fork_from_a_server_and_the_others_are_spawned():
    on_cpu = [_cfg(s, device="cpu") for s in range(2)]
    assert _run_context(on_cpu).get_start_method() == "forkserver"
    for devices in (["cpu", "cuda"], ["auto"], ["cuda:0"]):
        cfgs = [_cfg(s, device=d) for s, d in enumerate(devices)]
        assert _run_context(cfgs).get_start_method() == "spawn"

"""MetricsLogger: values as logged, resume without duplicate steps, TensorBoard events, progress
output with and without a terminal, and a missing tensorboard package."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from crossdistill.train.metrics import METRICS_FILE, MetricsLogger, read_metrics, to_floats

REPO = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_values_are_logged_exactly_as_given(tmp_path):
    rng = np.random.default_rng(0)
    x64 = rng.normal(size=5)
    scalars = {
        "loss": torch.tensor(x64[0], dtype=torch.float32),
        "loss/ce": torch.tensor([x64[1]], dtype=torch.float32),  # one element, 1-d
        "loss/kd": torch.tensor(x64[2], dtype=torch.bfloat16),
        "lr": float(x64[3]),
        "tokens_per_s": torch.tensor(12345),
        "grad_norm": torch.tensor(x64[4], dtype=torch.float64),
        "skipped": 2,
    }
    # Reference: the exact value each input holds, through numpy in float64.
    expected = {
        "loss": float(np.float32(x64[0])),
        "loss/ce": float(np.float32(x64[1])),
        "loss/kd": float(torch.tensor(x64[2], dtype=torch.bfloat16).to(torch.float64)),
        "lr": float(x64[3]),
        "tokens_per_s": 12345.0,
        "grad_norm": float(x64[4]),
        "skipped": 2.0,
    }
    with MetricsLogger(tmp_path, 10, tensorboard=False, progress=False, stream=io.StringIO()) as m:
        returned = m.log(3, scalars)
    assert returned == expected and list(returned) == list(scalars)
    (record,) = _lines(tmp_path)
    assert record.pop("step") == 3 and isinstance(record.pop("time"), float)
    assert record == expected


def test_non_finite_values_become_null_and_nan(tmp_path):
    with MetricsLogger(tmp_path, 10, tensorboard=False, progress=False, stream=io.StringIO()) as m:
        out = m.log(1, {"loss": torch.tensor(float("nan")), "loss/kd": float("inf"), "lr": 0.5})
    assert math.isnan(out["loss"]) and out["loss/kd"] == math.inf
    (record,) = _lines(tmp_path)
    assert record["loss"] is None and record["loss/kd"] is None and record["lr"] == 0.5


def test_a_tensor_that_is_not_a_scalar_is_refused():
    with pytest.raises(ValueError, match="shape \\[2\\]"):
        to_floats({"loss": torch.zeros(2)})


def test_resume_drops_steps_after_the_checkpoint_and_appends(tmp_path):
    kw = {"tensorboard": False, "progress": False, "stream": io.StringIO()}
    with MetricsLogger(tmp_path, 10, **kw) as m:
        for step in range(1, 8):
            m.log(step, {"loss": float(step)})
            if step == 4:
                m.log(step, {"val/loss": 40.0})
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 8, "loss": 8.')  # a line cut by the kill
    with MetricsLogger(tmp_path, 10, resume_step=4, **kw) as m:
        for step in range(5, 11):
            m.log(step, {"loss": 100.0 + step})
    records = read_metrics(tmp_path / METRICS_FILE)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert train == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)] + [
        (s, 100.0 + s) for s in range(5, 11)
    ]
    assert [r["val/loss"] for r in records if "val/loss" in r] == [40.0]
    assert len(_lines(tmp_path)) == len(records)  # the cut line is gone, every line parses


def test_a_new_run_starts_a_new_file(tmp_path):
    kw = {"tensorboard": False, "progress": False, "stream": io.StringIO()}
    with MetricsLogger(tmp_path, 10, **kw) as m:
        m.log(1, {"loss": 1.0})
    with MetricsLogger(tmp_path, 10, **kw) as m:
        m.log(1, {"loss": 2.0})
    assert [r["loss"] for r in _lines(tmp_path)] == [2.0]


def test_tensorboard_events_follow_the_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    kw = {"progress": False, "stream": io.StringIO()}
    with MetricsLogger(tmp_path, 10, **kw) as m:
        for step in range(1, 8):
            m.log(step, {"loss": torch.tensor(10.0 - step), "val/bpb/student": 1.5})
    with MetricsLogger(tmp_path, 10, resume_step=4, **kw) as m:
        for step in range(5, 11):
            m.log(step, {"loss": 100.0 + step})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(s, 10.0 - s) for s in range(1, 5)] + [(s, 100.0 + s) for s in range(5, 11)]
    assert [e.step for e in events.Scalars("val/bpb/student")] == [1, 2, 3, 4]


def test_plain_lines_without_a_terminal(tmp_path):
    out = io.StringIO()
    with MetricsLogger(tmp_path, 100, tensorboard=False, print_every=10, stream=out) as m:
        for step in range(1, 101):
            m.log(step, {"loss": 1.0 / step, "tokens_per_s": 12345.0})
            if step == 50:
                m.log(step, {"val/loss": 2.25, "val/bpb/student": 1.125})
    lines = out.getvalue().splitlines()
    train = [ln for ln in lines if "val/" not in ln]
    assert [ln.split(" | ")[0] for ln in train] == [
        f"step {s}/100" for s in (1, 11, 21, 31, 41, 51, 61, 71, 81, 91, 100)
    ]
    assert train[1].startswith("step 11/100 | loss 0.0909 | 12.3k tok/s | eta ")
    assert lines.count("step 50/100 | val/loss 2.25 | val/bpb/student 1.125") == 1
    assert "\r" not in out.getvalue()


def test_progress_bar_on_a_terminal(tmp_path):
    out = _Terminal()
    with MetricsLogger(tmp_path, 20, tensorboard=False, stream=out) as m:
        for step in range(1, 21):
            m.log(step, {"loss": 0.5, "tokens_per_s": 2.5e6})
        m.log(20, {"val/loss": 0.75})
    text = out.getvalue()
    assert "20/20" in text and "loss 0.5000" in text and "2.5M tok/s" in text
    assert "step 20/20 | val/loss 0.75" in text


def test_progress_false_prints_plain_lines_even_on_a_terminal(tmp_path):
    out = _Terminal()
    with MetricsLogger(tmp_path, 4, tensorboard=False, progress=False, stream=out) as m:
        for step in range(1, 5):
            m.log(step, {"loss": 1.0})
    assert out.getvalue().splitlines()[-1].startswith("step 4/4 | loss 1.0000 | eta 0:00:00")


def test_without_tensorboard_installed_it_warns_once_and_logs(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        sys.modules["tensorboard"] = None  # as if the package were not installed
        from crossdistill.train.metrics import MetricsLogger
        for i in range(2):
            with MetricsLogger(sys.argv[1], 3, progress=False) as m:
                m.log(1, {"loss": 1.5})
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("tensorboard is not installed") == 1
    assert [r["loss"] for r in _lines(tmp_path)] == [1.5]
    assert not (tmp_path / "tensorboard").exists()

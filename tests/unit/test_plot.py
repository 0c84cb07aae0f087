"""`crossdistill plot`: grouping of metric keys, the PNGs written, the command line, and the
errors for a missing run, an empty run, and a missing matplotlib."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from crossdistill.errors import UserError
from crossdistill.train.metrics import METRICS_FILE, MetricsLogger, read_metrics
from crossdistill.train.plot import add_plot_parser, group_series, plot_run

REPO = Path(__file__).resolve().parents[2]
pytest.importorskip("matplotlib")


def _write_run(run_dir: Path, num_steps: int = 80) -> None:
    rng = np.random.default_rng(0)
    with MetricsLogger(
        run_dir, num_steps, tensorboard=False, progress=False, stream=io.StringIO()
    ) as m:
        for step in range(1, num_steps + 1):
            ce, kd = 5.0 / step**0.3 + rng.normal(0, 0.05), 2.0 / step**0.2
            m.log(
                step,
                {
                    "loss": 0.5 * ce + 0.5 * kd,
                    "loss/ce": ce,
                    "loss/kd": kd,
                    "lr": 1e-3 * min(1.0, step / 10),
                    "tokens_per_s": 4000.0 + rng.normal(0, 100),
                    "grad_norm": float("nan") if step == 7 else 1.0,  # a skipped step
                },
            )
            if step % 20 == 0:
                vals = {"val/loss": 3.0 / step**0.2, "val/bpb/student": 2.0 / step**0.1}
                if step == 20:
                    vals["val/bpb/teacher"] = 1.1  # computed once
                m.log(step, vals)


def test_keys_group_by_their_first_part(tmp_path):
    _write_run(tmp_path)
    groups = group_series(read_metrics(tmp_path / METRICS_FILE))
    assert set(groups) == {"loss", "bpb", "lr", "tokens_per_s", "grad_norm"}
    assert set(groups["loss"]) == {"loss", "loss/ce", "loss/kd", "val/loss"}
    assert set(groups["bpb"]) == {"val/bpb/student", "val/bpb/teacher"}
    assert groups["bpb"]["val/bpb/student"][0] == [20, 40, 60, 80]
    assert groups["bpb"]["val/bpb/teacher"] == ([20], [1.1])
    steps, values = groups["grad_norm"]["grad_norm"]
    assert 7 not in steps and len(steps) == 79 and values == [1.0] * 79  # the null is skipped


def test_plot_run_writes_one_png_per_group(tmp_path):
    from matplotlib.image import imread

    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == ["loss.png", "bpb.png", "tokens_per_s.png", "lr.png", "grad_norm.png"]
    for path in paths:
        assert path.parent == tmp_path / "plots"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(path)
        assert image.shape[:2] == (450, 800)
        assert image[..., :3].std() > 0.01  # something was drawn


def test_plot_run_out_dir_and_unknown_groups(tmp_path):
    with MetricsLogger(tmp_path, 3, tensorboard=False, progress=False, stream=io.StringIO()) as m:
        for step in (1, 2, 3):
            m.log(step, {"loss": 1.0 / step, "teacher weight/phi": 0.3})
    paths = plot_run(tmp_path, tmp_path / "out")
    assert [p.name for p in paths] == ["loss.png", "teacher_weight.png"]
    assert all(p.parent == tmp_path / "out" and p.stat().st_size > 1000 for p in paths)


def test_missing_or_empty_run_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="metrics.jsonl"):
        plot_run(tmp_path / "nowhere")
    (tmp_path / METRICS_FILE).write_text("")
    with pytest.raises(UserError, match="no metrics yet"):
        plot_run(tmp_path)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="crossdistill")
    add_plot_parser(parser.add_subparsers(dest="command"))
    return parser


def test_command_line(tmp_path, capsys):
    with MetricsLogger(tmp_path, 3, tensorboard=False, progress=False, stream=io.StringIO()) as m:
        for step in (1, 2, 3):
            m.log(step, {"loss": 1.0 / step})
    args = _parser().parse_args(["plot", str(tmp_path), "--out", str(tmp_path / "png")])
    assert args.func(args) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "png" / "loss.png")]
    assert (tmp_path / "png" / "loss.png").stat().st_size > 1000


def test_help_has_examples(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["plot", "--help"])
    text = capsys.readouterr().out
    assert "examples:" in text and "crossdistill plot runs/" in text and "--out" in text


def test_without_matplotlib_it_says_what_to_install(tmp_path):
    _write_run(tmp_path, num_steps=3)
    script = textwrap.dedent(
        """
        import sys
        sys.modules["matplotlib"] = None  # as if the package were not installed
        from crossdistill.errors import UserError
        from crossdistill.train.plot import plot_run
        try:
            plot_run(sys.argv[1])
        except UserError as e:
            print("USERERROR", e)
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
    assert "USERERROR plotting needs matplotlib" in out.stdout, out.stderr
    assert "pip install matplotlib" in out.stdout
    assert not (tmp_path / "plots").exists()

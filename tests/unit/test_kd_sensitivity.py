"""`benchmarks/kd_sensitivity.py`'s settings are checked before anything trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kd_sensitivity.py"


def test_an_unknown_target_in_a_pair_is_refused_with_the_choices(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--targets", "lookahead_end+lookahead_ends",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "unknown target 'lookahead_ends'" in run.stderr and "lookahead_prefix_end" in run.stderr
    assert not any(tmp_path.iterdir())  # refused before any corpus or run was written


def test_a_kd_warmup_past_the_students_steps_is_refused_before_anything_trains(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--kd-warmup-steps", "0", "251", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "--kd-warmup-steps 251: must lie in 0..250" in run.stderr
    assert not any(tmp_path.iterdir())


def test_the_warmup_is_checked_against_the_students_steps_asked_for(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    longer = run("--student-steps", "100", "--kd-warmup-steps", "150")
    assert longer.returncode == 2 and "--kd-warmup-steps 150: must lie in 0..100" in longer.stderr
    for steps in ("0", "-3"):
        none = run("--student-steps", steps)
        assert none.returncode == 2 and f"--student-steps {steps}: give at least 1" in none.stderr
    empty = run("--student-batch", "0")
    assert empty.returncode == 2 and "--student-batch 0: give at least 1" in empty.stderr
    assert not any(tmp_path.iterdir())


def test_a_temperature_or_corpus_folder_that_cannot_be_used_is_refused_before_anything_trains(
    tmp_path,
):
    def run(*args):
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    for value in ("0", "-1", "nan", "inf"):
        bad = run("--temperature", value)
        assert bad.returncode == 2
        assert f"--temperature {value}: give a positive, finite number" in bad.stderr
    absent = tmp_path / "absent"
    missing = run("--source-root", str(absent))
    assert missing.returncode == 2
    assert f"--source-root {absent}: not a directory" in missing.stderr
    assert not (tmp_path / "out").exists()


def test_the_corpus_is_read_from_the_source_root_asked_for(tmp_path):
    from crossdistill.train import demo

    root = tmp_path / "src"
    for i in range(40):
        (root / f"pkg{i % 4}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 4}" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n")
    train, val, _ = demo._write_corpus(tmp_path / "run", 0, root)
    texts = set(train) | set(val)
    assert texts <= {f"def f{i}(x):\n    return x * {i}\n" for i in range(40)}
    assert len(texts) == len(train) + len(val) == 40  # every file once, none on both sides


def test_a_teacher_piece_size_under_a_few_lines_is_refused_before_anything_trains(tmp_path):
    for value in ("100", "-5"):
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "--teacher-piece-chars", value,
             "--out", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2
        assert f"--teacher-piece-chars {value}: give 0 or at least 256" in run.stderr
    assert not any(tmp_path.iterdir())

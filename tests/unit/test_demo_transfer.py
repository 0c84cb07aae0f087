"""`benchmarks/demo_transfer.py`: the teachers' other text leaves out every file of the
students', and a folder it cannot score is refused in one line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_transfer.py"


def _load():
    spec = importlib.util.spec_from_file_location("demo_transfer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_the_other_text_is_the_teachers_files_no_student_read(tmp_path):
    demo_transfer = _load()
    train = [f"x{i} = {'y' * (10 + i)}\n" for i in range(12)]
    _write(tmp_path / "train.jsonl", train)
    student = _write(tmp_path / "student.jsonl", train[:3] + [train[7]])
    path = demo_transfer.other_text(tmp_path, student, num_bytes=60)
    other = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert other == train[3:6]  # whole files in order, past the students', up to the bytes asked
    assert not set(other) & set(train[:3] + [train[7]])
    everything = _write(tmp_path / "all.jsonl", train)
    try:
        demo_transfer.other_text(tmp_path, everything, num_bytes=60)
    except SystemExit as refusal:
        assert "every training file is in the students' text" in str(refusal)
    else:
        raise AssertionError("a students' text holding every file must be refused")


def test_a_folder_without_seed_runs_is_refused_in_one_line(tmp_path):
    def run(*args):
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
        )

    absent = run(str(tmp_path / "absent"))
    assert absent.returncode == 2 and "not a folder" in absent.stderr
    (tmp_path / "seed0" / "data").mkdir(parents=True)
    missing = run(str(tmp_path), "--seeds", "3")
    assert missing.returncode == 2 and "no seed folder seed3" in missing.stderr
    empty = run(str(tmp_path), "--seeds", "0")
    assert empty.returncode == 1 and "no finished student run" in empty.stderr

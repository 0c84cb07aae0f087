"""`benchmarks/demo_repeat.py`: identical copies of the demo's CE-only student, started at once,
compared by tokenizer, weights and every step's loss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.demo_repeat import compare

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_repeat.py"


def _copy(losses, tokenizer="t", weights="w"):
    return {"val_bpb": 1.0, "tokenizer": tokenizer, "weights": weights, "losses": losses}


def test_compare_names_the_first_step_that_differs():
    table = compare(
        {
            "copy0": _copy([3.0, 2.0, 1.0]),
            "copy1": _copy([3.0, 2.0, 1.0]),
            "copy2": _copy([3.0, 2.5, 1.0], weights="x"),
            "copy3": _copy([3.0, 2.0]),  # stopped early
        }
    )
    assert [table[c]["first_differing_step"] for c in sorted(table)] == [None, None, 2, 3]
    assert table["copy2"]["weights"] == "x"


def test_two_copies_on_this_machine_are_identical(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--seed", "0", "--copies", "2", "--steps", "3",
         "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    rows = list(result["copies"].values())
    assert result["identical"] and len(rows) == 2
    assert rows[0] == rows[1] and rows[0]["first_differing_step"] is None


def test_one_copy_is_refused_with_the_reason(tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--copies", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "at least 2 copies" in run.stderr

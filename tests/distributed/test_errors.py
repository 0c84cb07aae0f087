"""A user error on one rank of a multi-process job: that rank prints its one-line message, and
the rank left waiting on it says in one line that it stopped because another rank did, instead
of ending in a gloo traceback. Two plain processes (no launcher that would kill the survivor)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.distributed._harness import free_port

JOB = textwrap.dedent(
    """
    import sys

    import torch
    import torch.distributed as dist

    from crossdistill.cli import run_reporting
    from crossdistill.errors import UserError


    def job(_):
        dist.init_process_group("gloo")
        try:
            if dist.get_rank() == 1:
                raise UserError("data file /node-b/train.jsonl not found; copy it to every node")
            dist.all_reduce(torch.ones(2))
        finally:
            dist.destroy_process_group()


    sys.exit(run_reporting(job, None))
    """
)


def test_a_user_error_on_one_rank_reads_as_one_line_on_each(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True
            )
        )
    err = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[1].returncode == 2
    assert "crossdistill: error: rank 1: data file /node-b/train.jsonl not found" in err[1]
    assert procs[0].returncode == 1, err[0]
    assert "crossdistill: error: rank 0: stopped because another rank" in err[0]
    assert "by peer" in err[0]  # what gloo said (connection closed or reset), kept in the line
    assert "Traceback" not in err[0] + err[1]

"""Golden losses: 20 steps of `crossdistill train` (tiny real-architecture models, real
tokenizers, fixed seed, CPU) in one process and under gloo in three 2-rank layouts, against the
per-step losses and gradient norms recorded before the refactor that made one process the
one-rank case of the distributed path. A refactor that should not change numbers must give them
bit for bit.

`CROSSDISTILL_RECORD_GOLDEN=1 pytest tests/distributed/test_golden.py` writes the file anew
(only when a change of numbers is intended, and said so in its commit). Float results depend
on the CPU: its vector instructions, and which kernels the math libraries pick for its model
(two AVX512 Xeons of different generations differ from the third step on). On a machine other
than the one the file was recorded on (`_machine`), the losses and gradient norms are compared
to 1e-5 relative instead of bit for bit."""

from __future__ import annotations

import copy
import json
import os
import platform
from pathlib import Path

import pytest
import torch

from tests.distributed import _harness as h
from tests.distributed._workers import TWO_RANKS

pytestmark = pytest.mark.distributed
GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "train_20_steps.json"
LAYOUTS = ["fsdp2", "tp2", "cp2"]
STEPS = 20


def _config(root: Path, tokenizer_dir):
    toks = {n: str(tokenizer_dir(n)) for n in ("llama2", "gpt2", "mistral")}
    cfg = h.scenario_config(toks, h.write_corpus(root / "data"), root / "run")
    cfg.train.steps, cfg.train.grad_accum, cfg.train.log_every = STEPS, 2, 1
    cfg.train.eval_every, cfg.train.eval_batches, cfg.train.checkpoint_every = 10, 2, 10
    return cfg


def _machine() -> str:
    """torch's CPU capability and the processor's vendor, family and model."""
    fields = {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "model") and key.strip() not in fields:
                fields[key.strip()] = value.strip()
    described = " ".join(fields.values()) or platform.processor() or platform.machine()
    return f"{torch.backends.cpu.get_cpu_capability()} {described}"


def _record(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    val = [r for r in rows if "val/loss/ce" in r]
    return {
        "loss": [r["loss"] for r in steps],
        "grad_norm": [r["grad_norm"] for r in steps],
        "val": {k: v for k, v in val[-1].items() if k.startswith("val/")},
    }


def golden_worker(rank: int, cfg, root: str, out: str) -> None:
    from crossdistill.train.loop import train

    results = {}
    for case in (c for c in TWO_RANKS if c.name in LAYOUTS):
        c = h.with_layouts(copy.deepcopy(cfg), case)
        c.run.out_dir = str(Path(root) / case.name)
        train(c)
        if rank == 0:
            results[case.name] = _record(Path(root) / case.name)
    if rank == 0:
        torch.save(results, out)


def test_twenty_steps_give_the_recorded_losses(tmp_path, tokenizer_dir):
    from crossdistill.train.loop import train

    cfg = _config(tmp_path, tokenizer_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(copy.deepcopy(cfg))
    finally:
        torch.set_num_threads(threads)
    got = {"single": _record(tmp_path / "run")}
    h.spawn(golden_worker, 2, cfg, str(tmp_path), str(tmp_path / "two.pt"), errors=tmp_path / "e")
    got.update(torch.load(tmp_path / "two.pt", weights_only=False))
    assert all(len(r["loss"]) == STEPS for r in got.values())
    machine = _machine()
    if os.environ.get("CROSSDISTILL_RECORD_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps({"machine": machine, "runs": got}, indent=1) + "\n")
    recorded = json.loads(GOLDEN.read_text())
    want = recorded["runs"]
    assert sorted(got) == sorted(want)
    if recorded["machine"] == machine:
        for layout, record in want.items():
            assert got[layout] == record, layout
        return
    for layout, record in want.items():
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(got[layout][key], record[key], rtol=1e-5, atol=0)

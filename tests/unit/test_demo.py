"""The demo's configs: the shipped configs/demo.yaml is what the demo runs."""

from __future__ import annotations

from pathlib import Path

from crossdistill.config import load_config, to_dict
from crossdistill.train import demo

REPO = Path(__file__).resolve().parents[2]


def test_shipped_demo_config_is_the_demo_kd_stage():
    out = Path("runs/demo")
    student = demo._model(demo.DEMO["student"], out / "tokenizers" / "tokenizer_student", 3072)
    teacher = {
        "name": "teacher",
        "path": str(out / "teacher" / "final"),
        "dtype": "float32",
        "loss": "forward_kl",
        "top_k": demo.DEMO["top_k"],
        "temperature": 1.0,
    }
    ran = demo.stage_config(
        out,
        "student_kd",
        student,
        demo.DEMO["student"]["steps"],
        demo.DEMO["student"]["lr"],
        0,
        demo.DEMO["eval_batches"],
        teachers=[teacher],
    )
    assert to_dict(load_config(REPO / "configs" / "demo.yaml")) == to_dict(ran)

"""The typed config: YAML + overrides, and one clear error for every kind of mistake."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crossdistill.config import Config, load_config, save_config, to_dict
from crossdistill.errors import UserError

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.yaml"
    p.write_text(text)
    return p


def test_defaults_and_types(tmp_path):
    cfg = load_config(
        _write(tmp_path, "student: {arch: tiny-llama}\ntrain: {steps: 7}\noptim: {lr: 3e-4}\n")
    )
    assert isinstance(cfg, Config)
    assert cfg.train.steps == 7 and cfg.student.arch == "tiny-llama"
    assert cfg.optim.lr == pytest.approx(3e-4) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.9, 0.95)


def test_overrides_reach_nested_and_list_items(tmp_path):
    text = "teachers:\n  - {arch: tiny-qwen3, loss: jsd}\n"
    cfg = load_config(
        _write(tmp_path, text),
        [
            "teachers.0.loss=tvd",
            "teachers.1.arch=tiny-phi3",
            "data.seq_len=128",
            "optim.betas=[0.8, 0.9]",
        ],
    )
    assert cfg.teachers[0].loss == "tvd" and cfg.teachers[0].arch == "tiny-qwen3"
    assert cfg.teachers[1].arch == "tiny-phi3" and cfg.teachers[1].loss == "forward_kl"
    assert cfg.data.seq_len == 128 and cfg.optim.betas == (0.8, 0.9)


def test_unknown_key_names_nearest(tmp_path):
    with pytest.raises(
        UserError, match=r"unknown config key 'train.stpes'.*did you mean 'train.steps'"
    ):
        load_config(_write(tmp_path, "train: {stpes: 3}\n"))
    with pytest.raises(UserError, match=r"teachers.0.temprature.*teachers.0.temperature"):
        load_config(None, ["teachers.0.temprature=2"])


def test_wrong_type_names_key_and_expected_type(tmp_path):
    with pytest.raises(UserError, match=r"train.steps: expected int, got 'many'"):
        load_config(_write(tmp_path, "train: {steps: many}\n"))
    with pytest.raises(UserError, match=r"data.micro_batch_size: expected int, got True"):
        load_config(None, ["data.micro_batch_size=true"])
    with pytest.raises(UserError, match=r"'fwd_kl' is not one of .*did you mean 'forward_kl'"):
        load_config(None, ["teachers.0.loss=fwd_kl"])


def test_interleaved_pipeline_settings_load(tmp_path):
    """The settings only: their agreement with each other and the model is checked at start
    (`ParallelLayout.from_config`, tests/distributed/test_layout.py)."""
    cfg = load_config(
        _write(tmp_path, "student: {arch: tiny-llama}\n"),
        [
            "student.parallel.pp=2",
            "student.parallel.pp_schedule=Interleaved1F1B",
            "student.parallel.pp_stages_per_rank=2",
        ],
    )
    p = cfg.student.parallel
    assert (p.pp, p.pp_schedule, p.pp_stages_per_rank) == (2, "Interleaved1F1B", 2)
    with pytest.raises(UserError, match=r"'interleaved' is not one of .*'Interleaved1F1B'"):
        load_config(None, ["student.parallel.pp_schedule=interleaved"])


def test_missing_required_field():
    from dataclasses import dataclass

    @dataclass
    class Needs:
        name: str
        size: int = 1

    with pytest.raises(UserError, match=r"missing required config key 'name' \(str\)"):
        load_config(None, ["size=2"], schema=Needs)


def test_bad_files_and_overrides(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(UserError, match="not valid YAML"):
        load_config(_write(tmp_path, "train: {steps: [1,\n"))
    with pytest.raises(UserError, match="must look like key.sub=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(UserError, match="not a valid index"):
        load_config(None, ["teachers.5.loss=jsd"])


def test_resolved_config_round_trips_as_json(tmp_path):
    cfg = load_config(None, ["student.arch=tiny-llama", "teachers.0.arch=tiny-qwen3"])
    save_config(cfg, tmp_path / "config.json")
    again = json.loads((tmp_path / "config.json").read_text())
    assert again == to_dict(cfg)
    assert again["teachers"][0]["arch"] == "tiny-qwen3"


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.student.path or cfg.student.arch
    assert cfg.teachers, f"{path.name} names no teacher"


def _loss_config(loss: str, top_k: int, vocab_s: int, vocab_t: int, **teacher):
    from crossdistill.config import Config, from_dict

    def model(vocab: int) -> dict:
        return {"arch": "tiny-llama", "tokenizer": "t", "overrides": {"vocab_size": vocab}}

    return from_dict(
        Config,
        {
            "student": model(vocab_s),
            "teachers": [{**model(vocab_t), "loss": loss, "top_k": top_k, **teacher}],
            "data": {"train": ["x.jsonl"]},
        },
    )


@pytest.mark.parametrize(
    "loss,top_k,vocab_s,vocab_t,message",
    [
        ("uld", 65, 64, 500, "exceeds the student's vocabulary of 64 ids"),
        ("gold", 100, 64, 500, "exceeds the student's vocabulary of 64 ids"),
        ("forward_kl", 64, 64, 500, "can cover all 64 student ids"),
        ("gold", 64, 64, 500, "can cover all 64 student ids"),
        ("hkl", 100, 64, 500, "exceeds the student's vocabulary of 64 ids"),
        ("hkl", 64, 64, 500, "can cover all 64 student ids"),
        ("jsd", 64, 64, 500, None),  # bounded: the tail's mass needs no student bucket
        ("forward_kl", 600, 64, 500, None),  # the whole teacher vocabulary: no tail mass
        ("forward_kl", 63, 64, 500, None),
        ("uld", 64, 64, 500, None),
    ],
)
def test_top_k_the_loss_cannot_use_is_refused_at_load(loss, top_k, vocab_s, vocab_t, message):
    from crossdistill.train.validate import validate_config

    cfg = _loss_config(loss, top_k, vocab_s, vocab_t)
    if message is None:
        validate_config(cfg)
        return
    with pytest.raises(UserError, match=message):
        validate_config(cfg)


@pytest.mark.parametrize(
    "loss,param,message",
    [("jsd", {"beta": 1.0}, "beta must be in"), ("skew_kl", {"alpha": -0.1}, "alpha must be in")],
)
def test_loss_parameters_are_checked_at_load(loss, param, message):
    from crossdistill.train.validate import validate_config

    with pytest.raises(UserError, match=message):
        validate_config(_loss_config(loss, 8, 64, 64, **param))

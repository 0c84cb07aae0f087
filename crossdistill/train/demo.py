"""`crossdistill demo`: a real cross-tokenizer distillation on this machine's Python sources.

1. corpus: the standard library's `.py` files, held-out split by file;
2. two different tokenizers trained on it (byte-level BPE for the teacher, a SentencePiece-style
   BPE with byte fallback for the student);
3. a small teacher trained with CE on its tokenizer and all the training text, each file cut
   into pieces of about `DEMO["teacher_piece_chars"]` at line ends (cached in OUT/teacher);
4. two students on the student tokenizer with equal compute and the first
   `DEMO["student_bytes"]` of the same text (in epochs: a student distilled on less text than its
   teacher saw, the usual case): CE only, and CE + cross-tokenizer KD from the teacher;
5. held-out bits per byte of the three over every held-out file, plots, and OUT/summary.json.

Every stage is an ordinary `crossdistill train` run (its config saved in its run folder).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Literal

from crossdistill.config import Config, from_dict, to_dict
from crossdistill.errors import UserError

# Sizes chosen so the whole demo runs in a few minutes on 2 CPU cores (the measured time:
# benchmarks/README.md, "The demo (CPU)").
DEMO = {
    "seq_len": 256,
    # The teacher reads its 3 MB about once, the students their 150 kB about 20 times. KD's
    # margin needs both: students with too few steps take little from a better teacher, and
    # students with many steps catch up with a weaker one (the settings measured, seed by seed:
    # benchmarks/README.md, "The demo (CPU)")
    "teacher": {
        "hidden_size": 192,
        "intermediate_size": 512,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "steps": 1000,
        "micro_batch_size": 4,
        "lr": 1e-3,
    },
    "student": {
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "steps": 250,
        "micro_batch_size": 16,
        "lr": 2e-3,
    },
    "student_bytes": 150_000,  # of the teachers' 3 MB, as `student_text` takes it
    # "files": the first whole files of the (shuffled) training text, up to the first one that
    # does not fit in `student_bytes` (60-147 kB over 16 seeds); "filled": the same, passing
    # over the files that do not fit until `student_bytes` is full; "pieces": every training
    # file cut at line ends into pieces of about `student_piece_chars` characters,
    # `student_bytes` of them taken at an even stride
    "student_text": "files",
    "student_piece_chars": 2048,
    # the teacher's text: every training file cut at line ends into pieces of about this many
    # characters, which the loader shuffles apart, so that a step of 4 rows reads several files;
    # of whole files, a few steps in a row read one file and the last steps, at the lowest
    # rates, a few files. 0: whole files (benchmarks/README.md, "The demo's teacher on pieces of
    # its files")
    "teacher_piece_chars": 1024,
    "kd_ratio": 0.5,
    "top_k": 32,
    "eval_batches": 16,  # the runs' own validation; the summary scores every held-out file
}
QUICK = {"teacher_steps": 6, "student_steps": 4, "eval_batches": 2}


def _model(size: dict[str, Any], tokenizer: Path, vocab: int) -> dict[str, Any]:
    arch_keys = (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    )
    overrides = {k: size[k] for k in arch_keys}
    overrides["vocab_size"] = (vocab + 63) // 64 * 64
    overrides["tie_word_embeddings"] = True
    return {
        "arch": "tiny-llama",
        "tokenizer": str(tokenizer),
        "dtype": "float32",
        "overrides": overrides,
    }


def stage_config(
    out: Path,
    name: str,
    model: dict[str, Any],
    steps: int,
    lr: float,
    seed: int,
    eval_batches: int,
    teachers: list[dict[str, Any]] | None = None,
    train_file: str = "train.jsonl",
    *,
    batch: int,
) -> Config:
    """One stage of the demo as a `crossdistill train` config: `model` trained `steps` steps of
    `batch` sequences of `DEMO["seq_len"]` tokens on OUT/data/`train_file`, with `teachers`."""
    raw = {
        "student": model,
        "teachers": teachers or [],
        "data": {
            "train": [str(out / "data" / train_file)],
            "validation": [str(out / "data" / "val.jsonl")],
            "seq_len": DEMO["seq_len"],
            "micro_batch_size": batch,
            "num_workers": 0,
            "seed": seed,
        },
        "optim": {"lr": lr, "warmup_steps": max(1, steps // 20), "weight_decay": 0.05},
        "train": {
            "steps": steps,
            "kd_ratio": DEMO["kd_ratio"] if teachers else 0.0,
            "seed": seed,
            "eval_every": steps,
            "eval_batches": eval_batches,
            "checkpoint_every": steps,
            "log_every": max(1, steps // 20),
            "device": "cpu",
            "loss_chunk_size": 512,
        },
        "run": {"out_dir": str(out / name), "tensorboard": True},
    }
    return from_dict(Config, raw)


STUDENT_TEXT = "student_train.jsonl"
TEACHER_TEXT = "teacher_train.jsonl"
StudentText = Literal["files", "filled", "pieces"]


def student_share(train: list[str], num_bytes: int, how: StudentText | None = None) -> list[str]:
    """The students' text, about `num_bytes` of the teachers' `train` (`DEMO["student_text"]`):
    its first whole files that fit (a seed whose first file is large reads mostly that file, or
    stops short of `num_bytes` where the next one does not fit), the same passing over the files
    that do not fit until it is full (`filled`), or pieces of every file taken at an even
    stride through it (pieces of tens of files, each seed's a sample of the whole)."""
    from crossdistill.data.documents import spread_pieces, text_pieces
    from crossdistill.train.audit import first_bytes

    how = how or DEMO["student_text"]
    if how == "files":
        return first_bytes(train, num_bytes, within=True)
    if how == "filled":  # whole files, passing over those that do not fit, until full
        kept, size = [], 0
        for text in train:
            n = len(text.encode())
            if size + n <= num_bytes:
                kept.append(text)
                size += n
        return kept or train[:1]
    if how != "pieces":
        raise UserError(f"student text {how!r}: give 'files', 'filled' or 'pieces'")
    pieces = [p for text in train for p in text_pieces(text, DEMO["student_piece_chars"])]
    return spread_pieces(pieces, num_bytes)


def teacher_text(train: list[str], piece_chars: int) -> list[str]:
    """The teacher's text: every file of `train` cut at line ends into pieces of about
    `piece_chars` characters (`DEMO["teacher_piece_chars"]`), in file order (the loader shuffles
    them); `train` itself when `piece_chars` is 0."""
    from crossdistill.data.documents import text_pieces

    if piece_chars == 0:
        return list(train)
    return [piece for text in train for piece in text_pieces(text, piece_chars)]


def write_texts(path: Path, texts: list[str]) -> None:
    """`texts` as a JSONL file of `{"text": ...}` rows."""
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def _write_corpus(
    out: Path, seed: int, root: Path | None = None
) -> tuple[list[str], list[str], list[str]]:
    """OUT/data: the training files whole (`train.jsonl`), the teacher's text (`TEACHER_TEXT`:
    the same files in pieces), the students' (`student_share` of the whole files) and the
    held-out files, from the `.py` files under `root` (default: this interpreter's standard
    library); returns the training files, the held-out files and the students' text."""
    from crossdistill.train.demo_assets import stdlib_corpus

    train, val = stdlib_corpus(seed=seed, root=root)
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    student = student_share(train, DEMO["student_bytes"])
    write_texts(data / "train.jsonl", train)
    write_texts(data / TEACHER_TEXT, teacher_text(train, DEMO["teacher_piece_chars"]))
    write_texts(data / STUDENT_TEXT, student)
    write_texts(data / "val.jsonl", val)
    return train, val, student


def run_stage(cfg: Config, reuse: bool) -> dict[str, float]:
    from crossdistill.train.loop import train

    run_dir = Path(cfg.run.out_dir)
    summary = run_dir / "final_metrics.json"
    saved = run_dir / "config.json"
    same = saved.is_file() and _same_run(_saved_config(saved), to_dict(cfg))
    if reuse and same and summary.is_file() and (run_dir / "final" / "config.json").is_file():
        return json.loads(summary.read_text())
    if run_dir.exists():
        shutil.rmtree(run_dir)
    final = train(cfg)
    summary.write_text(json.dumps(final, indent=2))
    return final


# teacher settings added with a default that is not what runs saved before them did: the value
# those runs ran under, filled in where a saved teacher of a lookahead target (or `auto`, which
# may resolve to one) lacks the key, so that they are not taken for runs at today's default
TEACHER_SETTINGS_BEFORE = {"many_chunks": "first_piece"}
# the same for settings of every teacher, whatever its target
EVERY_TEACHER_BEFORE = {"boundary": "ignore"}


# run settings that change what a run shows, not what it trains
DISPLAY_SETTINGS = ("progress",)


def _same_run(saved: dict[str, Any] | None, cfg: dict[str, Any]) -> bool:
    """Whether a saved config (`_saved_config`) trains what `cfg` trains: equal but for
    `DISPLAY_SETTINGS` (a run trained with progress bars is the same run without them)."""
    if saved is None:
        return False

    def trained(raw: dict[str, Any]) -> dict[str, Any]:
        run = {k: v for k, v in raw.get("run", {}).items() if k not in DISPLAY_SETTINGS}
        return {**raw, "run": run}

    return trained(saved) == trained(cfg)


def _saved_config(path: Path) -> dict[str, Any] | None:
    """A run's saved config with the settings added since filled in: the defaults, or, for
    those in `TEACHER_SETTINGS_BEFORE` and `EVERY_TEACHER_BEFORE`, the values runs had before
    them (None: it no longer loads)."""
    from crossdistill.losses import TARGET_KINDS

    try:
        raw = json.loads(path.read_text())
        for teacher in raw.get("teachers") or []:
            if not isinstance(teacher, dict):
                continue
            target = teacher.get("target", "auto")
            if target == "auto" or (target in TARGET_KINDS and TARGET_KINDS[target].lookahead):
                for key, value in TEACHER_SETTINGS_BEFORE.items():
                    teacher.setdefault(key, value)
            for key, value in EVERY_TEACHER_BEFORE.items():
                teacher.setdefault(key, value)
        return to_dict(from_dict(Config, raw))
    except (UserError, ValueError):
        return None


def heldout_bpb(run_dir: Path, val: Path, max_batches: int | None = None) -> float:
    """Bits per byte of a run's final model over every file of `val` (or its first
    `max_batches` batches), packed as validation packs them (the runs' own validation reads its
    first `eval_batches` batches only)."""
    from crossdistill.eval.bpb import bits_per_byte
    from crossdistill.eval.model import load_eval_model

    model = load_eval_model(str(run_dir / "final"), device="cpu")
    return bits_per_byte(
        model, [str(val)], seq_len=DEMO["seq_len"], batch_size=8, max_batches=max_batches
    )["bpb"]


def run_demo(out_dir: str | Path, seed: int = 0, quick: bool = False) -> dict[str, float]:
    from crossdistill.models import load_tokenizer
    from crossdistill.train.demo_assets import train_demo_tokenizers
    from crossdistill.train.plot import plot_run

    t0 = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    print(f"[demo] corpus: Python standard library sources -> {out / 'data'}")
    train_texts, val_texts, student_texts = _write_corpus(out, seed)
    print(f"[demo] {len(train_texts)} training files, {len(val_texts)} held-out files")
    student_tok, teacher_tok = train_demo_tokenizers(
        train_texts, out / "tokenizers", val_texts=val_texts[:20]
    )
    v_s, v_t = len(load_tokenizer(str(student_tok))), len(load_tokenizer(str(teacher_tok)))
    print(
        f"[demo] tokenizers: teacher byte-level BPE ({v_t} tokens), student SentencePiece-style BPE ({v_s})"
    )
    t_steps = QUICK["teacher_steps"] if quick else DEMO["teacher"]["steps"]
    s_steps = QUICK["student_steps"] if quick else DEMO["student"]["steps"]
    evals = QUICK["eval_batches"] if quick else DEMO["eval_batches"]

    teacher_cfg = stage_config(
        out,
        "teacher",
        _model(DEMO["teacher"], teacher_tok, v_t),
        t_steps,
        DEMO["teacher"]["lr"],
        seed,
        evals,
        train_file=TEACHER_TEXT,
        batch=DEMO["teacher"]["micro_batch_size"],
    )
    print(
        f"[demo] 1/3 teacher: {t_steps} steps of CE on its own tokenizer, the training files in "
        f"pieces of about {DEMO['teacher_piece_chars']} characters (cached after the first run)"
    )
    teacher = run_stage(teacher_cfg, reuse=not quick)
    student_model = _model(DEMO["student"], student_tok, v_s)
    ce_cfg = stage_config(
        out,
        "student_ce",
        student_model,
        s_steps,
        DEMO["student"]["lr"],
        seed,
        evals,
        train_file=STUDENT_TEXT,
        batch=DEMO["student"]["micro_batch_size"],
    )
    kb = sum(len(t.encode()) for t in student_texts) // 1000
    unit = "pieces" if DEMO["student_text"] == "pieces" else "whole files"
    print(
        f"[demo] 2/3 student, CE only: {s_steps} steps on {kb} kB of the text "
        f"({len(student_texts)} {unit})"
    )
    ce_only = run_stage(ce_cfg, reuse=False)
    teacher_entry = {
        "name": "teacher",
        "path": str(out / "teacher" / "final"),
        "dtype": "float32",
        "loss": "forward_kl",
        "top_k": DEMO["top_k"],
        "temperature": 1.0,
    }
    kd_cfg = stage_config(
        out,
        "student_kd",
        student_model,
        s_steps,
        DEMO["student"]["lr"],
        seed,
        evals,
        teachers=[teacher_entry],
        train_file=STUDENT_TEXT,
        batch=DEMO["student"]["micro_batch_size"],
    )
    print(f"[demo] 3/3 student, CE + cross-tokenizer KD: {s_steps} steps, the same text")
    distilled = run_stage(kd_cfg, reuse=False)
    for name in ("teacher", "student_ce", "student_kd"):
        plot_run(out / name)
    print("[demo] scoring the three on every held-out file")
    val = out / "data" / "val.jsonl"
    limit = evals if quick else None
    scores = {n: heldout_bpb(out / n, val, limit) for n in ("teacher", "student_ce", "student_kd")}

    summary = {
        "teacher_bpb": scores["teacher"],
        "ce_only_bpb": scores["student_ce"],
        "distilled_bpb": scores["student_kd"],
        "validation_batches_bpb": {  # the runs' own validation (its first batches)
            "teacher": teacher["val/bpb/student"],
            "ce_only": ce_only["val/bpb/student"],
            "distilled": distilled["val/bpb/student"],
        },
        "teacher_bpb_seen_by_kd_run": distilled.get("val/bpb/teacher"),
        "seconds": round(time.perf_counter() - t0, 1),
        "seed": seed,
        "quick": quick,
    }
    summary["kd_change"] = summary["distilled_bpb"] / summary["ce_only_bpb"] - 1
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print_table(summary, out)
    return summary


def _print_table(summary: dict[str, Any], out: Path) -> None:
    rows = [
        ("teacher (byte-level BPE)", summary["teacher_bpb"]),
        ("student, CE only", summary["ce_only_bpb"]),
        ("student, CE + KD", summary["distilled_bpb"]),
    ]
    print("\nheld-out bits per byte, every held-out file (lower is better)")
    for label, value in rows:
        print(f"  {label:28s} {value:.4f}")
    change = summary["kd_change"]
    if change < 0:
        print(f"\nKD: {-change:.1%} fewer bits per byte than CE only")
    else:
        # a result, not a failure: the per-seed table in the README shows where this happens
        print(
            f"\nKD: {change:.1%} more bits per byte than CE only on this seed (README, 'The "
            "demo': the seeds measured)"
        )
    print(f"\n{summary['seconds']:.0f} s; runs, plots and summary.json in {out}")

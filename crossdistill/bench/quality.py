"""`crossdistill bench quality`: does distillation across tokenizers teach as much as distillation
from a teacher with the student's own tokenizer? A controlled experiment on a corpus.

1. The corpus is cut into pieces and split once into training and held-out text (the split does
   not depend on the seed, so every run is scored on the same bytes).
2. Teachers, one per `--teacher-tokenizer` plus one on the student's tokenizer (the
   same-tokenizer reference): the same architecture, the same steps, the same bytes of text per
   step (each teacher's sequence length is scaled by its tokenizer's bytes per token on this
   corpus), CE only, from scratch. They differ only in the tokenizer. Cached by a hash of their
   config, the corpus and the tokenizer, so a rerun of the student cells does not retrain them.
3. Students of one architecture, steps and data order, for every seed: CE only, same-tokenizer
   KD, and cross-tokenizer KD for every teacher tokenizer, `--loss` and `--target`.
4. Held-out bits per byte (mean ± standard deviation over seeds) and the gap closed,
   (CE only − cross KD) / (CE only − same-tokenizer KD), per seed, then mean ± std.

The comparison is refused, with a one-line reason, when it cannot say anything: fewer than two
seeds, teachers further apart than `--max-teacher-spread`, a teacher less than
`--min-teacher-gain` better than the CE-only student, or same-tokenizer KD not better than CE only
on every seed (the gap would be undefined, or a ratio of noise). A same-tokenizer gain under
`--min-same-gain` (5%) is reported with a warning: the comparison stands, near the noise. Every
finished cell is appended
to OUT/cells.jsonl and OUT/summary.json is rewritten, so a long run can be followed while it goes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from crossdistill.bench import library_versions
from crossdistill.bench.quality_corpus import (
    PIECE_BYTES,
    bytes_per_token,
    share_path,
    write_corpus,
)
from crossdistill.bench.quality_report import Cell, plot_report, print_table, summarize
from crossdistill.config import (
    DISTRIBUTION_LOSSES,
    LOSSES,
    TARGETS,
    Config,
    TeacherConfig,
    from_dict,
    to_dict,
)
from crossdistill.errors import UserError

ARCH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


@dataclass(frozen=True)
class Scale:
    """Model sizes, steps and batch shapes of one experiment size. Teachers are trained on
    more text than the students (more steps, bigger batches), as a teacher would be."""

    teacher: dict[str, int]
    student: dict[str, int]
    teacher_steps: int
    student_steps: int
    seq_len: int  # the student's, and the same-tokenizer teacher's
    teacher_batch: int
    student_batch: int
    teacher_lr: float
    student_lr: float
    train_bytes: int  # of the corpus, at most
    val_bytes: int
    device: str
    num_workers: int = 0
    teacher_accum: int = 1  # micro-batches of teacher_batch sequences per teacher step
    jobs: int = 1  # runs at once: small models leave a GPU mostly idle, so several share it
    # the students' training text: this many bytes of the teachers', spread through it (epochs
    # repeat over it), as a student is distilled on less text than its teacher saw; None: all
    student_train_bytes: int | None = None


def teacher_shape(width: int, layers: int) -> dict[str, int]:
    """A teacher `width` wide and `layers` deep, shaped as the gpu scale's: 64-wide attention
    heads, a quarter of them for keys and values, an MLP 2.75 times the width."""
    if width < 64 or width % 64 or layers < 1:
        raise UserError(
            f"--teacher-size {width}x{layers}: give WIDTHxLAYERS with a width that is a multiple "
            "of 64 and at least one layer, e.g. 512x8"
        )
    return dict(
        hidden_size=width,
        intermediate_size=width * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=width // 64,
        num_key_value_heads=max(1, width // 256),
    )


def parse_teacher_size(text: str) -> dict[str, int]:
    """`--teacher-size`'s `WIDTHxLAYERS` (e.g. `512x8`) as `teacher_shape`."""
    width, _, layers = text.lower().partition("x")
    if not (width.isdigit() and layers.isdigit()):
        raise UserError(f"--teacher-size {text!r} is not WIDTHxLAYERS: give e.g. 512x8")
    return teacher_shape(int(width), int(layers))


SCALES: dict[str, Scale] = {
    # a smoke run of every stage (seconds): for tests and a first look at a new corpus
    "quick": Scale(
        teacher=dict(
            hidden_size=96,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        student=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        teacher_steps=60,
        student_steps=12,
        seq_len=64,
        teacher_batch=4,
        student_batch=2,
        teacher_lr=3e-3,
        student_lr=3e-3,
        train_bytes=400_000,
        val_bytes=20_000,
        device="cpu",
    ),
    # tiny models on 2 CPU cores
    "cpu": Scale(
        teacher=dict(
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        student=dict(
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        teacher_steps=400,
        student_steps=150,
        seq_len=128,
        teacher_batch=8,
        student_batch=4,
        teacher_lr=2e-3,
        student_lr=3e-3,
        train_bytes=6_000_000,
        val_bytes=100_000,
        device="cpu",
    ),
    # one H100/H200 (timings in benchmarks/README.md): teachers over 10x the student's
    # parameters, trained on 4x its tokens. Student lr 1e-3, not 2e-3: at 2e-3 identical runs
    # of one seed disagree by more than a KD effect (benchmarks/student_noise.py). Students
    # distil on 1 MB of the teachers' text, in epochs: on all of it, a teacher adds
    # too little to the student's early training to compare losses by
    "gpu": Scale(
        teacher=dict(
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=4,
        ),
        student=dict(
            hidden_size=192,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
        ),
        teacher_steps=600,
        student_steps=300,
        seq_len=1024,
        teacher_batch=16,
        student_batch=16,
        teacher_lr=1e-3,
        student_lr=1e-3,
        train_bytes=200_000_000,
        val_bytes=1_000_000,
        device="cuda",
        num_workers=2,
        teacher_accum=2,
        jobs=5,
        student_train_bytes=1_000_000,
    ),
}


@dataclass
class QualitySpec:
    """One experiment: what `crossdistill bench quality` was asked, checked once by `check`."""

    student_tokenizer: str
    teacher_tokenizers: list[str]
    out: Path
    scale_name: str = "cpu"
    scale: Scale = field(default_factory=lambda: SCALES["cpu"])
    corpora: list[str] = field(default_factory=list)  # empty: the demo's corpus
    seeds: int = 5
    losses: list[str] = field(default_factory=lambda: [TeacherConfig.loss])
    targets: list[str] = field(default_factory=lambda: [TeacherConfig.target])
    kd_ratio: float = 0.5
    top_k: int = TeacherConfig.top_k
    temperature: float = TeacherConfig.temperature
    max_teacher_spread: float = 0.03
    min_teacher_gain: float = 0.10
    min_same_gain: float = 0.05  # under it, a warning: the gap to close is near the noise
    keep_going: bool = False  # train every cell even when the comparison is refused
    jobs: int = 1  # runs trained at once, each in a process of its own when above 1

    def check(self) -> None:
        if self.seeds < 2:
            raise UserError(
                f"--seeds {self.seeds}: a spread needs at least 2 seeds (5 or more to compare "
                "losses); pass --seeds 5"
            )
        if not self.teacher_tokenizers:
            raise UserError("give at least one --teacher-tokenizer (a tokenizer folder)")
        for name in self.losses:
            if name not in LOSSES:
                raise UserError(f"unknown --loss {name!r}; use one of {', '.join(LOSSES)}")
        for name in self.targets:
            if name not in TARGETS:
                raise UserError(f"unknown --target {name!r}; use one of {', '.join(TARGETS)}")
        for name in sorted(set(self.targets) - {"auto", "first_piece"}):
            if set(self.losses) - set(DISTRIBUTION_LOSSES):
                raise UserError(
                    f"--target {name} applies to the projected losses only "
                    f"({', '.join(DISTRIBUTION_LOSSES)}); run other losses without it"
                )
        if not 0.0 < self.kd_ratio <= 1.0:
            raise UserError(f"--kd-ratio must be in (0, 1], got {self.kd_ratio}")
        if self.jobs < 1:
            raise UserError(f"--jobs must be at least 1, got {self.jobs}")
        if self.max_teacher_spread < 0:
            raise UserError(
                f"--max-teacher-spread is a fraction (0.03 for 3%), got {self.max_teacher_spread}"
            )
        for flag, value in (
            ("--min-teacher-gain", self.min_teacher_gain),
            ("--min-same-gain", self.min_same_gain),
        ):
            if not 0.0 <= value < 1.0:
                raise UserError(f"{flag} is a fraction in [0, 1) (0.05 for 5%), got {value}")
        if self.top_k < 1 or self.temperature <= 0:
            raise UserError("--top-k must be at least 1 and --temperature above 0")
        for path in [self.student_tokenizer, *self.teacher_tokenizers, *self.corpora]:
            if not Path(path).exists():
                raise UserError(f"{path} does not exist; give a local tokenizer folder or corpus")
        student = Path(self.student_tokenizer).resolve()
        for path in self.teacher_tokenizers:
            if Path(path).resolve() == student:
                raise UserError(
                    f"--teacher-tokenizer {path} is the student's tokenizer; the same-tokenizer "
                    "teacher is always trained as the reference, so give other tokenizers only"
                )


# ----------------------------------------------------------------------------- corpus


SAME_LOSS = "forward_kl"  # the same-tokenizer reference: plain top-k KL, nothing to project


def student_train_file(data: Path, scale: Scale) -> Path:
    """The students' training JSONL in the corpus folder `data`."""
    if scale.student_train_bytes is None:
        return data / "train.jsonl"
    return share_path(data, scale.student_train_bytes)


# ----------------------------------------------------------------------------- runs


def tokenizer_label(path: str) -> str:
    """`…/qwen3/hf` → `qwen3`; `…/my-tok` → `my-tok`."""
    p = Path(path).resolve()
    return p.parent.name if p.name == "hf" else p.name


def model_entry(size: dict[str, int], tokenizer: str, vocab: int) -> dict[str, Any]:
    overrides: dict[str, Any] = {k: size[k] for k in ARCH_KEYS}
    overrides["vocab_size"] = (vocab + 63) // 64 * 64
    overrides["tie_word_embeddings"] = True
    return {
        "arch": "tiny-llama",
        "tokenizer": tokenizer,
        "dtype": "float32",
        "overrides": overrides,
    }


def run_config(
    spec: QualitySpec,
    data: Path,
    run_dir: Path,
    model: dict[str, Any],
    *,
    steps: int,
    lr: float,
    seq_len: int,
    batch: int,
    seed: int,
    teachers: list[dict[str, Any]] | None = None,
    progress: bool = True,
    accum: int = 1,
    train_file: Path | None = None,
) -> Config:
    """One training run; `train_file` (default: all of the training text) is what it reads."""
    s = spec.scale
    raw = {
        "student": model,
        "teachers": teachers or [],
        "data": {
            "train": [str(train_file or data / "train.jsonl")],
            "validation": [str(data / "val.jsonl")],
            "seq_len": seq_len,
            "micro_batch_size": batch,
            "num_workers": s.num_workers,
            "seed": seed,
        },
        "optim": {"lr": lr, "warmup_steps": max(1, steps // 20), "weight_decay": 0.05},
        "train": {
            "steps": steps,
            "grad_accum": accum,
            "kd_ratio": spec.kd_ratio if teachers else 0.0,
            "seed": seed,
            "eval_every": steps,
            "eval_batches": 1 << 30,  # the whole held-out split
            "checkpoint_every": steps,
            "keep_last": 1,
            "log_every": max(1, steps // 50),
            "device": s.device,
            "loss_chunk_size": 1024,
        },
        "run": {"out_dir": str(run_dir), "tensorboard": False, "progress": progress},
    }
    return from_dict(Config, raw)


def config_hash(cfg: Config, *extra: str) -> str:
    """Twelve hex digits of the config (its output folder left out) and `extra`."""
    raw = to_dict(cfg)
    raw["run"].pop("out_dir")
    payload = json.dumps(raw, sort_keys=True) + "\0".join(extra)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclass
class Job:
    """One training run of the experiment and what to do with its held-out bits per byte."""

    cell: str
    seed: int | None
    cfg: Config
    describe: str
    on_done: Callable[[float], None]
    bpb: float | None = None

    def done(self, bpb: float) -> None:
        self.bpb = bpb
        self.on_done(bpb)


def chosen_target(cfg: Config) -> str:
    """What `target: auto` of the run `cfg`'s one teacher chooses, as the run will."""
    from crossdistill.models import load_tokenizer
    from crossdistill.train.auto_target import resolve_targets

    tok_s = load_tokenizer(cfg.student.tokenizer or cfg.student.path)
    tok_t = load_tokenizer(cfg.teachers[0].tokenizer or cfg.teachers[0].path)
    return resolve_targets(cfg, tok_s, [tok_t])[0][0].target


def train_one(raw: dict[str, Any]) -> float:
    """One run in a process of its own (`--jobs` above 1): its held-out bits per byte."""
    from crossdistill.train.demo import run_stage

    return run_stage(from_dict(Config, raw), reuse=True)["val/bpb/student"]


def train_many(cfgs: dict[Any, Config], jobs: int) -> Iterator[tuple[Any, float]]:
    """Train every config, `jobs` at a time, each in a fresh spawned process (no CUDA state
    crosses a fork); yields `(key, held-out bits per byte)` as each run finishes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, context, max_tasks_per_child=1) as pool:
        futures = {pool.submit(train_one, to_dict(cfg)): key for key, cfg in cfgs.items()}
        for future in as_completed(futures):
            yield futures[future], future.result()


class Experiment:
    """Runs the cells of a `QualitySpec` in order, reusing every finished run."""

    def __init__(self, spec: QualitySpec, log: Callable[[str], None] = print):
        spec.check()
        self.spec = spec
        self.log = log
        self.out = spec.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.same_label = tokenizer_label(spec.student_tokenizer)
        self.labels = {}
        for path in spec.teacher_tokenizers:
            label = tokenizer_label(path)
            while label in self.labels.values() or label == self.same_label:
                label += "'"
            self.labels[path] = label
        self.cells = [Cell("ce"), Cell("same", self.same_label, SAME_LOSS)]
        for label in self.labels.values():
            for loss, target in [(lo, ta) for lo in spec.losses for ta in spec.targets]:
                suffix = "" if target == TeacherConfig.target else f"-{target}"
                self.cells.append(Cell(f"cross-{label}-{loss}{suffix}", label, loss, target))
        self.teachers: dict[str, float] = {}
        self.teacher_paths: dict[str, Path] = {}
        self.teacher_info: dict[str, dict[str, Any]] = {}
        self.vocab: dict[str, int] = {}  # tokenizer path -> its size, once the corpus is written
        self.runs: dict[str, dict[int, float]] = {}
        self.chosen: dict[str, str] = {}  # cell -> what its `target: auto` chose
        self.t0 = time.perf_counter()

    def teacher_jobs(self) -> list[Job]:
        """Writes the corpus, then one teacher run per tokenizer, the student's first, each with
        the sequence length that gives it the same bytes of text per step."""
        from crossdistill.models import load_tokenizer

        s, spec = self.spec.scale, self.spec
        self.log(f"[quality] corpus -> {self.out / 'data'}")
        self.data, train_texts = write_corpus(
            self.out, spec.corpora, train_bytes=s.train_bytes, val_bytes=s.val_bytes,
            student_bytes=s.student_train_bytes,
        )  # fmt: skip
        self.vocab = {p: len(load_tokenizer(p)) for p in [spec.student_tokenizer, *self.labels]}
        bpt_ref = bytes_per_token(spec.student_tokenizer, train_texts)
        everyone = [(spec.student_tokenizer, self.same_label), *self.labels.items()]
        jobs = []
        for path, label in everyone:
            bpt = bpt_ref if path == spec.student_tokenizer else bytes_per_token(path, train_texts)
            seq_len = max(16, round(s.seq_len * bpt_ref / bpt / 8) * 8)
            jobs.append(self._teacher(path, label, self.vocab[path], seq_len, bpt))
        return jobs

    def run(self) -> dict[str, Any]:
        s, spec = self.spec.scale, self.spec
        self._run_all(self.teacher_jobs())
        report = self.report()
        if report["refused"] and not self.spec.keep_going:
            return report  # the teachers alone say the comparison cannot be made
        vocab = self.vocab[spec.student_tokenizer]
        student = model_entry(s.student, spec.student_tokenizer, vocab)
        seeds = range(spec.seeds)
        self._run_all([self._student(self.cells[0], student, seed) for seed in seeds])
        report = self.report()
        if report["refused"] and not self.spec.keep_going:
            return report
        # seed-major: a run stopped early still has every cell at its first seeds
        self._run_all([self._student(c, student, seed) for seed in seeds for c in self.cells[1:]])
        return self.report()

    def _run_all(self, jobs: list[Job]) -> None:
        """Train `jobs`, `spec.jobs` at a time (each in a process of its own when more than
        one), recording each as it finishes."""
        from crossdistill.train.demo import run_stage

        if self.spec.jobs == 1 or len(jobs) == 1:
            for job in jobs:
                self.log(f"[quality] {job.describe}")
                start = time.perf_counter()
                job.done(run_stage(job.cfg, reuse=True)["val/bpb/student"])
                self._record(job, start)
            return
        for job in jobs:
            self.log(f"[quality] {job.describe}")
        start = time.perf_counter()
        for i, bpb in train_many({i: job.cfg for i, job in enumerate(jobs)}, self.spec.jobs):
            jobs[i].done(bpb)
            self._record(jobs[i], start)

    def _teacher(self, path: str, label: str, vocab: int, seq_len: int, bpt: float) -> Job:
        from crossdistill.models.tokenizers import load_text_tokenizer, tokenizer_fingerprint

        s = self.spec.scale
        model = model_entry(s.teacher, path, vocab)
        probe = run_config(
            self.spec, self.data, self.out, model, steps=s.teacher_steps, lr=s.teacher_lr,
            seq_len=seq_len, batch=s.teacher_batch, seed=0, progress=self.spec.jobs == 1,
            accum=s.teacher_accum,
        )  # fmt: skip
        fingerprint = tokenizer_fingerprint(load_text_tokenizer(path))
        run_dir = self.out / "teachers" / f"{label}-{config_hash(probe, fingerprint)}"
        cfg = replace(probe, run=replace(probe.run, out_dir=str(run_dir)))
        self.teacher_paths[label] = run_dir / "final"
        kind = "the student's tokenizer" if label == self.same_label else "cross"

        def done(bpb: float) -> None:
            self.teachers[label] = bpb
            self.teacher_info[label] = {
                "tokenizer": path,
                "bytes_per_token": bpt,
                "seq_len": seq_len,
                "bpb": bpb,
                "run": str(run_dir),
            }

        return Job(
            f"teacher-{label}",
            None,
            cfg,
            f"teacher {label} ({kind}): {s.teacher_steps} steps of "
            f"{s.teacher_batch * s.teacher_accum} x "
            f"{seq_len} tokens ({bpt:.2f} bytes per token)",
            done,
        )

    def _student(self, cell: Cell, student: dict[str, Any], seed: int) -> Job:
        s, spec = self.spec.scale, self.spec
        teachers = []
        if cell.teacher is not None:
            teachers = [
                {
                    "name": "teacher",
                    "path": str(self.teacher_paths[cell.teacher]),
                    "dtype": "bfloat16" if s.device.startswith("cuda") else "float32",
                    "loss": cell.loss,
                    "target": cell.target,
                    "top_k": spec.top_k,
                    "temperature": spec.temperature,
                }
            ]
        run_dir = self.out / "students" / cell.name / f"seed{seed}"
        cfg = run_config(
            spec, self.data, run_dir, student, steps=s.student_steps, lr=s.student_lr,
            seq_len=s.seq_len, batch=s.student_batch, seed=seed, teachers=teachers,
            progress=False, train_file=student_train_file(self.data, s),
        )  # fmt: skip

        cross = cell.teacher not in (None, self.same_label)
        if cross and cell.target == "auto" and cell.name not in self.chosen:
            self.chosen[cell.name] = chosen_target(cfg)

        def done(bpb: float) -> None:
            self.runs.setdefault(cell.name, {})[seed] = bpb

        return Job(cell.name, seed, cfg, f"student {cell.name} seed {seed}", done)

    def _record(self, job: Job, start: float) -> None:
        row: dict[str, Any] = {"cell": job.cell}
        if job.seed is not None:
            row["seed"] = job.seed
        row["bpb"] = job.bpb
        row["seconds"] = round(time.perf_counter() - start, 1)
        with open(self.out / "cells.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        where = f" seed {row['seed']}" if "seed" in row else ""
        self.log(
            f"[quality] {row['cell']}{where}: {row['bpb']:.4f} bits per byte ({row['seconds']} s)"
        )
        self.report()

    def report(self) -> dict[str, Any]:
        """The summary so far, also written to OUT/summary.json."""
        report = summarize(self.teachers, self.runs, self.cells, self.same_label, self.spec)
        for entry in report["cross"]:
            if entry["cell"] in self.chosen:
                entry["chosen_target"] = self.chosen[entry["cell"]]
        s = self.spec.scale
        report["teacher_runs"] = self.teacher_info
        report["settings"] = {
            "scale": self.spec.scale_name,
            "seeds": self.spec.seeds,
            "losses": self.spec.losses,
            "targets": self.spec.targets,
            "kd_ratio": self.spec.kd_ratio,
            "top_k": self.spec.top_k,
            "temperature": self.spec.temperature,
            "student_tokenizer": self.spec.student_tokenizer,
            "teacher_tokenizers": self.spec.teacher_tokenizers,
            "corpus": self.spec.corpora or ["python standard library (the demo's corpus)"],
            "teacher": {
                **s.teacher,
                "steps": s.teacher_steps,
                "batch": s.teacher_batch * s.teacher_accum,
                "lr": s.teacher_lr,
            },
            "student": {
                **s.student,
                "steps": s.student_steps,
                "batch": s.student_batch,
                "lr": s.student_lr,
                "train_bytes": s.student_train_bytes,
            },
            "seq_len": s.seq_len,
            "device": s.device,
            "versions": library_versions(),
        }
        report["seconds"] = round(time.perf_counter() - self.t0, 1)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(self.out / "summary.json")
        return report


# ----------------------------------------------------------------------------- command line

EXAMPLES = """examples:
  crossdistill bench quality --student-tokenizer $TOK/llama3/hf --teacher-tokenizer $TOK/qwen3/hf \\
      --teacher-tokenizer $TOK/llama2/hf --scale gpu --seeds 5 --out runs/quality
  crossdistill bench quality --corpus my.jsonl --student-tokenizer $TOK/llama3/hf \\
      --teacher-tokenizer $TOK/qwen3/hf --scale cpu --seeds 3 --loss forward_kl --loss gold --json
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "quality",
        help="how much cross-tokenizer KD teaches, against same-tokenizer KD and CE only",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--corpus",
        action="append",
        default=[],
        metavar="PATH",
        help="JSONL / text / Parquet corpus (repeatable; default: the demo's corpus)",
    )
    p.add_argument("--student-tokenizer", required=True, metavar="DIR")
    p.add_argument(
        "--teacher-tokenizer",
        action="append",
        default=[],
        metavar="DIR",
        required=True,
        help="a cross teacher's tokenizer (repeatable)",
    )
    p.add_argument("--scale", choices=sorted(SCALES), default="cpu")
    p.add_argument("--seeds", type=int, default=5, help="seeds per student cell (at least 2)")
    p.add_argument(
        "--loss",
        action="append",
        choices=LOSSES,
        default=None,
        help=f"cross-tokenizer KD loss (repeatable; default {TeacherConfig.loss})",
    )
    p.add_argument(
        "--target",
        action="append",
        choices=TARGETS,
        default=None,
        help=f"the projected losses' target (repeatable; default {TeacherConfig.target})",
    )
    p.add_argument("--kd-ratio", type=float, default=0.5)
    p.add_argument("--top-k", type=int, default=TeacherConfig.top_k)
    p.add_argument("--temperature", type=float, default=TeacherConfig.temperature)
    p.add_argument("--teacher-steps", type=int, default=None, help="override the scale's")
    p.add_argument("--student-steps", type=int, default=None, help="override the scale's")
    p.add_argument(
        "--teacher-size",
        default=None,
        metavar="WIDTHxLAYERS",
        help="override the scale's teachers, e.g. 512x8 (64-wide heads; cpu: 256x4, gpu: 1024x12)",
    )
    p.add_argument("--teacher-lr", type=float, default=None, help="override the scale's")
    p.add_argument("--student-lr", type=float, default=None, help="override the scale's")
    p.add_argument(
        "--student-bytes",
        type=int,
        default=None,
        metavar="N",
        help="students train on N bytes of the teachers' training text (whole pieces spread evenly "
        "through it), in epochs; "
        "0: all of it (default: the scale's; gpu: 1,000,000)",
    )
    p.add_argument("--device", default=None, help="override the scale's (cpu, cuda)")
    p.add_argument(
        "--max-teacher-spread",
        type=float,
        default=0.03,
        help="refuse when the teachers' bits per byte differ by more than this fraction",
    )
    p.add_argument(
        "--min-teacher-gain",
        type=float,
        default=0.10,
        help="refuse when a teacher is not this fraction better than the CE-only student",
    )
    p.add_argument(
        "--min-same-gain",
        type=float,
        default=0.05,
        help="warn when same-tokenizer KD is not this fraction better than CE only",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs trained at once, each in its own process (default: the scale's; gpu: 4)",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="train every student even when the comparison is refused (no gap closed is given)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/quality"))
    p.add_argument("--json", action="store_true", help="print one JSON object last on stdout")
    p.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> QualitySpec:
    scale = SCALES[args.scale]
    changes: dict[str, Any] = {}
    if args.teacher_steps is not None:
        changes["teacher_steps"] = args.teacher_steps
    if args.student_steps is not None:
        changes["student_steps"] = args.student_steps
    if args.device is not None:
        changes["device"] = args.device
    if args.teacher_size is not None:
        changes["teacher"] = parse_teacher_size(args.teacher_size)
    for key in ("teacher_lr", "student_lr"):
        value = getattr(args, key)
        if value is not None:
            if not 0 < value < 1:
                raise UserError(
                    f"--{key.replace('_', '-')} {value} is not a learning rate: give a value "
                    "between 0 and 1 (the scales use 1e-3 to 3e-3)"
                )
            changes[key] = value
    if args.student_bytes == 0:
        changes["student_train_bytes"] = None  # all of the teachers' text
    elif args.student_bytes is not None:
        if args.student_bytes < PIECE_BYTES:
            raise UserError(
                f"--student-bytes {args.student_bytes} is less than one piece of the corpus "
                f"({PIECE_BYTES} bytes); give at least {PIECE_BYTES}, or 0 for all of the text"
            )
        changes["student_train_bytes"] = args.student_bytes
    for key, value in changes.items():
        if key.endswith("steps") and value < 1:
            raise UserError(f"--{key.replace('_', '-')} must be at least 1, got {value}")
    return QualitySpec(
        student_tokenizer=args.student_tokenizer,
        teacher_tokenizers=list(args.teacher_tokenizer),
        out=args.out,
        scale_name=args.scale,
        scale=replace(scale, **changes),
        corpora=list(args.corpus),
        seeds=args.seeds,
        losses=list(dict.fromkeys(args.loss or [TeacherConfig.loss])),
        targets=list(dict.fromkeys(args.target or [TeacherConfig.target])),
        kd_ratio=args.kd_ratio,
        top_k=args.top_k,
        temperature=args.temperature,
        max_teacher_spread=args.max_teacher_spread,
        min_teacher_gain=args.min_teacher_gain,
        min_same_gain=args.min_same_gain,
        keep_going=args.keep_going,
        jobs=args.jobs if args.jobs is not None else scale.jobs,
    )


def run(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else print
    experiment = Experiment(spec, log=log)
    report = experiment.run()
    print_table(report, file=sys.stderr if args.json else sys.stdout)
    try:
        png = plot_report(spec.out, report, experiment.cells)
    except UserError as e:  # no matplotlib: the numbers are still there
        png = None
        log(f"[quality] no plot: {e}")
    if png is not None:
        log(f"[quality] curves: {png}")
    log(f"[quality] summary: {spec.out / 'summary.json'}")
    if args.json:
        print(json.dumps(report))
    return 1 if report["refused"] else 0

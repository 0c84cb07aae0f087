"""What `crossdistill bench quality` is asked: its scales (`Scale`, `SCALES`: model shapes,
steps, text and learning rates), the teachers' shape from `--teacher-size`, and the experiment's
settings (`QualitySpec`), checked once, at load. Imports `config`, `errors` and the corpus's
default piece size (`quality_corpus`) only; the experiment (`quality`) and its command line
(`quality_cli`) import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from crossdistill.bench.quality_corpus import PIECE_BYTES
from crossdistill.config import (
    DISTRIBUTION_LOSSES,
    LOSSES,
    TARGETS,
    Boundary,
    CEWithoutKD,
    DeepAlternatives,
    KDChunks,
    ManyChunks,
    PastEnd,
    SplitContext,
    TeacherConfig,
    TrainConfig,
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
    # KD students read each teacher's top-k from a cache built once over the students' and the
    # held-out text, instead of running the teacher at every step: it pays where the students
    # read their text many times over (the gpu scale's epochs), not where they read a sample of
    # a large text once (the cpu scale, whose build would cost more than its students' teacher)
    teacher_cache: bool = False
    # a `--corpus`'s documents are cut into pieces of about this many bytes (`quality_corpus`),
    # the rows the loader shuffles and the held-out split draws: a step's rows are filled in
    # order, so a step reads as many places in the corpus as the pieces it spans
    piece_bytes: int = PIECE_BYTES


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
    # tiny models on 2 CPU cores. Rates of 1e-3 and 800 teacher steps, not 2e-3 / 3e-3 and
    # 400: the KD gain then clears the students' seed-to-seed spread, so the far pair can be
    # compared and judged (benchmarks/README.md, "The cpu scale at rates of 1e-3 and 800
    # teacher steps"), at twice the teachers' time
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
        teacher_steps=800,
        student_steps=150,
        seq_len=128,
        teacher_batch=8,
        student_batch=4,
        teacher_lr=1e-3,
        student_lr=1e-3,
        train_bytes=6_000_000,
        val_bytes=100_000,
        device="cpu",
        # a teacher step is 8 rows of 128 tokens, about 4 kB: pieces of 16 kB gave each step a
        # quarter of one piece and its last steps a dozen pieces, and one tokenizer's teachers
        # ended up to 10% apart from seed to seed (benchmarks/README.md, "The cpu scale's
        # pieces")
        piece_bytes=1_024,
    ),
    # one H100/H200 (timings in benchmarks/README.md): teachers over 10x the student's
    # parameters, trained on 4x its tokens. Student lr 1e-3, not 2e-3: at 2e-3 identical runs
    # of one seed disagree by more than a KD effect (benchmarks/student_noise.py). Students
    # distil on 1 MB of the teachers' text, in epochs: on all of it, a teacher adds
    # too little to the student's early training to compare losses by; on less, the gain grows
    # only because the CE-only student overfits, and the KD students' outcomes scatter with it
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
        teacher_cache=True,
    ),
}


def target_parts(target: str) -> list[str]:
    """The targets of one `--target`: one name, or several joined by `+` (`A+B`), for a student
    that learns from the teacher in one KD term per target, each at an equal share of the KD
    weight: a target between them, measured without building one."""
    return target.split("+")


def target_terms(target: str) -> list[tuple[str, str]]:
    """(teacher name, target) of each KD term of one `--target`: `teacher` alone, or
    `teacher_<target>` per part of an `A+B`, so a pair's metrics name their targets."""
    parts = target_parts(target)
    return [("teacher" if len(parts) == 1 else f"teacher_{part}", part) for part in parts]


def cell_settings(losses: list[str], targets: list[str]) -> list[tuple[str, str]]:
    """The cross-tokenizer cells' (loss, target): every projected loss under every target, a
    loss without a projected target (`uld`, `gold`, `hkl`, `chunk_likelihood`) once, under the
    default target (which resolves to `first_piece` for it)."""
    return [
        (loss, target)
        for loss in losses
        for target in (targets if loss in DISTRIBUTION_LOSSES else [TeacherConfig.target])
    ]


@dataclass
class QualitySpec:
    """One experiment: what `crossdistill bench quality` was asked, checked once by `check`."""

    student_tokenizer: str
    teacher_tokenizers: list[str]
    out: Path
    scale_name: str = "cpu"
    scale: Scale = field(default_factory=lambda: SCALES["cpu"])
    corpora: list[str] = field(default_factory=list)  # empty: the demo's corpus
    text_field: str = "text"  # the corpus's JSONL field or table column holding the text
    seeds: int = 5
    # teachers trained per tokenizer, from seeds 0, 1, ...: every KD student learns from each,
    # so the report's spread and interval hold the teachers' run-to-run noise too
    teacher_seeds: int = 1
    losses: list[str] = field(default_factory=lambda: [TeacherConfig.loss])
    # the projected losses' targets: each such loss runs under each; the others run once
    targets: list[str] = field(default_factory=lambda: [TeacherConfig.target])
    # the cross cells' `kd_chunks`: each cross cell runs under each
    kd_chunks: list[str] = field(default_factory=lambda: [TeacherConfig.kd_chunks])
    # the cross cells' `past_end` (the targets that read past the student token's end): each
    # cross cell runs under each
    past_end: list[str] = field(default_factory=lambda: [TeacherConfig.past_end])
    # the cross cells' `many_chunks` (the lookahead targets): each cross cell runs under each
    many_chunks: list[str] = field(default_factory=lambda: [TeacherConfig.many_chunks])
    # the cross cells' `deep_alternatives` (the lookahead targets): each cross cell runs under each
    deep_alternatives: list[str] = field(default_factory=lambda: [TeacherConfig.deep_alternatives])
    # the cross cells' `boundary`: each cross cell runs under each
    boundary: list[str] = field(default_factory=lambda: [TeacherConfig.boundary])
    # the cross cells' `split_context` (`lookahead_split`): each cross cell runs under each
    split_context: list[str] = field(default_factory=lambda: [TeacherConfig.split_context])
    # the cross cells' `train.ce_without_kd`: each cross cell runs under each
    ce_without_kd: list[str] = field(default_factory=lambda: [TrainConfig.ce_without_kd])
    # the cross cells' `train.kd_warmup_steps`: each cross cell runs under each
    kd_warmup_steps: list[int] = field(default_factory=lambda: [TrainConfig.kd_warmup_steps])
    # the KD students' `train.kd_ratio`: the same-tokenizer and every cross cell run under each;
    # the first is the reference, whose same-tokenizer cell is the report's `same_kd`
    kd_ratios: list[float] = field(default_factory=lambda: [TrainConfig.kd_ratio])
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
        if self.teacher_seeds < 1:
            raise UserError(
                f"--teacher-seeds {self.teacher_seeds}: give at least 1 (2 puts the teachers' "
                "run-to-run noise in the report)"
            )
        if not self.teacher_tokenizers:
            raise UserError("give at least one --teacher-tokenizer (a tokenizer folder)")
        for name in self.losses:
            if name not in LOSSES:
                raise UserError(f"unknown --loss {name!r}; use one of {', '.join(LOSSES)}")
        for name in self.targets:
            parts = target_parts(name)
            for part in parts:
                if part not in TARGETS:
                    raise UserError(
                        f"unknown --target {part!r}; use one of {', '.join(TARGETS)}, or "
                        "several joined by + (lookahead_end+lookahead_prefix_end)"
                    )
            if len(set(parts)) != len(parts):
                raise UserError(f"--target {name}: a target twice; name each target once")
        for flag, names, kind in (
            ("--kd-chunks", self.kd_chunks, KDChunks),
            ("--past-end", self.past_end, PastEnd),
            ("--many-chunks", self.many_chunks, ManyChunks),
            ("--deep-alternatives", self.deep_alternatives, DeepAlternatives),
            ("--boundary", self.boundary, Boundary),
            ("--split-context", self.split_context, SplitContext),
            ("--ce-without-kd", self.ce_without_kd, CEWithoutKD),
        ):
            choices = get_args(kind)
            for name in names:
                if name not in choices:
                    raise UserError(f"unknown {flag} {name!r}; use one of {', '.join(choices)}")
        for steps in self.kd_warmup_steps:
            if not 0 <= steps <= self.scale.student_steps:
                raise UserError(
                    f"--kd-warmup-steps {steps}: give 0 (no warm-up) up to the students' "
                    f"{self.scale.student_steps} steps"
                )
        if not self.kd_ratios:
            raise UserError("give at least one --kd-ratio (0.5 is the default)")
        for ratio in self.kd_ratios:
            if not 0.0 < ratio <= 1.0:
                raise UserError(f"--kd-ratio must be in (0, 1], got {ratio}")
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
        if not self.text_field:
            raise UserError("--text-field is empty: give the JSONL field or column of the text")
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

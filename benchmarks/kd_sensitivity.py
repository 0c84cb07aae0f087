"""How the demo's distillation gain depends on the KD weight, the seed and the tokenizer pair.

The demo's setup (Python standard library corpus, two tokenizers trained on it, a small teacher,
two equal-compute students), run for several seeds with, per seed:

- the CE-only student;
- KD students at each `--kd-ratios` value from the demo's cross-tokenizer teacher (byte-level
  BPE teacher, SentencePiece-style student);
- the same KD students from a second teacher of the same size trained on the *student's*
  tokenizer: identical tokenizers, so the targets need no projection (1:1 chunks, identity
  projection). If KD at a given weight helps with this teacher and hurts with the
  cross-tokenizer one, the projection is to blame; if both hurt, the weight is.

Students train on the demo's first `student_bytes` of the teachers' text (`--student-bytes`).
Each run is scored twice: its own validation (the first `eval_batches` batches of the held-out
files, the `*_bpb` keys) and every held-out file (`*_heldout_bpb`, as the demo reports).

`--targets A+B` trains a student under two KD terms from the same teacher, one under target A
and one under B, each at half the weight: a target between the two, without a new one.

`--losses` runs other KD losses too (e.g. `chunk_likelihood`, which compares the likelihoods
of whole aligned chunks and needs no vocabulary projection). Prints one JSON object (held-out bits
per byte of every run) and writes it to `--out`/`kd_sensitivity.json`. Runs already made in
`--out` with the same config are reused. About 6 minutes per seed on 2 CPU cores:

    python benchmarks/kd_sensitivity.py --seeds 0 1 2 --kd-ratios 0.2 0.5 --out runs/kd
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import sys
import time
from pathlib import Path
from typing import get_args

# A run's key names its teacher's steps and its students' batch where they differ from these,
# the demo's settings until 2026-12-04 (since then 1000 and 16), so that one key means one
# setting in every results file
KEY_TEACHER_STEPS = 500
KEY_STUDENT_BATCH = 4

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def run_seed(
    out: Path,
    seed: int,
    kd_ratios: list[float],
    losses: tuple[str, ...] = ("forward_kl",),
    which: tuple[str, ...] = ("cross", "same"),
    targets: tuple[str, ...] = ("first_piece",),
    top_k: int | None = None,
    student_lr: float | None = None,
    student_bytes: int | None = None,
    teacher_steps: int | None = None,
    kd_chunks: tuple[str, ...] = ("all",),
    ce_without_kd: tuple[str, ...] = ("ratio",),
    kd_warmup_steps: tuple[int, ...] = (0,),
    student_steps: int | None = None,
    student_text: str | None = None,
    student_batch: int | None = None,
    source_root: Path | None = None,
    temperature: float = 1.0,
    teacher_piece_chars: int | None = None,
) -> dict:
    from crossdistill.bench.quality_spec import target_terms
    from crossdistill.config import DISTRIBUTION_LOSSES
    from crossdistill.models import load_tokenizer
    from crossdistill.train import demo
    from crossdistill.train.demo_assets import train_demo_tokenizers

    train_texts, val_texts, _ = demo._write_corpus(out, seed, source_root)
    student_tok, teacher_tok = train_demo_tokenizers(
        train_texts, out / "tokenizers", val_texts=val_texts[:20]
    )
    v_s, v_t = len(load_tokenizer(str(student_tok))), len(load_tokenizer(str(teacher_tok)))
    t, s = demo.DEMO["teacher"], demo.DEMO["student"]
    evals = demo.DEMO["eval_batches"]
    teachers = {
        "cross": demo._model(t, teacher_tok, v_t),  # the demo's teacher
        "same": demo._model(t, student_tok, v_s),  # the student's own tokenizer
    }
    result: dict = {"seed": seed}
    val = out / "data" / "val.jsonl"

    def score(cfg, key: str) -> None:
        """`key`: the run's validation (its first batches); `key` with `heldout`: every file."""
        result[f"{key}_bpb"] = demo.run_stage(cfg, reuse=True)["val/bpb/student"]
        result[f"{key}_heldout_bpb"] = demo.heldout_bpb(Path(cfg.run.out_dir), val)

    t_steps = teacher_steps or t["steps"]
    # teachers trained for other steps sit beside the demo's, and so do their students
    t_tag = "" if t_steps == KEY_TEACHER_STEPS else f"_t{t_steps}"
    # the teachers' text: the training files in pieces (the demo's, unless asked otherwise), or
    # whole (0); a key names the pieces, since the runs before 2026-12-05 read whole files
    pieces = (
        demo.DEMO["teacher_piece_chars"] if teacher_piece_chars is None else teacher_piece_chars
    )
    t_file = "train.jsonl"
    if pieces:
        t_tag += f"_p{pieces}"
        t_file = demo.TEACHER_TEXT
        if pieces != demo.DEMO["teacher_piece_chars"]:
            t_file = f"train_p{pieces}.jsonl"
            demo.write_texts(out / "data" / t_file, demo.teacher_text(train_texts, pieces))
    for name in which:  # only the teachers asked for
        model = teachers[name]
        cfg = demo.stage_config(
            out, f"teacher_{name}{t_tag}", model, t_steps, t["lr"], seed, evals,
            train_file=t_file, batch=t["micro_batch_size"],
        )  # fmt: skip
        score(cfg, f"teacher_{name}{t_tag}")
    student = demo._model(s, student_tok, v_s)
    lr = student_lr or s["lr"]
    lr_tag = "" if lr == s["lr"] else f"_lr{lr:g}"  # runs at another lr sit beside the demo's
    steps = student_steps or s["steps"]
    lr_tag += "" if steps == s["steps"] else f"_s{steps}"
    batch = student_batch or s["micro_batch_size"]
    lr_tag += "" if batch == KEY_STUDENT_BATCH else f"_mb{batch}"
    how = student_text or demo.DEMO["student_text"]
    if student_bytes:  # the students see N bytes of the teachers' text, as `how` takes them
        how_tag = "" if how == "files" else f"_{how}"
        lr_tag += f"_b{student_bytes}{how_tag}"
        text = out / "data" / f"train_{student_bytes}{how_tag}.jsonl"
        kept = demo.student_share(train_texts, student_bytes, how)
        text.write_text("".join(json.dumps({"text": t}) + "\n" for t in kept), encoding="utf-8")

    def student_stage(name: str, entries: list | None = None):
        cfg = demo.stage_config(out, name, student, steps, lr, seed, evals, entries, batch=batch)
        if student_bytes:
            cfg.data.train = [str(text)]
        return cfg

    score(student_stage(f"student_ce{lr_tag}"), f"ce_only{lr_tag}")
    k = top_k or demo.DEMO["top_k"]
    for name, loss, target, chunks, ce, warmup in itertools.product(
        which, losses, targets, kd_chunks, ce_without_kd, kd_warmup_steps
    ):
        if target != "first_piece" and loss not in DISTRIBUTION_LOSSES:
            continue  # the other targets change the projected losses only
        if name == "same" and (chunks, ce) != ("all", "ratio"):
            continue  # one tokenizer: every chunk one token on each side, nothing changes
        entry = {
            "name": "teacher",
            "path": str(out / f"teacher_{name}{t_tag}" / "final"),
            "dtype": "float32",
            "loss": loss,
            "target": target,
            "top_k": k,
            "temperature": temperature,
            "kd_chunks": chunks,
        }
        tag = name if loss == "forward_kl" else f"{name}_{loss}"
        tag += "" if target == "first_piece" else f"_{target}"
        tag += ("" if chunks == "all" else f"_{chunks}") + ("" if ce == "ratio" else f"_ce{ce}")
        tag += ("" if k == demo.DEMO["top_k"] else f"_k{k}") + ("" if not warmup else f"_w{warmup}")
        tag += "" if temperature == 1.0 else f"_T{temperature:g}"
        tag += t_tag + lr_tag
        # "A+B": one teacher read twice, under target A and under target B, each at weight 1/2
        terms = target_terms(target)
        entries = [
            {**entry, "name": name, "target": part, "weight": 1 / len(terms)}
            for name, part in terms
        ]
        for ratio in kd_ratios:
            cfg = student_stage(f"kd_{tag}_{ratio}", entries)
            cfg.train.kd_ratio = ratio
            cfg.train.ce_without_kd = ce
            cfg.train.kd_warmup_steps = warmup
            score(cfg, f"kd_{tag}_{ratio}")
    return result


def main() -> int:
    from crossdistill.bench.quality_spec import target_parts
    from crossdistill.config import CEWithoutKD, KDChunks, Target

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--kd-ratios", type=float, nargs="+", default=[0.2, 0.5])
    p.add_argument("--losses", nargs="+", default=["forward_kl"], help="KD losses to run")
    p.add_argument("--teachers", nargs="+", default=["cross", "same"], choices=["cross", "same"])
    p.add_argument(
        "--targets",
        nargs="+",
        default=["first_piece"],
        help="projected losses' targets; A+B: the same teacher in two KD terms of weight 1/2, "
        "one under target A and one under B",
    )
    for flag, kind, default, setting in (
        ("--kd-chunks", KDChunks, "all", "teachers.N.kd_chunks"),
        ("--ce-without-kd", CEWithoutKD, "ratio", "train.ce_without_kd"),
    ):
        p.add_argument(
            flag, nargs="+", default=[default], choices=get_args(kind),
            help=f"the cross students' {setting}",
        )  # fmt: skip
    p.add_argument(
        "--kd-warmup-steps",
        type=int,
        nargs="+",
        default=[0],
        help="the KD students' train.kd_warmup_steps (the KD weight rises linearly over the "
        "first N steps); default: 0, none",
    )
    p.add_argument("--top-k", type=int, default=None, help="default: the demo's")
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the KD students' teachers.N.temperature (losses scaled by its square); default: 1",
    )
    p.add_argument("--student-lr", type=float, default=None, help="default: the demo's")
    p.add_argument(
        "--student-steps", type=int, default=None, help="the students' steps; default: the demo's"
    )
    p.add_argument(
        "--student-bytes",
        type=int,
        default=None,
        help="students train on the first N bytes of the teachers' text (whole files, in "
        "epochs); default: the demo's; 0: all of it",
    )
    p.add_argument(
        "--student-batch",
        type=int,
        default=None,
        help="the students' sequences per step (data.micro_batch_size); default: the demo's",
    )
    p.add_argument(
        "--student-text",
        choices=["files", "filled", "pieces"],
        default=None,
        help="how the students' bytes are taken (the demo's `student_text`): its first whole "
        "files, the same passing over those that do not fit until full (filled), or pieces of "
        "every file at an even stride; default: the demo's",
    )
    p.add_argument(
        "--teacher-steps", type=int, default=None, help="the teachers' steps; default: the demo's"
    )
    p.add_argument(
        "--teacher-piece-chars",
        type=int,
        default=None,
        help="the teachers train on every training file cut at line ends into pieces of about "
        "N characters (the loader shuffles pieces, so a step reads several files); 0: whole "
        "files, the demo's teacher before 2026-12-05; default: the demo's",
    )
    p.add_argument(
        "--source-root",
        type=Path,
        default=None,
        help="the corpus: the .py files under DIR (e.g. an installed package's sources) instead "
        "of this interpreter's standard library; its runs sit in their own seed folders",
    )
    p.add_argument("--out", default="runs/kd_sensitivity")
    args = p.parse_args()
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        p.error(f"--temperature {args.temperature:g}: give a positive, finite number")
    if args.source_root is not None and not args.source_root.is_dir():
        p.error(f"--source-root {args.source_root}: not a directory; give a folder of .py files")
    for target in args.targets:
        unknown = [t for t in target_parts(target) if t not in get_args(Target)]
        if unknown:
            p.error(f"--targets {target}: unknown target {unknown[0]!r}; one of {get_args(Target)}")
    out = Path(args.out)
    from crossdistill.bench import library_versions
    from crossdistill.train.demo import DEMO

    student_steps = DEMO["student"]["steps"] if args.student_steps is None else args.student_steps
    if student_steps < 1:
        p.error(f"--student-steps {args.student_steps}: give at least 1")
    if args.teacher_piece_chars not in (None, 0) and args.teacher_piece_chars < 256:
        p.error(f"--teacher-piece-chars {args.teacher_piece_chars}: give 0 or at least 256")
    if args.student_batch is not None and args.student_batch < 1:
        p.error(f"--student-batch {args.student_batch}: give at least 1")
    for warmup in args.kd_warmup_steps:
        if not 0 <= warmup <= student_steps:
            p.error(
                f"--kd-warmup-steps {warmup}: must lie in 0..{student_steps}, the students' steps"
            )

    student_bytes = DEMO["student_bytes"] if args.student_bytes is None else args.student_bytes
    # runs on another corpus sit beside the standard library's, in seed folders of their own
    source_tag = ""
    if args.source_root is not None:
        root = args.source_root.resolve()
        source_tag = f"_{root.name}_{hashlib.sha256(str(root).encode()).hexdigest()[:8]}"
    t0 = time.perf_counter()
    rows = []
    for seed in args.seeds:
        rows.append(
            run_seed(
                out / f"seed{seed}{source_tag}",
                seed,
                args.kd_ratios,
                tuple(args.losses),
                tuple(args.teachers),
                tuple(args.targets),
                args.top_k,
                args.student_lr,
                student_bytes,
                args.teacher_steps,
                tuple(args.kd_chunks),
                tuple(args.ce_without_kd),
                tuple(args.kd_warmup_steps),
                args.student_steps,
                args.student_text,
                args.student_batch,
                args.source_root,
                args.temperature,
                args.teacher_piece_chars,
            )
        )
        print(json.dumps(rows[-1]), flush=True)
    summary = {
        "runs": rows,
        "seconds": round(time.perf_counter() - t0, 1),
        "versions": library_versions(),
    }
    (out / "kd_sensitivity.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

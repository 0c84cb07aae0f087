"""Where the demo's tokenizer pair falls against `target: auto`'s bounds, seed by seed.

The demo trains its two tokenizers on each seed's own split of the standard library, so its pair
is a different pair on every seed, and so is the share of KD positions where the first piece is
right, the number `target: auto` chooses by (`train/auto_target.py`). Per seed this builds the
demo's corpus and tokenizers (as `crossdistill demo --seed S` does, no model trained) and prints
the share measured on the students' text (`--student-text`), as a KD student of the demo
measures it at load, and the target it gets. Prints one JSON object and writes it to
`--out`/demo_pair_share.json:

    python benchmarks/demo_pair_share.py --seeds 0 1 2 3 --out runs/share
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def seed_share(out: Path, seed: int, student_text: str | None = None) -> dict:
    from crossdistill.data.build import sample_texts
    from crossdistill.models import load_tokenizer
    from crossdistill.train import demo
    from crossdistill.train.auto_target import SAMPLE_BYTES, choose_target, first_piece_right
    from crossdistill.train.demo_assets import train_demo_tokenizers

    train_texts, val_texts, _ = demo._write_corpus(out, seed)
    student_dir, teacher_dir = train_demo_tokenizers(
        train_texts, out / "tokenizers", val_texts=val_texts[:20]
    )
    tok_s, tok_t = load_tokenizer(str(student_dir)), load_tokenizer(str(teacher_dir))
    student = demo._model(demo.DEMO["student"], student_dir, len(tok_s))
    s, how = demo.DEMO["student"], student_text or demo.DEMO["student_text"]
    name = f"student_train_{how}.jsonl"
    kept = demo.student_share(train_texts, demo.DEMO["student_bytes"], how)
    (out / "data" / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in kept))
    cfg = demo.stage_config(
        out, "student", student, s["steps"], s["lr"], seed, 1, train_file=name,
        batch=s["micro_batch_size"],
    )  # fmt: skip
    right, positions = first_piece_right(tok_s, tok_t, sample_texts(cfg.data, SAMPLE_BYTES))
    target, why = choose_target(right, "forward_kl", tensor_parallel=False)
    return {"seed": seed, "student_text": how, "first_piece_right": right,
            "kd_positions": positions, "target": target, "why": why}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(8)))
    p.add_argument(
        "--student-text", choices=["files", "filled", "pieces"], default=None,
        help="how the students' text is taken (the demo's `student_text`); default: the demo's",
    )  # fmt: skip
    p.add_argument("--out", default="runs/demo_pair_share")
    args = p.parse_args()
    from crossdistill.bench import library_versions

    out, t0, rows = Path(args.out), time.perf_counter(), []
    for seed in args.seeds:
        rows.append(seed_share(out / f"seed{seed}", seed, args.student_text))
        print(json.dumps(rows[-1]), flush=True)
    shares = [r["first_piece_right"] for r in rows]
    summary = {
        "runs": rows,
        "lowest": min(shares),
        "highest": max(shares),
        "seconds": round(time.perf_counter() - t0, 1),
        "versions": library_versions(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo_pair_share.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

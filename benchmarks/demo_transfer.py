"""Where the demo's students stand against their teacher: on the text they trained on, on the
teachers' other text, and on the held-out files.

A KD student learns the teacher's predictions only on the text it reads (its transfer set). If
both students already match or beat the teacher on that text, and what separates them from it
is the text they never read, then the gain KD can show is bounded by what soft targets on those
bytes teach about other bytes, whatever the loss. This scores every finished run of a
`kd_sensitivity.py` output folder (teachers, CE-only and KD students) on three texts:

- `students`: the students' text (what every student trained on, and part of the teachers');
- `other`: the teachers' training files that are not in the students' text, their first
  `--other-bytes` (text the teacher read and no student did);
- `heldout`: every held-out file (as the demo scores).

Prints one JSON object (bits per byte per seed and run, and per-seed summaries) and writes it to
`--out`/demo_transfer.json:

    python benchmarks/demo_transfer.py runs/kd_sensitivity --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def other_text(data: Path, student_file: Path, num_bytes: int) -> Path:
    """DATA/other_N.jsonl: the first `num_bytes` of the teachers' training files (whole files)
    that are not in `student_file`."""
    from crossdistill.data.documents import TextDocuments

    seen = set(TextDocuments([str(student_file)]))
    kept, size = [], 0
    for text in TextDocuments([str(data / "train.jsonl")]):
        if size >= num_bytes:
            break
        if text not in seen:
            kept.append(text)
            size += len(text.encode())
    if not kept:
        raise SystemExit(f"{data}: every training file is in the students' text; nothing to score")
    path = data / f"other_{num_bytes}.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in kept))
    return path


def score_seed(seed_dir: Path, other_bytes: int, max_batches: int | None) -> dict:
    """{run: {students, other, heldout}} for every finished run in `seed_dir`, and per KD student
    its change against the CE-only student on each text."""
    from crossdistill.train.demo import heldout_bpb

    runs = sorted(p for p in seed_dir.iterdir() if (p / "final" / "model.safetensors").exists())
    students = [r for r in runs if r.name.startswith(("student_", "kd_"))]
    if not students:
        raise SystemExit(f"{seed_dir}: no finished student run; run kd_sensitivity.py first")
    student_file = Path(json.loads((students[0] / "config.json").read_text())["data"]["train"][0])
    texts = {
        "students": student_file,
        "other": other_text(seed_dir / "data", student_file, other_bytes),
        "heldout": seed_dir / "data" / "val.jsonl",
    }
    scores = {
        run.name: {
            name: round(heldout_bpb(run, path, max_batches), 4) for name, path in texts.items()
        }
        for run in runs
    }
    ce = next((n for n in scores if n.startswith("student_ce")), None)
    change = {}
    if ce is not None:
        for name in (n for n in scores if n.startswith("kd_")):
            change[name] = {
                text: round(100 * (scores[name][text] / scores[ce][text] - 1), 2)
                for text in scores[ce]
            }
    return {"runs": scores, "kd_against_ce_only_percent": change}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("folder", type=Path, help="a kd_sensitivity.py --out folder")
    p.add_argument("--seeds", nargs="+", default=None, help="seed folder names or numbers")
    p.add_argument("--other-bytes", type=int, default=150_000)
    p.add_argument(
        "--max-batches", type=int, default=None, help="score each text's first N batches only"
    )
    p.add_argument("--out", type=Path, default=None, help="default: the folder itself")
    args = p.parse_args()
    if not args.folder.is_dir():
        p.error(f"{args.folder}: not a folder; give a kd_sensitivity.py --out folder")
    if args.other_bytes < 1:
        p.error(f"--other-bytes {args.other_bytes}: give at least 1")
    names = [s if not s.isdigit() else f"seed{s}" for s in args.seeds or []] or sorted(
        d.name for d in args.folder.iterdir() if d.name.startswith("seed") and d.is_dir()
    )
    missing = [n for n in names if not (args.folder / n).is_dir()]
    if missing:
        p.error(f"{args.folder}: no seed folder {missing[0]}")
    t0 = time.perf_counter()
    result = {}
    for name in names:
        result[name] = score_seed(args.folder / name, args.other_bytes, args.max_batches)
        print(json.dumps({name: result[name]}), flush=True)
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    summary = {"seeds": result, "seconds": round(time.perf_counter() - t0, 1)}
    (out / "demo_transfer.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

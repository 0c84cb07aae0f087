"""Do identical runs of the demo give identical students on this machine?

Starts `--copies` processes at once, one CPU thread each. Each builds the demo's corpus and
tokenizers for `--seed` from scratch in its own folder and trains the demo's CE-only student,
logging every step. Then prints, per copy, its own validation bits per byte, a hash of its
student tokenizer and of its final weights, and the first step whose loss differs from the first
copy's. Settings that may matter (`ATEN_CPU_CAPABILITY`, `MKL_CBWR`, ...) are taken from the
environment, so one suspect at a time can be taken out:

    python benchmarks/demo_repeat.py --seed 14 --copies 6 --out runs/repeat
    MKL_CBWR=COMPATIBLE python benchmarks/demo_repeat.py --seed 14 --copies 6 --out runs/mkl

Exit status 1 when the copies differ. `--json` prints the table as one JSON object last.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def one_copy(out: Path, seed: int, steps: int | None) -> dict:
    """The demo's corpus, tokenizers and CE-only student of `seed`, in `out`."""
    from crossdistill.models import load_tokenizer
    from crossdistill.train import demo
    from crossdistill.train.demo_assets import train_demo_tokenizers

    train_texts, val_texts, _ = demo._write_corpus(out, seed)
    student_tok, _ = train_demo_tokenizers(
        train_texts, out / "tokenizers", val_texts=val_texts[:20]
    )
    size = demo.DEMO["student"]
    model = demo._model(size, student_tok, len(load_tokenizer(str(student_tok))))
    cfg = demo.stage_config(
        out,
        "student_ce",
        model,
        steps or size["steps"],
        size["lr"],
        seed,
        demo.DEMO["eval_batches"],
        train_file=demo.STUDENT_TEXT,
        batch=size["micro_batch_size"],
    )
    cfg.train.log_every = 1
    val = demo.run_stage(cfg, reuse=False)["val/bpb/student"]
    run = out / "student_ce"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        "val_bpb": val,
        "tokenizer": _digest(Path(student_tok) / "tokenizer.json"),
        "weights": _digest(run / "final" / "model.safetensors"),
        "losses": [m["loss"] for m in metrics if "loss" in m],
    }


def compare(copies: dict[str, dict]) -> dict[str, dict]:
    """Per copy: its numbers and the first logged step (1-based) whose loss differs from the
    first copy's (None: none does)."""
    names = sorted(copies)
    ref = copies[names[0]]["losses"]
    table = {}
    for name in names:
        c = copies[name]
        first = next((i + 1 for i, (a, b) in enumerate(zip(c["losses"], ref)) if a != b), None)
        if first is None and len(c["losses"]) != len(ref):
            first = min(len(c["losses"]), len(ref)) + 1
        table[name] = {k: c[k] for k in ("val_bpb", "tokenizer", "weights")}
        table[name]["first_differing_step"] = first
    return table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="default: the demo student's")
    p.add_argument("--out", type=Path, default=Path("runs/demo_repeat"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a copy's own process
    args = p.parse_args()
    if args.copies < 2:
        p.error(f"--copies {args.copies}: at least 2 copies are needed to compare")
    if args.one is not None:
        result = one_copy(args.one, args.seed, args.steps)
        (args.one / "copy.json").write_text(json.dumps(result))
        return 0

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = {}
    copies = {}
    with contextlib.ExitStack() as logs:
        for i in range(args.copies):
            folder = args.out / f"copy{i}"
            folder.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, __file__, "--one", str(folder), "--seed", str(args.seed)]
            if args.steps:
                cmd += ["--steps", str(args.steps)]
            log = logs.enter_context(open(folder / "log.txt", "w"))
            procs[f"copy{i}"] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=log), folder)
            print(f"[repeat] copy{i} -> {folder}", file=sys.stderr)
        for name, (proc, folder) in procs.items():
            if proc.wait() != 0:
                for other, _ in procs.values():
                    other.kill()  # the comparison needs every copy
                print(f"[repeat] {name} failed: see {folder / 'log.txt'}", file=sys.stderr)
                return 2
            copies[name] = json.loads((folder / "copy.json").read_text())
    table = compare(copies)
    for name, row in table.items():
        print(
            f"{name:8s} bpb {row['val_bpb']:.6f}  tokenizer {row['tokenizer']}  "
            f"weights {row['weights']}  first differing step: {row['first_differing_step']}"
        )
    same = len({(r["tokenizer"], r["weights"]) for r in table.values()}) == 1
    print(f"[repeat] {'identical' if same else 'the copies differ'}", file=sys.stderr)
    if args.json:
        print(json.dumps({"seed": args.seed, "copies": table, "identical": same}))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

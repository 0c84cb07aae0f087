"""Several whole `crossdistill train` runs in a row, each in its own process, with loader
workers and validation, as users run the trainer on a GPU: does every run finish?

The reliability check of the loader workers (a worker forked from a CUDA process aborted at
random points: "CUDA error: initialization error" in `~TensorImpl`). Small llama-architecture
student and a Qwen3-architecture cross-tokenizer teacher, random init, on this interpreter's
standard-library sources as a JSONL corpus. Writes one JSON object with every run's exit
status, seconds and last stderr lines.

    python benchmarks/loader_soak.py --tokenizers $TOK --runs 5 --steps 600 --workers 4 \\
        --out benchmarks/results/loader-soak-<date>-<device>.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def corpus(folder: Path, max_files: int = 3000) -> tuple[Path, Path]:
    from crossdistill.train.demo_assets import stdlib_corpus

    train, val = stdlib_corpus(max_files=max_files, train_bytes=40 << 20, val_bytes=1 << 20)
    paths = []
    for name, texts in (("train", train), ("val", val)):
        path = folder / f"{name}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def config(args, train: Path, val: Path, out: Path, seed: int) -> dict:
    tok = Path(args.tokenizers)
    small = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    return {
        "student": {
            "arch": "tiny-llama",
            "tokenizer": str(tok / "llama3" / "hf"),
            "overrides": {**small, "vocab_size": 128256},
        },
        "teachers": [
            {
                "name": "qwen3",
                "arch": "tiny-qwen3",
                "tokenizer": str(tok / "qwen3" / "hf"),
                "dtype": "bfloat16" if args.device == "cuda" else "float32",
                "overrides": {**small, "head_dim": 64, "vocab_size": 151936},
                "top_k": 64,
            }
        ],
        "data": {
            "train": [str(train)],
            "validation": [str(val)],
            "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch,
            "num_workers": args.workers,
        },
        "optim": {"lr": 1e-3, "warmup_steps": 20},
        "train": {
            "steps": args.steps,
            "eval_every": args.eval_every,
            "eval_batches": 8,
            "checkpoint_every": args.steps // 2,
            "log_every": 50,
            "device": args.device,
            "seed": seed,
        },
        "run": {"out_dir": str(out), "tensorboard": False, "progress": False},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizers", required=True, help="folder of <name>/hf tokenizers")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, help="write the JSON record here too")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="crossdistill-soak-"))
    train, val = corpus(work)
    runs = []
    for i in range(args.runs):
        cfg_path = work / f"run{i}.yaml"
        cfg_path.write_text(yaml.safe_dump(config(args, train, val, work / f"run{i}", seed=i)))
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "crossdistill", "train", str(cfg_path)],
            capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        seconds = time.perf_counter() - start
        finished = (work / f"run{i}" / "final" / "config.json").is_file()
        runs.append(
            {
                "run": i,
                "exit_status": done.returncode,
                "finished": finished,
                "seconds": round(seconds, 1),
                "stderr_tail": done.stderr.strip().splitlines()[-6:],
            }
        )
        print(json.dumps(runs[-1]), flush=True)
    import torch

    record = {
        "benchmark": "loader_soak",
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", *sys.argv]),
        "runs": runs,
        "crashes": sum(1 for r in runs if r["exit_status"] != 0 or not r["finished"]),
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

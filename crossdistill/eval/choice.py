"""Multiple-choice tasks scored by log-likelihood (MMLU style).

A task is a JSONL file, one question per line: `question` (str), `choices` (list of str),
`answer` (the index of the right choice, or its letter "A", "B", ...), optionally `subject`.
The context is `"{question}\\nAnswer:"` after the model's start tokens, each continuation
`" {choice}"`, encoded apart (as evaluation harnesses do); a choice's score is the summed
log-probability of its tokens given the context. Reported: accuracy (highest score),
`acc_norm` (score per byte of the choice), per subject, and the records skipped as malformed
(`bad_input: error` stops at the first instead, naming its line).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crossdistill.eval.model import EvalModel
from crossdistill.eval.records import read_records

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def read_task(path: str, bad_input: str = "skip") -> tuple[list[dict], int]:
    """The task's well-formed records and how many lines were skipped."""
    return read_records(Path(path), _check, bad_input, "question")


def _check(r: dict) -> tuple[dict | None, str | None]:
    q, choices, answer = r.get("question"), r.get("choices"), r.get("answer")
    if not isinstance(q, str) or not q.strip():
        return None, "no `question` text"
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        return None, "`choices` must be a list of at least two non-empty strings"
    if isinstance(answer, str) and len(answer) == 1 and answer.upper() in LETTERS:
        answer = LETTERS.index(answer.upper())
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        return None, f"`answer` must be a choice index or letter, got {r.get('answer')!r}"
    return {
        "question": q,
        "choices": choices,
        "answer": answer,
        "subject": str(r.get("subject", "all")),
    }, None


def encode_pair(tokenizer, start: list[int], question: str, choice: str):
    """(context ids, continuation ids) of one choice."""
    ctx = start + tokenizer.encode(f"{question}\nAnswer:", add_special_tokens=False)
    cont = tokenizer.encode(f" {choice}", add_special_tokens=False)
    return ctx, cont


@torch.no_grad()
def continuation_logprobs(m: EvalModel, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """Σ log p(continuation | context) for each pair, several pairs packed in one row (position
    ids restart for each, so attention never crosses them)."""
    from crossdistill.models.forward import final_hidden, packed_row

    weight = m.model.get_output_embeddings().weight
    out: list[float] = []
    budget = 2048
    i = 0
    while i < len(pairs):
        group, size = [], 0
        while i < len(pairs) and (not group or size + sum(map(len, pairs[i])) <= budget):
            group.append(pairs[i])
            size += sum(map(len, pairs[i]))
            i += 1
        seqs = [ctx + cont for ctx, cont in group]
        lengths = [len(s) for s in seqs]
        hidden = final_hidden(m.model, *packed_row(seqs, m.device))[0]
        start = 0
        for (ctx, cont), n in zip(group, lengths):
            rows = torch.arange(start + len(ctx) - 1, start + n - 1, device=m.device)
            logits = (hidden[rows] @ weight.t()).float()
            lp = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(cont, device=m.device)
            out.append(float(lp.gather(1, target[:, None]).sum()))
            start += n
    return out


def multiple_choice(m: EvalModel, path: str, bad_input: str = "skip") -> dict[str, Any]:
    from crossdistill.data.encoders import TokenizerSide

    records, skipped = read_task(path, bad_input)
    start = TokenizerSide(m.tokenizer, fast=False).start_ids.tolist()
    pairs, owners = [], []
    for k, r in enumerate(records):
        for choice in r["choices"]:
            pairs.append(encode_pair(m.tokenizer, start, r["question"], choice))
            owners.append(k)
    scores = continuation_logprobs(m, pairs)
    by_record: dict[int, list[float]] = defaultdict(list)
    for k, s in zip(owners, scores):
        by_record[k].append(s)
    right = norm_right = 0
    subjects: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for k, r in enumerate(records):
        s = np.asarray(by_record[k])
        nbytes = np.asarray([len(f" {c}".encode()) for c in r["choices"]])
        hit = int(np.argmax(s)) == r["answer"]
        right += hit
        norm_right += int(np.argmax(s / nbytes)) == r["answer"]
        subjects[r["subject"]][0] += hit
        subjects[r["subject"]][1] += 1
    n = len(records)
    return {
        "accuracy": right / n,
        "acc_norm": norm_right / n,
        "questions": n,
        "skipped": skipped,
        "subjects": {k: v[0] / v[1] for k, v in sorted(subjects.items())},
    }

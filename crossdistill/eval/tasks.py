"""Evaluation tasks as the command line and `train.eval_tasks` write them: `KIND=PATH`, with
KIND `bpb` (a corpus), `choice` (multiple-choice JSONL) or `code` (HumanEval / MBPP JSONL, or
`humaneval`) or `lm_eval` (task names of lm-evaluation-harness, comma-separated). `run_tasks` runs them on a model and returns flat metrics
(`eval/bpb/<name>`, `eval/choice/<name>/accuracy`, `eval/code/<name>/pass@1`, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossdistill.errors import UserError

KINDS = ("bpb", "choice", "code", "lm_eval")


@dataclass(frozen=True)
class Task:
    kind: str
    path: str

    @property
    def name(self) -> str:
        if self.kind == "lm_eval" or self.path == "humaneval":
            return self.path
        return Path(self.path).name.split(".")[0]


def parse_task(spec: str, where: str = "--task") -> Task:
    """`KIND=PATH` as a `Task`; the file must exist (`code=humaneval` needs no file)."""
    if spec.startswith("lm_eval:"):  # the harness's own spelling, `lm_eval:mmlu,hellaswag`
        spec = "lm_eval=" + spec.removeprefix("lm_eval:")
    kind, sep, path = spec.partition("=")
    if not sep or kind not in KINDS or not path:
        raise UserError(f"{where} {spec!r}: write KIND=PATH with KIND one of {', '.join(KINDS)}")
    named = (kind == "code" and path == "humaneval") or kind == "lm_eval"
    if not named and not Path(path).exists():
        raise UserError(f"{where} {spec!r}: {path} does not exist")
    return Task(kind, path)


def run_tasks(m: Any, tasks: list[Task], options: dict[str, Any] | None = None) -> dict[str, float]:
    """Each task on model `m` (`eval.model.EvalModel`), as flat metrics."""
    from crossdistill.eval.bpb import bits_per_byte
    from crossdistill.eval.choice import multiple_choice
    from crossdistill.eval.code import code_generation

    o = options or {}
    out: dict[str, float] = {}
    for t in tasks:
        if t.kind == "bpb":
            r = bits_per_byte(m, [t.path], o.get("seq_len", 2048), o.get("batch_size", 4),
                              o.get("max_batches"))  # fmt: skip
            out[f"eval/bpb/{t.name}"] = r["bpb"]
        elif t.kind == "choice":
            r = multiple_choice(m, t.path, o.get("bad_input", "skip"))
            out[f"eval/choice/{t.name}/accuracy"] = r["accuracy"]
            out[f"eval/choice/{t.name}/acc_norm"] = r["acc_norm"]
        elif t.kind == "code":
            r = code_generation(m, t.path, o.get("max_new_tokens", 256), limit=o.get("code_tasks"))
            out[f"eval/code/{t.name}/pass@1"] = r["pass@1"]
        else:
            from crossdistill.eval.harness import harness_tasks

            names = t.path.split(",")
            got = harness_tasks(m, names, o.get("lm_eval_include"), o.get("lm_eval_limit"))
            for task, metrics in got.items():
                for key, value in metrics.items():
                    out[f"eval/lm_eval/{task}/{key.replace(',none', '')}"] = value
    return out

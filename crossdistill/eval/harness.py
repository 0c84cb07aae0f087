"""lm-evaluation-harness tasks (`pip install 'crossdistill[eval]'`): `lm_eval=TASK[,TASK...]`
hands the model in memory to `lm_eval.simple_evaluate`, with the harness's own tasks (they
download their datasets) or tasks defined in YAML files of a local folder
(`--lm-eval-include DIR`), which run offline."""

from __future__ import annotations

from typing import Any

from crossdistill.errors import UserError


def harness_tasks(
    m: Any,
    names: list[str],
    include: str | None = None,
    limit: int | None = None,
    batch_size: int = 8,
) -> dict[str, dict[str, float]]:
    """`{task: {metric: value}}` from the harness (its numeric metrics only)."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise UserError(
            "lm_eval tasks need lm-evaluation-harness with its Hugging Face backend (missing: "
            f"{e.name}): pip install 'crossdistill[eval]'"
        ) from None
    lm = HFLM(
        pretrained=m.model,
        tokenizer=m.tokenizer,
        batch_size=batch_size,
        device=str(m.device),
    )
    manager = TaskManager(include_path=include) if include else TaskManager()
    missing = [n for n in names if n not in manager.all_tasks]
    if missing:
        where = f" or in {include}" if include else ""
        raise UserError(
            f"lm_eval knows no task {', '.join(missing)}{where}; give a task name of the "
            "harness or a folder of task YAML files with --lm-eval-include"
        )
    results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit)
    return {
        task: {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for task, metrics in (results or {}).get("results", {}).items()
    }

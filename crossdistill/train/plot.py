"""PNG curves of a run from its `metrics.jsonl`: `crossdistill plot RUN_DIR`.

One figure per group of keys, the group being the first part of the key once `val/` is removed
(`loss/kd` and `val/loss` go to `loss.png`, `val/bpb/student` and `val/bpb/teacher` to
`bpb.png`). Training values are lines, validation values are marked points, and a validation
value logged only once (the teacher's bits per byte) is a dashed horizontal reference line.
matplotlib is imported only here and only when plotting; its Agg canvas is used directly, so
no global backend is switched.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from crossdistill.errors import UserError

# Known groups first, in this order; any other group gets a figure after them.
GROUP_ORDER = ("loss", "bpb", "tokens_per_s", "lr", "grad_norm")
GROUP_TITLES = {
    "loss": "Loss terms",
    "bpb": "Held-out bits per byte (lower is better)",
    "tokens_per_s": "Throughput (tokens/s)",
    "lr": "Learning rate",
    "grad_norm": "Gradient norm (before clipping)",
}
_NOT_METRICS = {"step", "time"}
_SMOOTH_ABOVE = 50  # points; noisier training curves get an EMA line over the raw one

Series = dict[str, tuple[list[int], list[float]]]  # key -> (steps, values)

EPILOG = """\
examples:
  crossdistill plot runs/demo/distilled
      writes runs/demo/distilled/plots/{loss,bpb,tokens_per_s,lr}.png
  crossdistill plot runs/qwen3-to-llama --out /tmp/curves
"""


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per metric group of `run_dir/metrics.jsonl` into `out_dir`
    (default `run_dir/plots`); returns their paths, known groups first."""
    from crossdistill.train.metrics import METRICS_FILE, read_metrics

    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise UserError(
            f"{path} does not exist: give the folder of a run started by `crossdistill train` "
            f"(the one holding metrics.jsonl)"
        )
    groups = group_series(read_metrics(path))
    if not groups:
        raise UserError(f"{path} holds no metrics yet; plot again once the run has logged")
    figure_cls, canvas_cls = matplotlib_classes()
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    ordered = [g for g in GROUP_ORDER if g in groups] + sorted(set(groups) - set(GROUP_ORDER))
    return [
        _plot_group(figure_cls, canvas_cls, g, groups[g], out / f"{_file_stem(g)}.png")
        for g in ordered
    ]


def group_series(records: list[dict[str, Any]]) -> dict[str, Series]:
    """`{group: {key: (steps, values)}}` from metric records, skipping nulls and non-numbers."""
    groups: dict[str, Series] = {}
    for record in records:
        step = record["step"]
        for key, value in record.items():
            if (
                key in _NOT_METRICS
                or isinstance(value, bool)
                or not isinstance(value, (int, float))
            ):
                continue
            group = key.removeprefix("val/").split("/")[0]
            steps, values = groups.setdefault(group, {}).setdefault(key, ([], []))
            steps.append(step)
            values.append(float(value))
    return groups


def _plot_group(figure_cls, canvas_cls, group: str, series: Series, path: Path) -> Path:
    fig = figure_cls(figsize=(8, 4.5), layout="constrained")
    canvas_cls(fig)
    ax = fig.add_subplot()
    longest = max(len(steps) for steps, _ in series.values())
    for i, key in enumerate(sorted(series)):
        steps, values = series[key]
        color = f"C{i % 10}"
        if key.startswith("val/") and len(steps) == 1 and longest > 1:
            ax.axhline(values[0], color=color, linestyle="--", linewidth=1.2, label=key)
            ax.plot(steps, values, marker="o", color=color, linestyle="none")
        elif key.startswith("val/"):
            ax.plot(steps, values, marker="o", markersize=4, color=color, linewidth=1, label=key)
        elif len(steps) > _SMOOTH_ABOVE:
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
            ax.plot(steps, _ema(values), color=color, linewidth=1.5, label=f"{key} (smoothed)")
        else:
            ax.plot(steps, values, color=color, linewidth=1.2, label=key)
    ax.set_title(GROUP_TITLES.get(group, group))
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=100)
    return path


def _ema(values: list[float], alpha: float = 0.1) -> list[float]:
    out, acc = [], values[0]
    for v in values:
        acc = alpha * v + (1 - alpha) * acc
        out.append(acc)
    return out


def _file_stem(group: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", group) or "metric"


def matplotlib_classes():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserError(
            "plotting needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install 'crossdistill[logging]')"
        ) from None
    return Figure, FigureCanvasAgg


def add_plot_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`crossdistill plot RUN_DIR [--out DIR]`."""
    parser = subparsers.add_parser(
        "plot",
        help="write PNG curves (loss terms, bits per byte, tokens/s, lr) of a run",
        description="Write PNG curves from RUN_DIR/metrics.jsonl: one figure per metric group.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run's output folder")
    parser.add_argument(
        "--out",
        metavar="DIR",
        type=Path,
        default=None,
        help="where to write (default RUN_DIR/plots)",
    )
    parser.set_defaults(func=_run_plot)
    return parser


def _run_plot(args: argparse.Namespace) -> int:
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0

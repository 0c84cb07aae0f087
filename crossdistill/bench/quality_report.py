"""What the runs of `crossdistill bench quality` say: the summary with its refusals (`summarize`),
the table and the plot. Pure functions of the finished runs, so a report can be rebuilt from
`cells.jsonl` alone."""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from crossdistill.config import TeacherConfig, TrainConfig


@dataclass
class Cell:
    """One kind of student run: its name, the teacher it learns from (None: CE only; the
    student's own tokenizer: a same-tokenizer cell), its loss, the projected losses' target and
    its KD weight."""

    name: str
    teacher: str | None = None  # a tokenizer label
    loss: str | None = None
    target: str = TeacherConfig.target
    kd_chunks: str = TeacherConfig.kd_chunks
    ce_without_kd: str = TrainConfig.ce_without_kd
    kd_warmup_steps: int = TrainConfig.kd_warmup_steps
    kd_ratio: float = TrainConfig.kd_ratio
    past_end: str = TeacherConfig.past_end
    many_chunks: str = TeacherConfig.many_chunks
    deep_alternatives: str = TeacherConfig.deep_alternatives
    boundary: str = TeacherConfig.boundary
    split_context: str = TeacherConfig.split_context


# what one tokenizer's teachers of several seeds did at each scale (benchmarks/README.md, "The
# cpu scale's teachers from several seeds" and "The gpu scale's far pair on the default
# corpus"): the hint of a teacher refusal with one teacher seed (other scales: the cpu scale's)
SEED_SPREAD = {
    "cpu": "at --scale cpu one tokenizer's teachers ended up to 4.4% apart from seed to seed",
    "gpu": "at --scale gpu one tokenizer's two teachers ended within 0.7% of each other, so a "
    "larger gap there is more likely the tokenizers' on this text than a seed's",
}


def summarize(
    teachers: dict[str, float],
    runs: dict[str, dict[Any, float]],
    cells: list[Cell],
    same_label: str,
    spec: Any,
    teacher_seed_bpb: dict[str, dict[int, float]] | None = None,
) -> dict[str, Any]:
    """The report from the finished runs (`runs[cell][seed]` = held-out bits per byte) under the
    thresholds of `spec` (a `quality.QualitySpec`, which imports this module). A KD cell's runs
    may be keyed `(teacher seed, seed)` instead, when the teachers were trained from several
    seeds (`teachers` then holds each tokenizer's mean): each is paired with the CE-only
    student of its seed, and every spread, count and interval runs over all of them.

    `refused` (one line) when nothing can be compared: a run diverged, the same-tokenizer
    teacher is not `min_teacher_gain` better than the CE-only student, same-tokenizer KD does
    not beat CE only (on average or on any one seed: the gap closed of that seed would divide by
    noise), or every cross pair is refused. A cross pair is refused on its own
    (`entry["refused"]`, no `gap_closed`) when its teacher is more than `max_teacher_spread`
    from the same-tokenizer teacher or not `min_teacher_gain` better than the CE-only student.

    `warnings` (lines) when a result says less than it seems: same-tokenizer KD gains less
    than `min_same_gain` over CE only (paired over seeds, `same_kd.change_vs_ce`), so the
    students' seed-to-seed noise weighs on every gap closed; or one tokenizer's teachers
    (`teacher_seed_bpb[label][teacher seed]`, when trained from several seeds) ended further
    apart than `max_teacher_spread`, so whether a pair is compared turns on the teacher seeds as
    much as on the tokenizers.

    Under several KD weights each cross cell's gap closed is against the same-tokenizer cell of
    its own weight (`same_kd_by_kd_ratio`); the cell named `same` is the reference (`same_kd`),
    which refuses everything when it fails, where another weight's refuses only its own cells."""
    ce = runs.get("ce", {})
    # a KD run's key is its student seed, or (teacher seed, student seed) when the teachers were
    # trained from several seeds; both read as (teacher seed, student seed) from here on
    runs = {
        name: r
        if name == "ce"
        else {k if isinstance(k, tuple) else (0, k): v for k, v in r.items()}
        for name, r in runs.items()
    }
    same = runs.get("same", {})
    reference = next((c.kd_ratio for c in cells if c.name == "same"), TrainConfig.kd_ratio)
    same_cells = {c.kd_ratio: c.name for c in cells if c.teacher == same_label}
    kd_keys = {k for name, r in runs.items() if name != "ce" for k in r}
    ce_of = {k: ce[k[1]] for k in kd_keys if k[1] in ce}  # each KD run's CE-only student
    several = len({k[0] for k in kd_keys}) > 1
    report: dict[str, Any] = {
        "teachers": dict(teachers),
        "same_tokenizer": same_label,
        "ce_only": _stats(ce),
        "same_kd": _stats(same),
        "kd_ratio": reference,
        "cross": [],
        "default_loss": TeacherConfig.loss,
        "refused": None,
        "warnings": [],
    }
    report["same_kd"]["change_vs_ce"] = _change(same, ce_of)
    ce_mean = report["ce_only"]["mean"]

    seed_spread = SEED_SPREAD.get(spec.scale_name, SEED_SPREAD["cpu"])

    def teacher_problem(name: str) -> str | None:
        value = teachers[name]
        if name != same_label and same_label in teachers:
            spread = abs(value / teachers[same_label] - 1)
            if spread > spec.max_teacher_spread:
                return (
                    f"teacher {name} ({value:.4f} bits per byte) is {spread:.1%} from the "
                    f"same-tokenizer teacher ({teachers[same_label]:.4f}), more than "
                    f"{spec.max_teacher_spread:.0%}: a difference between students would be the "
                    "teachers', not the tokenizers'; train the teachers longer (--teacher-steps) or "
                    "larger (--teacher-size, --scale)"
                ) + (
                    ", or compare the means of teachers trained from several seeds "
                    f"(--teacher-seeds 2 or more: {seed_spread})"
                    if spec.teacher_seeds == 1
                    else ""
                )
        if ce_mean is not None and len(ce) >= 2 and value > ce_mean * (1 - spec.min_teacher_gain):
            return (
                f"teacher {name} ({value:.4f} bits per byte) is not {spec.min_teacher_gain:.0%} "
                f"better than the CE-only student ({ce_mean:.4f}): it has little to teach; "
                "train the teachers longer (--teacher-steps) or larger (--teacher-size, --scale)"
            )
        return None

    broken = [f"teacher {name}" for name, v in teachers.items() if not math.isfinite(v)]
    broken += [
        f"{c} {_seed_name(k, several)}"
        for c, r in runs.items()
        for k, v in r.items()
        if not math.isfinite(v)
    ]
    if broken:
        report["refused"] = (
            f"{broken[0]} gave a non-finite bits per byte: that run diverged; lower the learning "
            "rate (--teacher-lr, --student-lr; or look at its metrics.jsonl) before comparing"
        )
    elif same_label in teachers and teacher_problem(same_label):
        report["refused"] = teacher_problem(same_label)
    else:
        report["refused"] = _same_kd_problem(same, ce, ce_of, several, "")
    if len(same_cells) > 1:
        report["same_kd_by_kd_ratio"] = {}
        for ratio, name in same_cells.items():
            stats = _stats(runs.get(name, {}))
            stats["change_vs_ce"] = _change(runs.get(name, {}), ce_of)
            report["same_kd_by_kd_ratio"][f"{ratio:g}"] = stats
    for cell in cells:
        if cell.teacher in (None, same_label) or cell.name not in runs:
            continue
        cross = runs[cell.name]
        # the same-tokenizer students of this cell's KD weight
        peer = runs.get(same_cells.get(cell.kd_ratio, "same"), {})
        weight = f" at KD weight {cell.kd_ratio:g}" if cell.kd_ratio != reference else ""
        entry: dict[str, Any] = {
            "tokenizer": cell.teacher,
            "loss": cell.loss,
            "target": cell.target,
            "kd_chunks": cell.kd_chunks,
            "past_end": cell.past_end,
            "many_chunks": cell.many_chunks,
            "deep_alternatives": cell.deep_alternatives,
            "boundary": cell.boundary,
            "split_context": cell.split_context,
            "ce_without_kd": cell.ce_without_kd,
            "kd_warmup_steps": cell.kd_warmup_steps,
            "kd_ratio": cell.kd_ratio,
            "cell": cell.name,
            "bpb": _stats(cross),
            "beats_ce_every_seed": bool(cross)
            and all(k in ce_of and v < ce_of[k] for k, v in cross.items()),
            "seeds": sorted({k[1] for k in cross}),
            "teacher_seeds": sorted({k[0] for k in cross}),
            "refused": report["refused"]
            or teacher_problem(cell.teacher)
            or (_same_kd_problem(peer, ce, ce_of, several, weight) if weight else None),
        }
        paired = sorted(k for k in cross if k in ce_of and k in peer)
        if (
            entry["refused"] is None
            and len(paired) >= 2
            and all(ce_of[k] != peer[k] for k in paired)
        ):
            closed = {k: (ce_of[k] - cross[k]) / (ce_of[k] - peer[k]) for k in paired}
            entry["gap_closed"] = _stats(closed)
            values = [
                [ce_of[k] for k in paired],
                [peer[k] for k in paired],
                [cross[k] for k in paired],
            ]
            entry["gap_closed_of_means"] = gap_of_means(*values, keys=paired)
            if several:  # each teacher seed's own, to see how far the teachers alone move it
                entry["gap_closed_by_teacher_seed"] = {
                    str(t): gap_of_means(
                        *[[v for k, v in zip(paired, c) if k[0] == t] for c in values]
                    )["value"]
                    for t in entry["teacher_seeds"]
                }
        entry["change_vs_ce"] = _change(cross, ce_of)
        # against the first cell asked for with the same teacher and loss (its first target,
        # kd_chunks and KD weight), seed by seed
        first = next(
            e
            for e in report["cross"] + [entry]
            if e["tokenizer"] == cell.teacher and e["loss"] == cell.loss
        )
        if first is not entry:
            entry["change_vs_target"] = {
                "target": first["target"],
                "cell": first["cell"],
                **_change(cross, runs[first["cell"]]),
            }
        report["cross"].append(entry)
    pairs = [label for label in teachers if label != same_label]
    if report["refused"] is None and pairs and all(teacher_problem(p) for p in pairs):
        report["refused"] = teacher_problem(pairs[0])
    gains = [("", report["same_kd"]["change_vs_ce"])] + [
        (f" at KD weight {ratio}", stats["change_vs_ce"])
        for ratio, stats in report.get("same_kd_by_kd_ratio", {}).items()
        if float(ratio) != reference
    ]
    for weight, gain in gains:
        if report["refused"] is None and gain["n"] >= 2 and -gain["mean"] < spec.min_same_gain:
            report["warnings"].append(
                f"same-tokenizer KD{weight} gains {-gain['mean']:.1%} over CE only, under "
                f"{spec.min_same_gain:.0%} (--min-same-gain): with a gap this small the "
                "students' seed-to-seed noise weighs on every gap closed; read the gap closed "
                "from the means and its interval, or give the teacher more to add "
                "(--teacher-steps; --student-bytes, the students on less text in epochs: a "
                "larger gain, mostly a CE-only student that memorises, and seeds that scatter)"
            )
    for label, by_seed in (teacher_seed_bpb or {}).items():
        values = [v for v in by_seed.values() if math.isfinite(v)]
        if len(values) < 2:
            continue
        low, high = min(values), max(values)
        if high / low - 1 > spec.max_teacher_spread:
            report["warnings"].append(
                f"teacher {label}'s {len(values)} seeds ended {high / low - 1:.1%} apart "
                f"({low:.4f} to {high:.4f} bits per byte), more than the "
                f"{spec.max_teacher_spread:.0%} two tokenizers' teachers may differ by: whether a "
                "pair is compared turns on the teacher seeds as much as on the tokenizers; more "
                "seeds (--teacher-seeds) steady the means; the seeds themselves come nearer with "
                "longer or larger teachers (--teacher-steps, --teacher-size), or with a --corpus "
                "cut into pieces small enough that a teacher step spans several (--piece-bytes)"
            )
    return report


# seeds resampled with replacement for the interval of the gap closed from the means
BOOTSTRAP_RESAMPLES = 4000


def _same_kd_problem(
    same: dict[Any, float],
    ce: dict[int, float],
    ce_of: dict[Any, float],
    several: bool,
    weight: str,
) -> str | None:
    """Why the same-tokenizer cell `same` (at `weight`, in words; "" for the reference) leaves
    no gap to close: not better than CE only on average, or on one run (its gap closed would
    divide by noise). None when it does."""
    if len(same) >= 2 and len(ce) >= 2:
        same_mean, ce_mean = statistics.fmean(same.values()), statistics.fmean(ce.values())
        if same_mean >= ce_mean:
            return (
                f"same-tokenizer KD{weight} ({same_mean:.4f} bits per byte) is not better than "
                f"CE only ({ce_mean:.4f}), so there is no gap to close; use stronger teachers or "
                "a higher --kd-ratio"
            )
    if losing := [k for k in sorted(same) if k in ce_of and same[k] >= ce_of[k]]:
        return (
            f"same-tokenizer KD{weight} is not better than CE only on {len(losing)} of "
            f"{len(same)} runs ({_seed_name(losing[0], several)}: {same[losing[0]]:.4f} vs "
            f"{ce_of[losing[0]]:.4f} bits per byte): the gap to close is within the run-to-run "
            "noise; lower the student's learning rate (--student-lr), train longer "
            "(--student-steps) or use stronger teachers"
        )
    return None


def gap_of_means(
    ce: list[float],
    same: list[float],
    cross: list[float],
    keys: list[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """The gap closed from the cells' means over the same runs, (mean CE − mean cross) / (mean
    CE − mean same), with a 90% bootstrap interval: seeds drawn with replacement, the three
    cells of a seed kept together, resamples whose same-tokenizer gain is not positive left
    out (`used` says how many were kept). A seed where same-tokenizer KD gains little makes
    its own per-seed ratio huge; here it weighs only by its share of the mean gain. The draws
    come from a fixed seed, so a report is the same every time it is built.

    `keys` names each run `(teacher seed, student seed)`. With more than one teacher seed the
    bootstrap is two-level: each resample draws the teacher seeds with replacement, then the
    student seeds, and takes every run of a drawn pair, so the interval holds the teachers'
    run-to-run noise as well as the students'."""
    import random

    def ratio(idx: list[int]) -> float | None:
        gain = sum(ce[i] - same[i] for i in idx)
        return sum(ce[i] - cross[i] for i in idx) / gain if gain > 0 else None

    n = len(ce)
    value = ratio(list(range(n)))
    draw = random.Random(0)
    index = {k: i for i, k in enumerate(keys or [])}
    teacher_seeds = sorted({k[0] for k in index})
    student_seeds = sorted({k[1] for k in index})

    def resample() -> list[int]:
        if len(teacher_seeds) < 2:
            return [draw.randrange(n) for _ in range(n)]
        ts = [draw.choice(teacher_seeds) for _ in teacher_seeds]
        ss = [draw.choice(student_seeds) for _ in student_seeds]
        return [index[(t, s)] for t in ts for s in ss if (t, s) in index]

    boot = sorted(
        r for r in (ratio(resample()) for _ in range(BOOTSTRAP_RESAMPLES)) if r is not None
    )
    if value is None or not boot:
        return {"value": value, "low": None, "high": None, "used": len(boot)}
    pick = lambda q: boot[min(len(boot) - 1, int(q * len(boot)))]  # noqa: E731
    return {"value": value, "low": pick(0.05), "high": pick(0.95), "used": len(boot)}


def _seed_name(key: tuple[int, int], several: bool) -> str:
    """`seed 3`, or `teacher seed 1, seed 3` when the teachers were trained from several."""
    return f"teacher seed {key[0]}, seed {key[1]}" if several else f"seed {key[1]}"


def _change(values: dict[int, float], base: dict[int, float]) -> dict[str, Any]:
    """The relative change `values[s] / base[s] − 1` over the seeds both have (mean, spread,
    per seed) and `better`, on how many of them `values` is lower: a paired comparison, which
    the students' seed-to-seed spread does not blur as it blurs two means."""
    seeds = [s for s in values if s in base]
    out = _stats({s: values[s] / base[s] - 1 for s in seeds})
    out["better"] = sum(values[s] < base[s] for s in seeds)
    return out


def _stats(values: dict[int, float]) -> dict[str, Any]:
    """Mean and sample standard deviation; none of either when a value is not finite (the
    report refuses such a comparison, and JSON has no NaN)."""
    xs = [values[s] for s in sorted(values)]
    if not xs or not all(math.isfinite(x) for x in xs):
        runs = [x if math.isfinite(x) else None for x in xs]
        return {"mean": None, "std": None, "n": len(xs), "runs": runs}
    std = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return {"mean": statistics.fmean(xs), "std": std, "n": len(xs), "runs": xs}


def print_table(report: dict[str, Any], file=sys.stdout) -> None:
    def pm(stats: dict[str, Any]) -> str:
        if not stats or stats.get("mean") is None:
            return "-"
        return f"{stats['mean']:.4f} ± {stats['std']:.4f}"

    print("\nteachers, held-out bits per byte:", file=file)
    for name, value in report["teachers"].items():
        mark = " (student's tokenizer)" if name == report.get("same_tokenizer") else ""
        seeds = report.get("teacher_runs", {}).get(name, {}).get("seeds", {})
        if len(seeds) > 1:
            each = ", ".join(f"{seeds[t]['bpb']:.4f}" for t in sorted(seeds, key=int))
            mark += f"   mean of seeds {each}"
        print(f"  {name:24s} {value:.4f}{mark}", file=file)
    if report.get("settings", {}).get("teacher_cache"):
        print("  (the KD students read each teacher's top-k from its cache)", file=file)
    print("\nstudents, held-out bits per byte (mean ± std over seeds):", file=file)
    print(f"  {'CE only':40s} {pm(report['ce_only'])}", file=file)
    reference = report.get("kd_ratio", TrainConfig.kd_ratio)
    print(f"  {'same-tokenizer KD':40s} {pm(report['same_kd'])}", file=file)
    _print_change(report["same_kd"].get("change_vs_ce"), "CE only", file)
    for ratio, stats in report.get("same_kd_by_kd_ratio", {}).items():
        if float(ratio) != reference:
            print(f"  {'same-tokenizer KD kd_ratio ' + ratio:40s} {pm(stats)}", file=file)
            _print_change(stats.get("change_vs_ce"), "CE only", file)
    for entry in report["cross"]:
        label = f"cross KD {entry['tokenizer']} {entry['loss']}"
        if entry["target"] != TeacherConfig.target:
            label += f" {entry['target']}"
        elif "chosen_target" in entry:
            label += f" ({entry['target']}: {entry['chosen_target']})"
        if entry["kd_chunks"] != TeacherConfig.kd_chunks:
            label += f" kd_chunks {entry['kd_chunks']}"
        if entry.get("past_end", TeacherConfig.past_end) != TeacherConfig.past_end:
            label += f" past_end {entry['past_end']}"
        if entry.get("many_chunks", TeacherConfig.many_chunks) != TeacherConfig.many_chunks:
            label += f" many_chunks {entry['many_chunks']}"
        deep = entry.get("deep_alternatives", TeacherConfig.deep_alternatives)
        if deep != TeacherConfig.deep_alternatives:
            label += f" deep_alternatives {deep}"
        if entry.get("boundary", TeacherConfig.boundary) != TeacherConfig.boundary:
            label += f" boundary {entry['boundary']}"
        context = entry.get("split_context", TeacherConfig.split_context)
        if context != TeacherConfig.split_context:
            label += f" split_context {context}"
        if entry.get("ce_without_kd", TrainConfig.ce_without_kd) != TrainConfig.ce_without_kd:
            label += f" ce_without_kd {entry['ce_without_kd']}"
        if entry.get("kd_warmup_steps", TrainConfig.kd_warmup_steps):
            label += f" kd_warmup_steps {entry['kd_warmup_steps']}"
        if entry.get("kd_ratio", reference) != reference:
            label += f" kd_ratio {entry['kd_ratio']:g}"
        gap = entry.get("gap_closed")
        gap_text = f"   gap closed {gap['mean']:.0%} ± {gap['std']:.0%}" if gap else ""
        means = entry.get("gap_closed_of_means")
        if gap and means and means["low"] is not None:
            gap_text += (
                f" per seed, {means['value']:.0%} from the means (90%: {means['low']:.0%} to "
                f"{means['high']:.0%})"
            )
        by_teacher = entry.get("gap_closed_by_teacher_seed")
        if gap and by_teacher:
            each = ", ".join(
                "-" if v is None else f"{v:.0%}"
                for _, v in sorted(by_teacher.items(), key=lambda kv: int(kv[0]))
            )
            gap_text += f"; under each teacher seed {each}"
        every = "" if entry["beats_ce_every_seed"] else "   (not better than CE on every seed)"
        if entry["refused"] and not report["refused"]:
            every += f"\n    no comparison: {entry['refused']}"
        print(f"  {label:40s} {pm(entry['bpb'])}{gap_text}{every}", file=file)
        _print_change(entry.get("change_vs_ce"), "CE only", file)
        change = entry.get("change_vs_target")
        if change:
            same_target = change["target"] == entry["target"]
            against = change["cell"] if same_target else f"the {change['target']} target"
            _print_change(change, against, file)
    for line in report.get("warnings", []):
        print(f"\nnote: {line}", file=file)
    if report["refused"]:
        print(f"\nno comparison: {report['refused']}", file=file)


def _print_change(change: dict[str, Any] | None, against: str | None, file) -> None:
    if change and change["mean"] is not None and change["n"]:
        print(
            f"    vs {against}, paired: {change['mean']:+.2%} ± {change['std']:.2%}, "
            f"lower on {change['better']} of {change['n']} seeds",
            file=file,
        )


def plot_report(out: Path, report: dict[str, Any], cells: list[Cell]) -> Path | None:
    """OUT/quality.png: the students' training CE (mean over seeds) and held-out bits per byte."""
    from crossdistill.train.metrics import METRICS_FILE, read_metrics
    from crossdistill.train.plot import matplotlib_classes

    figure_cls, canvas_cls = matplotlib_classes()
    fig = figure_cls(figsize=(11, 4.5), layout="constrained")
    canvas_cls(fig)
    curves, bars = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    names, means, stds = [], [], []
    stats_of = {"ce": report["ce_only"], "same": report["same_kd"]}
    for cell in cells:
        if cell.teacher == report["same_tokenizer"] and cell.name != "same":  # another weight's
            weight = report.get("same_kd_by_kd_ratio", {}).get(f"{cell.kd_ratio:g}")
            if weight:
                stats_of[cell.name] = weight
    for entry in report["cross"]:
        stats_of[entry["cell"]] = entry["bpb"]
    for i, cell in enumerate(cells):
        folder = out / "students" / cell.name
        series: dict[int, list[float]] = {}
        for run in sorted(folder.glob("seed*")):
            if not (run / METRICS_FILE).is_file():
                continue
            for record in read_metrics(run / METRICS_FILE):
                if isinstance(record.get("ce"), (int, float)):
                    series.setdefault(record["step"], []).append(record["ce"])
        if series:
            steps = sorted(series)
            curves.plot(
                steps, [statistics.fmean(series[s]) for s in steps], f"C{i}-", label=cell.name
            )
        stats = stats_of.get(cell.name)
        if stats and stats.get("mean") is not None:
            names.append(cell.name)
            means.append(stats["mean"])
            stds.append(stats["std"])
    if not names:
        return None
    curves.set_title("Students' training CE (mean over seeds)")
    curves.set_xlabel("step")
    curves.grid(True, alpha=0.3)
    curves.legend(fontsize="small")
    bars.bar(range(len(names)), means, yerr=stds, color=[f"C{i}" for i in range(len(names))])
    bars.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize="small")
    low = min(m - s for m, s in zip(means, stds))
    high = max(m + s for m, s in zip(means, stds))
    bars.set_ylim(low - 0.2 * (high - low + 1e-3), high + 0.2 * (high - low + 1e-3))
    bars.set_title("Held-out bits per byte (mean ± std; lower is better)")
    path = out / "quality.png"
    fig.savefig(path, dpi=100)
    return path

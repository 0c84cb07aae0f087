"""`crossdistill bench quality`: the gap-closed arithmetic and every refusal against numbers
worked out by hand, the corpus split, the settings check, and the whole experiment end to end
at its quick scale on two genuine tokenizers (GPT-2 student, Llama-2 teacher)."""

from __future__ import annotations

import io
import json
import math
import platform
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from crossdistill.bench.quality_cli import spec_from_args
from crossdistill.bench.quality_corpus import (
    PIECE_BYTES,
    CorpusReader,
    bytes_per_token,
    corpus_pieces,
    split_pieces,
    spread_pieces,
    write_corpus,
)
from crossdistill.bench.quality_report import Cell, gap_of_means, print_table, summarize
from crossdistill.bench.quality_spec import SCALES, QualitySpec, cell_settings, teacher_shape
from crossdistill.cli import build_parser, main
from crossdistill.config import TeacherConfig, to_dict
from crossdistill.errors import UserError
from crossdistill.models import load_tokenizer

CELLS = [Cell("ce"), Cell("same", "llama3", "forward_kl"), Cell("cross-qwen3-kl", "qwen3", "kl")]


def _spec(tmp_path, **kw) -> QualitySpec:
    return QualitySpec(student_tokenizer="s", teacher_tokenizers=["t"], out=tmp_path, **kw)


def _runs(cross: dict[int, float]) -> dict[str, dict[int, float]]:
    return {
        "ce": {0: 2.0, 1: 2.1, 2: 2.2},
        "same": {0: 1.8, 1: 1.9, 2: 2.0},
        "cross-qwen3-kl": cross,
    }


def test_gap_closed_per_seed_then_mean_and_spread(tmp_path):
    teachers = {"llama3": 1.0, "qwen3": 1.02}
    report = summarize(teachers, _runs({0: 1.9, 1: 1.95, 2: 1.9}), CELLS, "llama3", _spec(tmp_path))
    assert report["refused"] is None
    (entry,) = report["cross"]
    closed = [(2.0 - 1.9) / 0.2, (2.1 - 1.95) / 0.2, (2.2 - 1.9) / 0.2]  # 0.5, 0.75, 1.5
    assert entry["gap_closed"]["mean"] == pytest.approx(statistics.fmean(closed), abs=1e-12)
    assert entry["gap_closed"]["std"] == pytest.approx(statistics.stdev(closed), abs=1e-12)
    assert entry["bpb"]["mean"] == pytest.approx((1.9 + 1.95 + 1.9) / 3, abs=1e-12)
    assert entry["beats_ce_every_seed"] is True
    assert entry["tokenizer"] == "qwen3" and entry["loss"] == "kl" and entry["refused"] is None
    assert report["ce_only"]["mean"] == pytest.approx(2.1) and report["ce_only"]["n"] == 3
    assert report["teachers"] == teachers and report["default_loss"]


def test_gap_closed_of_the_means_and_its_bootstrap_interval(tmp_path):
    """The ratio of the cells' mean gains over the paired seeds, by hand; its interval holds it,
    is the same when rebuilt, collapses when every seed says the same, and leaves out the
    resamples whose same-tokenizer gain is not positive."""
    report = summarize(
        {"llama3": 1.0, "qwen3": 1.0}, _runs({0: 1.9, 1: 1.95, 2: 1.9}), CELLS, "llama3",
        _spec(tmp_path),
    )  # fmt: skip
    means = report["cross"][0]["gap_closed_of_means"]
    assert means["value"] == pytest.approx((2.1 - 1.9166666666666667) / 0.2, abs=1e-12)
    assert means["low"] <= means["value"] <= means["high"] and means["used"] == 4000
    assert gap_of_means([2.0, 2.1, 2.2], [1.8, 1.9, 2.0], [1.9, 1.95, 1.9]) == means
    flat = gap_of_means([2.0] * 4, [1.8] * 4, [1.85] * 4)
    assert flat["value"] == flat["low"] == flat["high"] == pytest.approx(0.75, abs=1e-12)
    # seed 1's same-tokenizer KD loses: resamples of seed 1 alone have no gap to close
    mixed = gap_of_means([2.0, 2.0], [1.8, 2.1], [1.9, 2.0])
    assert mixed["value"] == pytest.approx(0.1 / 0.1) and 0 < mixed["used"] < 4000
    assert gap_of_means([2.0], [2.1], [1.9]) == {
        "value": None,
        "low": None,
        "high": None,
        "used": 0,
    }


def test_several_teacher_seeds_pair_each_run_with_its_students_ce_run(tmp_path):
    """KD runs keyed (teacher seed, seed): each is paired with the CE-only student of its seed,
    the gap closed runs over all of them and is given under each teacher seed, by hand; the
    two-level interval spans what the teachers alone move; runs keyed by seed alone are
    teacher seed 0, to the last digit."""
    teachers = {"llama3": 1.0, "qwen3": 1.0}
    ce = {0: 2.0, 1: 2.1, 2: 2.2}
    same = {(t, s): ce[s] - 0.2 for t in (0, 1) for s in ce}
    # the cross teacher of seed 0 closes half of every gap, that of seed 1 all of it
    cross = {(t, s): ce[s] - 0.1 * (1 + t) for t in (0, 1) for s in ce}
    report = summarize(
        teachers, {"ce": ce, "same": same, "cross-qwen3-kl": cross}, CELLS, "llama3",
        _spec(tmp_path),
    )  # fmt: skip
    assert report["refused"] is None and report["ce_only"]["n"] == 3
    (entry,) = report["cross"]
    assert entry["seeds"] == [0, 1, 2] and entry["teacher_seeds"] == [0, 1]
    assert entry["bpb"]["n"] == 6 and entry["beats_ce_every_seed"] is True
    assert entry["gap_closed"]["runs"] == pytest.approx([0.5] * 3 + [1.0] * 3, abs=1e-12)
    assert entry["gap_closed_by_teacher_seed"] == pytest.approx({"0": 0.5, "1": 1.0}, abs=1e-12)
    means = entry["gap_closed_of_means"]
    assert means["value"] == pytest.approx(0.75, abs=1e-12)
    # the students agree, so only the teachers move it: each alone, or both
    assert means["low"] == pytest.approx(0.5) and means["high"] == pytest.approx(1.0)
    assert report["same_kd"]["change_vs_ce"]["n"] == 6
    out = io.StringIO()
    print_table(report, file=out)
    assert "under each teacher seed 50%, 100%" in out.getvalue()

    one = summarize(teachers, _runs({0: 1.9, 1: 1.95, 2: 1.9}), CELLS, "llama3", _spec(tmp_path))
    keyed = {
        name: r if name == "ce" else {(0, s): v for s, v in r.items()}
        for name, r in _runs({0: 1.9, 1: 1.95, 2: 1.9}).items()
    }
    assert summarize(teachers, keyed, CELLS, "llama3", _spec(tmp_path)) == one
    assert "gap_closed_by_teacher_seed" not in one["cross"][0]

    same[(1, 2)] = 2.25  # under teacher seed 1, seed 2's same-tokenizer KD loses
    report = summarize(
        teachers, {"ce": ce, "same": same, "cross-qwen3-kl": cross}, CELLS, "llama3",
        _spec(tmp_path),
    )  # fmt: skip
    assert "on 1 of 6 runs (teacher seed 1, seed 2: 2.2500 vs 2.2000" in report["refused"]
    with pytest.raises(UserError, match="--teacher-seeds 0: give at least 1"):
        _spec(tmp_path, teacher_seeds=0).check()


def test_a_small_same_tokenizer_gain_is_compared_with_a_warning(tmp_path):
    """Same-tokenizer KD's paired gain over CE only is reported; under `min_same_gain` the
    comparison stands with one warning naming the flag, and at or above it there is none."""
    teachers = {"llama3": 1.0, "qwen3": 1.0}
    runs = _runs({0: 1.9, 1: 1.95, 2: 1.9})  # same-tokenizer KD: -10%, -9.5%, -9.1%
    report = summarize(teachers, runs, CELLS, "llama3", _spec(tmp_path))
    gain = report["same_kd"]["change_vs_ce"]
    want = [1.8 / 2.0 - 1, 1.9 / 2.1 - 1, 2.0 / 2.2 - 1]
    assert gain["runs"] == pytest.approx(want, abs=1e-12) and gain["better"] == 3
    assert report["refused"] is None and report["warnings"] == []
    report = summarize(teachers, runs, CELLS, "llama3", _spec(tmp_path, min_same_gain=0.096))
    (line,) = report["warnings"]
    assert report["refused"] is None and "gains 9.5% over CE only" in line
    assert "--min-same-gain" in line and "gap_closed" in report["cross"][0]
    assert "--teacher-steps" in line and "--student-bytes" in line
    out = io.StringIO()
    print_table(report, file=out)
    assert "note: same-tokenizer KD gains 9.5%" in out.getvalue()
    assert "vs CE only, paired: -9.54%" in out.getvalue()
    with pytest.raises(UserError, match="--min-same-gain is a fraction"):
        _spec(tmp_path, min_same_gain=5.0).check()


def test_a_seed_where_cross_kd_loses_is_reported(tmp_path):
    report = summarize(
        {"llama3": 1.0, "qwen3": 1.0}, _runs({0: 1.9, 1: 2.15, 2: 1.9}), CELLS, "llama3",
        _spec(tmp_path),
    )  # fmt: skip
    (entry,) = report["cross"]
    assert entry["beats_ce_every_seed"] is False
    assert entry["gap_closed"]["runs"][1] == pytest.approx((2.1 - 2.15) / 0.2)


def test_paired_changes_against_ce_and_the_first_target(tmp_path):
    """Each cross cell's change against the CE student of the same seed, and a second target's
    against the first target of the same teacher and loss, seed by seed."""
    cells = CELLS + [Cell("cross-qwen3-kl-lookahead", "qwen3", "kl", "lookahead")]
    runs = _runs({0: 1.9, 1: 1.95, 2: 1.9})
    runs["cross-qwen3-kl-lookahead"] = {0: 1.85, 1: 2.0, 2: 1.8}
    report = summarize({"llama3": 1.0, "qwen3": 1.0}, runs, cells, "llama3", _spec(tmp_path))
    first, second = report["cross"]
    want = [1.9 / 2.0 - 1, 1.95 / 2.1 - 1, 1.9 / 2.2 - 1]
    assert first["change_vs_ce"]["runs"] == pytest.approx(want, abs=1e-15)
    assert first["change_vs_ce"]["std"] == pytest.approx(statistics.stdev(want), abs=1e-15)
    assert first["change_vs_ce"]["better"] == 3 and "change_vs_target" not in first
    versus = second["change_vs_target"]
    assert versus["target"] == TeacherConfig.target and versus["better"] == 2
    assert versus["runs"] == pytest.approx([1.85 / 1.9 - 1, 2.0 / 1.95 - 1, 1.8 / 1.9 - 1])
    assert versus["mean"] == pytest.approx(statistics.fmean(versus["runs"]), abs=1e-15)
    assert second["change_vs_ce"]["better"] == 3  # 2.0 < 2.1 on seed 1
    buffer = io.StringIO()
    print_table(report, file=buffer)
    assert f"vs the {TeacherConfig.target} target, paired:" in buffer.getvalue()
    assert "lower on 2 of 3 seeds" in buffer.getvalue()

    # a kd_chunks cell of the same target is compared with the first cell, named
    cells.append(Cell("cross-qwen3-kl-single_side", "qwen3", "kl", kd_chunks="single_side"))
    runs["cross-qwen3-kl-single_side"] = {0: 1.8, 1: 1.9, 2: 1.95}
    report = summarize({"llama3": 1.0, "qwen3": 1.0}, runs, cells, "llama3", _spec(tmp_path))
    third = report["cross"][2]
    assert third["kd_chunks"] == "single_side" and third["change_vs_target"]["better"] == 2
    buffer = io.StringIO()
    print_table(report, file=buffer)
    assert "cross KD qwen3 kl kd_chunks single_side" in buffer.getvalue()
    assert "vs cross-qwen3-kl, paired:" in buffer.getvalue()
    # so is a ce_without_kd cell
    name = "cross-qwen3-kl-single_side-ce_full"
    cells.append(Cell(name, "qwen3", "kl", kd_chunks="single_side", ce_without_kd="full"))
    runs[name] = {0: 1.7, 1: 1.9, 2: 1.95}
    report = summarize({"llama3": 1.0, "qwen3": 1.0}, runs, cells, "llama3", _spec(tmp_path))
    fourth = report["cross"][3]
    assert fourth["ce_without_kd"] == "full" and fourth["change_vs_target"]["better"] == 2
    assert report["cross"][2]["ce_without_kd"] == "ratio"
    buffer = io.StringIO()
    print_table(report, file=buffer)
    assert "cross KD qwen3 kl kd_chunks single_side ce_without_kd full" in buffer.getvalue()


def test_teachers_of_one_tokenizer_further_apart_than_the_bound_are_named(tmp_path):
    # C headers at --scale cpu: Llama-3's teachers from four seeds ended 10% apart, Qwen3's
    # within 1% on two of them; the means compare, yet the seeds decide it
    seeds = {
        "llama3": {0: 2.1269, 1: 1.9335, 2: 2.0688, 3: 1.9568},
        "qwen3": {0: 1.9460, 1: 1.9623},
    }
    means = {label: sum(v.values()) / len(v) for label, v in seeds.items()}
    runs = _runs({0: 1.85, 1: 1.95, 2: 2.05})
    report = summarize(means, runs, CELLS, "llama3", _spec(tmp_path), seeds)
    (line,) = [w for w in report["warnings"] if "seeds ended" in w]
    assert line.startswith("teacher llama3's 4 seeds ended 10.0% apart (1.9335 to 2.1269")
    assert "--teacher-seeds" in line and "--piece-bytes" in line
    # within the bound (Qwen3's 0.8%), or a single seed: no such line
    assert (
        summarize(means, runs, CELLS, "llama3", _spec(tmp_path), {"qwen3": seeds["qwen3"]})[
            "warnings"
        ]
        == summarize(means, runs, CELLS, "llama3", _spec(tmp_path))["warnings"]
    )
    loose = summarize(means, runs, CELLS, "llama3", _spec(tmp_path, max_teacher_spread=0.11), seeds)
    assert not any("seeds ended" in w for w in loose["warnings"])


def test_teachers_too_far_apart_refuse_the_pair(tmp_path):
    report = summarize(
        {"llama3": 1.0, "qwen3": 1.05}, _runs({0: 1.9, 1: 1.9, 2: 1.9}), CELLS, "llama3",
        _spec(tmp_path),
    )  # fmt: skip
    (entry,) = report["cross"]
    assert "gap_closed" not in entry
    assert "qwen3" in entry["refused"] and "5.0%" in entry["refused"]
    assert "(--teacher-seeds 2 or more: at --scale cpu one tokenizer's teachers" in entry["refused"]
    assert report["refused"] == entry["refused"]  # the only pair: nothing left to compare
    # at the gpu scale one tokenizer's teachers of two seeds ended close: the hint says so
    gpu = summarize(
        {"llama3": 1.0, "qwen3": 1.05}, _runs({0: 1.9, 1: 1.9, 2: 1.9}), CELLS, "llama3",
        _spec(tmp_path, scale_name="gpu"),
    )["refused"]  # fmt: skip
    assert "at --scale gpu one tokenizer's two teachers ended within" in gpu
    assert "--scale cpu" not in gpu
    loose = summarize(
        {"llama3": 1.0, "qwen3": 1.05}, _runs({0: 1.9, 1: 1.9, 2: 1.9}), CELLS, "llama3",
        _spec(tmp_path, max_teacher_spread=0.06),
    )  # fmt: skip
    assert loose["refused"] is None and "gap_closed" in loose["cross"][0]


def test_a_teacher_no_better_than_the_student_refuses(tmp_path):
    report = summarize(
        {"llama3": 1.95, "qwen3": 1.95}, _runs({0: 1.9, 1: 1.9, 2: 1.9}), CELLS, "llama3",
        _spec(tmp_path),
    )  # fmt: skip
    assert "not 10% better than the CE-only student" in report["refused"]
    assert "\n" not in report["refused"]
    assert "gap_closed" not in report["cross"][0]


def test_same_tokenizer_kd_that_does_not_help_refuses(tmp_path):
    runs = _runs({0: 1.9, 1: 1.9, 2: 1.9})
    runs["same"] = {0: 2.0, 1: 2.2, 2: 2.2}
    report = summarize({"llama3": 1.0, "qwen3": 1.0}, runs, CELLS, "llama3", _spec(tmp_path))
    assert report["refused"].startswith("same-tokenizer KD")


def test_same_tokenizer_kd_losing_on_one_seed_refuses(tmp_path):
    """On average better, but not on seed 1: that seed's gap closed would divide by noise."""
    runs = _runs({0: 1.9, 1: 1.9, 2: 1.9})
    runs["same"] = {0: 1.7, 1: 2.12, 2: 1.9}
    report = summarize({"llama3": 1.0, "qwen3": 1.0}, runs, CELLS, "llama3", _spec(tmp_path))
    assert report["refused"].startswith("same-tokenizer KD is not better than CE only on 1 of 3")
    assert "(seed 1: 2.1200 vs 2.1000" in report["refused"]
    assert "gap_closed" not in report["cross"][0]


def test_a_diverged_run_is_refused_never_averaged(tmp_path):
    report = summarize(
        {"llama3": 1.0, "qwen3": 1.0}, _runs({0: 1.9, 1: math.nan, 2: 1.9}), CELLS, "llama3",
        _spec(tmp_path),
    )  # fmt: skip
    assert "cross-qwen3-kl seed 1" in report["refused"] and "non-finite" in report["refused"]
    assert "gap_closed" not in report["cross"][0]
    nan_teacher = summarize(
        {"llama3": 1.0, "qwen3": math.inf}, _runs({0: 1.9}), CELLS, "llama3", _spec(tmp_path)
    )
    assert nan_teacher["refused"].startswith("teacher qwen3")


def test_settings_are_checked_once_with_the_fix_named(tmp_path, tokenizer_dir):
    llama3, qwen3 = str(tokenizer_dir("llama3")), str(tokenizer_dir("qwen3"))
    base = dict(student_tokenizer=llama3, teacher_tokenizers=[qwen3], out=tmp_path)
    QualitySpec(**base).check()
    bad = [
        (dict(seeds=1), "--seeds 5"),
        (dict(teacher_tokenizers=[llama3]), "is the student's tokenizer"),
        (dict(teacher_tokenizers=[]), "--teacher-tokenizer"),
        (dict(losses=["nope"]), "unknown --loss 'nope'"),
        (dict(kd_ratios=[0.5, 0.0]), "--kd-ratio must be in .0, 1., got 0.0"),
        (dict(kd_ratios=[]), "give at least one --kd-ratio"),
        (dict(corpora=[str(tmp_path / "missing.jsonl")]), "does not exist"),
    ]
    for change, message in bad:
        with pytest.raises(UserError, match=message.replace("'", ".")):
            QualitySpec(**{**base, **change}).check()


def test_targets_apply_to_the_projected_losses_and_the_others_run_once():
    got = cell_settings(["forward_kl", "uld", "jsd", "hkl"], ["prefix", "lookahead"])
    assert got == [
        ("forward_kl", "prefix"),
        ("forward_kl", "lookahead"),
        ("uld", "auto"),
        ("jsd", "prefix"),
        ("jsd", "lookahead"),
        ("hkl", "auto"),
    ]


def test_auto_is_resolved_and_reported_for_the_projected_losses_only(tmp_path, tokenizer_dir):
    """`target: auto` means something only to a loss with a projected target: the report names
    what it chose for `forward_kl`, and nothing for `gold`, which uses no target."""
    from pathlib import Path

    from crossdistill.bench.quality import Experiment, model_entry

    teacher_tok = str(tokenizer_dir("llama2"))
    spec = QualitySpec(
        student_tokenizer=str(tokenizer_dir("gpt2")), teacher_tokenizers=[teacher_tok],
        out=tmp_path, scale_name="quick", scale=SCALES["quick"], seeds=2,
        losses=["forward_kl", "gold"],
    )  # fmt: skip
    exp = Experiment(spec, log=lambda _: None)
    exp.teacher_jobs()  # writes the corpus the runs' configs name; trains nothing
    exp.teacher_paths[("llama2", 0)] = Path(teacher_tok)  # `auto` reads only its tokenizer
    vocab = exp.vocab[spec.student_tokenizer]
    student = model_entry(spec.scale.student, spec.student_tokenizer, vocab)
    names = [cell.name for cell in exp.cells]
    assert names == ["ce", "same", "cross-llama2-forward_kl", "cross-llama2-gold"]
    for cell in exp.cells:
        exp.student_job(cell, student, seed=0)
    # GPT-2's tokens are short: Llama-2's first piece is right too often for a far pair here,
    # and too rarely for a near one, and every pair short of near gets the split
    assert exp.chosen == {"cross-llama2-forward_kl": "lookahead_split"}


def _quick_cells(tmp_path, tokenizer_dir, *flags: str, target: str = "first_piece"):
    """`bench quality FLAGS` at the quick scale, GPT-2 student and Llama-2 teacher at `target`, with its corpus written and Llama-2's tokenizer folder standing in for its trained
    teacher: (spec, experiment, the student's model entry), for building run configs."""
    from pathlib import Path

    from crossdistill.bench.quality import Experiment, model_entry

    teacher_tok = str(tokenizer_dir("llama2"))
    spec = replace(parsed_spec(tmp_path, *flags), student_tokenizer=str(tokenizer_dir("gpt2")),
                   teacher_tokenizers=[teacher_tok], scale_name="quick", scale=SCALES["quick"],
                   seeds=2, targets=[target])  # fmt: skip
    exp = Experiment(spec, log=lambda _: None)
    exp.teacher_jobs()  # writes the corpus the runs' configs name; trains nothing
    exp.teacher_paths[("llama2", 0)] = Path(teacher_tok)
    student = model_entry(spec.scale.student, spec.student_tokenizer, exp.vocab[teacher_tok])
    return spec, exp, student


def _report_of_two_cells(exp, spec) -> dict:
    """The report of `_quick_cells`' experiment on made-up bits per byte: CE only 2.0 and 2.1,
    same-tokenizer 1.8 and 1.9, every cross cell 1.85 and 1.95."""
    cells = [c for c in exp.cells if c.teacher is not None]
    results = {"ce": {0: 2.0, 1: 2.1}, "same": {(0, 0): 1.8, (0, 1): 1.9}}
    results |= {c.name: {(0, 0): 1.85, (0, 1): 1.95} for c in cells[1:]}
    return summarize({"gpt2": 1.5, "llama2": 1.5}, results, exp.cells, "gpt2", spec)


def test_kd_chunks_and_ce_without_kd_cells_reach_the_student_runs(tmp_path, tokenizer_dir):
    """`--kd-chunks all --kd-chunks single_side --ce-without-kd ratio --ce-without-kd full`:
    each cross cell runs under each pair, and the options reach the run's teacher and training
    settings; a run saved before the options existed is still the same run as the default's
    (so a rerun reuses it)."""
    from crossdistill.train.demo import _saved_config

    spec, exp, student = _quick_cells(tmp_path, tokenizer_dir, "--kd-chunks", "all",
                                      "--kd-chunks", "single_side", "--ce-without-kd", "ratio",
                                      "--ce-without-kd", "full")  # fmt: skip
    assert spec.kd_chunks == ["all", "single_side"] and spec.ce_without_kd == ["ratio", "full"]
    names = [cell.name for cell in exp.cells]
    base = "cross-llama2-forward_kl-first_piece"
    assert names == ["ce", "same", base, f"{base}-ce_full", f"{base}-single_side",
                     f"{base}-single_side-ce_full"]  # fmt: skip
    runs = {cell.name: exp.student_job(cell, student, seed=0).cfg for cell in exp.cells}
    every, single = runs[base], runs[f"{base}-single_side-ce_full"]
    assert every.teachers[0].kd_chunks == "all" and single.teachers[0].kd_chunks == "single_side"
    assert every.train.ce_without_kd == "ratio" and single.train.ce_without_kd == "full"
    assert runs[f"{base}-ce_full"].teachers[0].kd_chunks == "all"
    assert runs[f"{base}-ce_full"].train.ce_without_kd == "full"
    assert runs["same"].teachers[0].kd_chunks == "all"
    assert runs["same"].train.ce_without_kd == runs["ce"].train.ce_without_kd == "ratio"
    saved = tmp_path / "config.json"
    raw = to_dict(every)
    raw["teachers"][0].pop("kd_chunks")
    raw["train"].pop("ce_without_kd")
    raw["train"].pop("kd_warmup_steps")
    saved.write_text(json.dumps(raw))
    assert _saved_config(saved) == to_dict(every)
    with pytest.raises(UserError, match="unknown --kd-chunks 'both'"):
        replace(spec, kd_chunks=["both"]).check()
    with pytest.raises(UserError, match="unknown --ce-without-kd 'half'; use one of ratio, full"):
        replace(spec, ce_without_kd=["half"]).check()


@pytest.mark.parametrize(
    "flag, setting, values, suffix",
    [
        ("--past-end", "past_end", ["all", "canonical"], "past_end_canonical"),
        ("--deep-alternatives", "deep_alternatives", ["join", "longest"], "deep_longest"),
    ],
)
def test_teacher_setting_cells_reach_the_student_runs(
    tmp_path, tokenizer_dir, flag, setting, values, suffix
):
    """`--past-end all --past-end canonical`, `--deep-alternatives join --deep-alternatives
    longest`: each cross cell of a target the setting changes runs under each value, the value
    reaches the run's teacher, the report names it; a run saved before the setting existed is
    the default's (the first value); a target it does not change runs once; an unknown value is
    refused in one line."""
    from crossdistill.train.demo import _saved_config

    default, other = values
    spec, exp, student = _quick_cells(tmp_path, tokenizer_dir, flag, default, flag, other,
                                      target="lookahead_split")  # fmt: skip
    assert getattr(spec, setting) == values
    base = "cross-llama2-forward_kl-lookahead_split"
    names = [cell.name for cell in exp.cells]
    assert names == ["ce", "same", base, f"{base}-{suffix}"]
    runs = {cell.name: exp.student_job(cell, student, seed=0).cfg for cell in exp.cells}
    assert getattr(runs[base].teachers[0], setting) == default
    assert getattr(runs[f"{base}-{suffix}"].teachers[0], setting) == other
    assert getattr(runs["same"].teachers[0], setting) == default
    saved = tmp_path / "config.json"
    raw = to_dict(runs[base])
    raw["teachers"][0].pop(setting)
    saved.write_text(json.dumps(raw))
    assert _saved_config(saved) == to_dict(runs[base])
    report = _report_of_two_cells(exp, spec)
    assert [e[setting] for e in report["cross"]] == values
    buffer = io.StringIO()
    print_table(report, file=buffer)
    assert f"{setting} {other}" in buffer.getvalue()
    _, first, _ = _quick_cells(tmp_path / "first", tokenizer_dir, flag, default, flag, other)
    assert [c.name for c in first.cells] == ["ce", "same", "cross-llama2-forward_kl-first_piece"]
    with pytest.raises(UserError, match=f"unknown {flag} 'some'; use one of {', '.join(values)}"):
        replace(spec, **{setting: ["some"]}).check()


def test_many_chunks_cells_reach_the_student_runs(tmp_path, tokenizer_dir):
    """`--many-chunks first_piece --many-chunks path`: each lookahead cross cell runs under each,
    the option reaches the run's teacher and the report names it. A run saved before the option
    existed ran under first_piece, so it is that cell's run and not the default's (path); a
    target that is not a lookahead one runs once; an unknown value is refused in one line."""
    from crossdistill.train.demo import _saved_config

    spec, exp, student = _quick_cells(tmp_path, tokenizer_dir, "--many-chunks", "first_piece",
                                      "--many-chunks", "path", target="lookahead_split")  # fmt: skip
    assert spec.many_chunks == ["first_piece", "path"]
    base = "cross-llama2-forward_kl-lookahead_split"
    old = f"{base}-many_first_piece"
    assert [cell.name for cell in exp.cells] == ["ce", "same", old, base]
    runs = {cell.name: exp.student_job(cell, student, seed=0).cfg for cell in exp.cells}
    assert runs[old].teachers[0].many_chunks == "first_piece"
    assert runs[base].teachers[0].many_chunks == "path"
    saved = tmp_path / "config.json"
    raw = to_dict(runs[old])
    raw["teachers"][0].pop("many_chunks")
    saved.write_text(json.dumps(raw))
    assert _saved_config(saved) == to_dict(runs[old]) != to_dict(runs[base])
    raw = to_dict(runs["same"])  # a teacher whose target may not read the path: as before
    raw["teachers"][0]["target"] = "first_piece"
    expected = json.loads(json.dumps(raw))
    raw["teachers"][0].pop("many_chunks")
    saved.write_text(json.dumps(raw))
    assert _saved_config(saved) == expected
    report = _report_of_two_cells(exp, spec)
    assert [e["many_chunks"] for e in report["cross"]] == ["first_piece", "path"]
    buffer = io.StringIO()
    print_table(report, file=buffer)
    assert "many_chunks first_piece" in buffer.getvalue()
    _, first, _ = _quick_cells(tmp_path / "first", tokenizer_dir, "--many-chunks", "first_piece")
    assert [c.name for c in first.cells] == ["ce", "same", "cross-llama2-forward_kl-first_piece"]
    with pytest.raises(
        UserError, match="unknown --many-chunks 'all'; use one of first_piece, path"
    ):
        replace(spec, many_chunks=["all"]).check()


def test_a_teacher_trained_under_any_jobs_is_found_under_every_jobs(tmp_path, tokenizer_dir):
    """`--jobs 1` shows progress bars and more jobs do not; a teacher trained under one is the
    same teacher under the other: its folder is found, and its saved config is the same run. A
    setting that trains differently is still another run."""
    from crossdistill.bench.quality import Experiment
    from crossdistill.train.demo import _same_run

    def teachers(jobs: int) -> list:
        spec = replace(parsed_spec(tmp_path, "--jobs", str(jobs)), student_tokenizer=str(
            tokenizer_dir("gpt2")), teacher_tokenizers=[str(tokenizer_dir("llama2"))],
            scale_name="quick", scale=SCALES["quick"])  # fmt: skip
        return Experiment(spec, log=lambda _: None).teacher_jobs()

    fresh = [job.cfg.run.out_dir for job in teachers(1)]
    trained = teachers(2)  # as if trained: their configs saved where a run saves them
    for job in trained:
        Path(job.cfg.run.out_dir).mkdir(parents=True)
        (Path(job.cfg.run.out_dir) / "config.json").write_text(json.dumps(to_dict(job.cfg)))
    found = teachers(1)
    assert [job.cfg.run.out_dir for job in found] == [job.cfg.run.out_dir for job in trained]
    assert fresh != [job.cfg.run.out_dir for job in trained]  # each setting hashes apart
    one, two = to_dict(found[0].cfg), to_dict(trained[0].cfg)
    assert one["run"]["progress"] and not two["run"]["progress"]
    assert _same_run(one, two) and not _same_run(None, two)
    longer = json.loads(json.dumps(one))
    longer["train"]["steps"] += 1
    assert not _same_run(longer, two)


def test_student_text_smaller_than_one_piece_is_refused(tmp_path, tokenizer_dir, capsys):
    argv = [
        "bench", "quality", "--student-tokenizer", str(tokenizer_dir("gpt2")),
        "--teacher-tokenizer", str(tokenizer_dir("llama2")), "--out", str(tmp_path),
        "--student-bytes", "100",
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"give at least {SCALES['cpu'].piece_bytes}" in err[0]
    assert not (tmp_path / "data").exists()


def parsed_spec(out, *extra: str) -> QualitySpec:
    """The spec `bench quality` builds from its command line, with placeholder tokenizers."""
    argv = [
        "bench", "quality", "--student-tokenizer", "s", "--teacher-tokenizer", "t",
        "--out", str(out), *extra,
    ]  # fmt: skip
    return spec_from_args(build_parser().parse_args(argv))


def test_gpu_scale_students_take_the_first_megabyte_from_cached_teachers(tmp_path):
    def spec(*extra: str) -> QualitySpec:
        return parsed_spec(tmp_path, *extra)

    assert spec("--scale", "gpu").scale.student_train_bytes == 1_000_000
    assert spec("--scale", "gpu", "--student-bytes", "0").scale.student_train_bytes is None
    assert spec("--scale", "gpu", "--student-bytes", "50000").scale.student_train_bytes == 50_000
    assert spec("--scale", "cpu").scale.student_train_bytes is None
    with pytest.raises(UserError, match="or 0 for all of the text"):
        spec("--scale", "gpu", "--student-bytes", "-3")
    # the gpu scale's students read their megabyte in epochs: the teachers from caches
    assert spec("--scale", "gpu").scale.teacher_cache
    assert not spec("--scale", "gpu", "--no-teacher-cache").scale.teacher_cache
    assert not spec("--scale", "cpu").scale.teacher_cache
    assert spec("--scale", "cpu", "--teacher-cache").scale.teacher_cache


def test_learning_rates_override_the_scale_and_nonsense_is_refused(tmp_path):
    def spec(*extra: str) -> QualitySpec:
        return parsed_spec(tmp_path, "--scale", "cpu", *extra)

    cpu = SCALES["cpu"]
    assert (spec().scale.teacher_lr, spec().scale.student_lr) == (cpu.teacher_lr, cpu.student_lr)
    changed = spec("--teacher-lr", "5e-4", "--student-lr", "2.5e-4").scale
    assert (changed.teacher_lr, changed.student_lr) == (5e-4, 2.5e-4)
    assert changed.teacher == cpu.teacher and changed.student_steps == cpu.student_steps
    for flag, value in (("--student-lr", "0"), ("--teacher-lr", "3"), ("--student-lr", "-1e-3")):
        with pytest.raises(UserError, match=f"{flag} .* is not a learning rate"):
            spec(f"{flag}={value}")


def test_teacher_size_overrides_the_scale_with_the_gpu_scales_shape(tmp_path):
    def spec(*extra: str) -> QualitySpec:
        return parsed_spec(tmp_path, "--scale", "cpu", *extra)

    assert spec().scale.teacher == SCALES["cpu"].teacher
    assert spec("--teacher-size", "1024x12").scale.teacher == SCALES["gpu"].teacher
    changed = spec("--teacher-size", "512X8").scale
    assert changed.teacher == teacher_shape(512, 8)
    assert (changed.teacher["num_attention_heads"], changed.teacher["num_hidden_layers"]) == (8, 8)
    assert changed.student == SCALES["cpu"].student
    assert changed.teacher_steps == SCALES["cpu"].teacher_steps
    for value in ("512", "500x8", "512x0", "x8", "big"):
        with pytest.raises(UserError, match="--teacher-size .*512x8"):
            spec(f"--teacher-size={value}")


def test_the_students_share_is_spread_through_an_ordered_corpus():
    # a corpus ordered by source: four sources of 50 pieces each, in turn
    pieces = [f"{source} piece {i:03d} " * 40 for source in "abcd" for i in range(50)]
    total = sum(len(p.encode()) for p in pieces)
    share = spread_pieces(pieces, total // 10)
    assert abs(sum(len(p.encode()) for p in share) - total / 10) <= len(pieces[0].encode())
    assert {p[0] for p in share} == set("abcd")  # every source, not the first one only
    index = [pieces.index(p) for p in share]
    assert index == sorted(index) and len(set(index)) == len(index)  # in order, none twice
    assert {b - a for a, b in zip(index, index[1:])} == {10}  # an even stride
    assert spread_pieces(pieces, total) == pieces and spread_pieces(pieces, 10 * total) == pieces
    assert spread_pieces(pieces, 1) == pieces[:1]


def test_bytes_per_token_samples_the_whole_of_an_ordered_corpus(tokenizer_dir):
    prose = ["the quick brown fox jumps over the lazy dog and runs away\n" * 30] * 200
    digits = ["0x1f3a 0x2b4c 0x3d5e 0x4f60 0x5172 0x6384 0x7496 0x85a8\n" * 30] * 200
    tok = str(tokenizer_dir("llama3"))
    whole = bytes_per_token(tok, prose + digits, sample_bytes=10**9)
    spread = bytes_per_token(tok, prose + digits, sample_bytes=len(prose[0]) * 40)
    first = bytes_per_token(tok, prose, sample_bytes=10**9)
    assert first > 1.5 * bytes_per_token(tok, digits, sample_bytes=10**9)  # they differ
    assert spread == pytest.approx(whole, rel=0.02)  # not the first source's


def test_pieces_are_the_scales_size_and_a_flag_sets_them(tmp_path, tokenizer_dir):
    """A step's rows are filled in order, so the pieces set how many places in the corpus a
    step reads: the cpu scale's 4 kB teacher step spans several of its pieces."""
    lines = [f"line {i}, a few words more\n" for i in range(20_000)]
    text = "".join(lines)
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    for size in (300, 1024, PIECE_BYTES):
        pieces = corpus_pieces([str(path)], piece_bytes=size)
        assert "".join(pieces) == text  # nothing lost
        assert all(p.endswith("\n") for p in pieces)  # cut at line ends
        assert all(size // 2 < len(p) <= size for p in pieces[:-1])
    cpu = SCALES["cpu"]
    teacher_step = cpu.teacher_batch * cpu.seq_len * 4  # about 4 bytes a token
    assert teacher_step >= 3 * cpu.piece_bytes
    assert SCALES["gpu"].piece_bytes == PIECE_BYTES  # its numbers were measured so
    assert parsed_spec(tmp_path).scale.piece_bytes == cpu.piece_bytes
    assert parsed_spec(tmp_path, "--piece-bytes", "4096").scale.piece_bytes == 4096
    with pytest.raises(UserError, match="give at least 256"):
        parsed_spec(tmp_path, "--piece-bytes", "100")
    # the students' share is whole pieces: at least one
    with pytest.raises(UserError, match="give at least 4096"):
        parsed_spec(tmp_path, "--piece-bytes", "4096", "--student-bytes", "2000")
    # the experiment writes its corpus in its scale's pieces
    from crossdistill.bench.quality import Experiment

    spec = QualitySpec(
        student_tokenizer=str(tokenizer_dir("gpt2")), out=tmp_path / "out",
        teacher_tokenizers=[str(tokenizer_dir("llama2"))], corpora=[str(path)],
        scale_name="quick", scale=replace(SCALES["quick"], piece_bytes=512),
    )  # fmt: skip
    exp = Experiment(spec, log=lambda _: None)
    exp.teacher_jobs()  # writes the corpus; trains nothing
    rows = {
        name: [json.loads(line)["text"] for line in (exp.data / name).open()]
        for name in ("train.jsonl", "val.jsonl")
    }
    assert all(len(p) <= 512 for p in rows["train.jsonl"] + rows["val.jsonl"])
    assert len(rows["val.jsonl"]) > 10


def test_the_default_corpus_is_split_by_file_then_cut_into_pieces(tmp_path):
    """Without a --corpus the bench reads the standard library's files, holds whole files out,
    and cuts both sides into the scale's pieces as it cuts a --corpus: whole files gave a
    teacher step one or two places in the text."""
    from crossdistill.train.demo_assets import stdlib_corpus

    files, held = stdlib_corpus(max_files=100_000, seed=0, train_bytes=300_000, val_bytes=30_000)
    folder, train = write_corpus(tmp_path, [], train_bytes=300_000, val_bytes=30_000,
                                 piece_bytes=1024)  # fmt: skip
    val = [json.loads(line)["text"] for line in (folder / "val.jsonl").open()]
    assert "".join(train) == "".join(files) and "".join(val) == "".join(held)  # nothing lost
    assert all(len(p) <= 1024 for p in train + val) and len(train) > 2 * len(files)
    assert all(p.endswith("\n") for p in train if len(p) > 600)  # cut at line ends
    whole, whole_train = write_corpus(tmp_path, [], train_bytes=300_000, val_bytes=30_000,
                                      piece_bytes=10**9)  # fmt: skip
    assert whole_train == files and whole != folder  # a size past every file keeps them whole


def test_corpus_split_is_seed_free_disjoint_and_refuses_tiny_corpora(tmp_path):
    lines = [f"line {i} of the corpus, with some words to fill it out\n" for i in range(40_000)]
    path = tmp_path / "corpus.txt"
    path.write_text("".join(lines))
    pieces = corpus_pieces([str(path)])
    assert "".join(pieces) == "".join(lines)  # cut at line ends, nothing lost
    assert all(len(p.encode()) <= PIECE_BYTES for p in pieces) and len(pieces) > 100
    train, val = split_pieces(pieces, train_bytes=10**9, val_bytes=10**9)
    assert (train, val) == split_pieces(list(pieces), train_bytes=10**9, val_bytes=10**9)
    assert val and train and not set(train) & set(val)
    assert len(train) + len(val) == len(set(pieces))
    capped, held = split_pieces(pieces, train_bytes=1_000_000, val_bytes=50_000)
    assert sum(len(p.encode()) for p in capped + held) < 1_050_000 + PIECE_BYTES
    with pytest.raises(UserError, match="too small"):
        split_pieces(pieces[:2], train_bytes=10**9, val_bytes=10**9)
    (tmp_path / "empty.jsonl").write_text(json.dumps({"text": "  "}) + "\n")
    with pytest.raises(UserError, match="no text documents"):
        corpus_pieces([str(tmp_path / "empty.jsonl")])


def test_the_held_out_pieces_are_drawn_from_the_whole_training_stretch():
    """A corpus whose text changes along its length (prose, then tables of numbers, as a
    library's files in order) holds out both, in about their shares of the text trained on,
    and about `val_bytes` of it; filling the held-out text first would take it all from the
    prose."""
    prose = [f"piece {i}: " + "words of a plain sentence, " * 50 + "\n" for i in range(1500)]
    tables = [f"{i:05d} " + "0x1f3a 0x2b4c 0x3d5e 0x4f60 " * 50 + "\n" for i in range(1500)]
    pieces = prose + tables
    size = sum(len(p.encode()) for p in pieces)
    train, val = split_pieces(pieces, train_bytes=size - 100_000, val_bytes=100_000)
    n_val = sum(len(p.encode()) for p in val)
    assert 50_000 < n_val < 150_000
    table_pieces = set(tables)
    in_tables = sum(p in table_pieces for p in val) / len(val)
    assert 0.25 < in_tables < 0.75
    assert not set(train) & set(val) and len(train) + len(val) == len(pieces)


def test_corpus_rows_that_are_not_text_are_named_and_the_text_field_is_chosen(tmp_path):
    """A corpus whose text is under another field (as `content` in code datasets) is refused
    with the row and the flag that fixes it, and read with that flag; rows that are not text
    among good ones are skipped and counted, never silently."""
    text = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(2_000))
    rows = [{"content": text}, {"content": 7}, {"content": text[::-1]}]
    path = tmp_path / "code.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=r"code.jsonl:1: missing field 'text' \(and 2 more rows\)"):
        corpus_pieces([str(path)])
    heard: list[str] = []
    pieces = corpus_pieces([str(path)], text_field="content", log=heard.append)
    assert "".join(pieces) == text + text[::-1]
    assert heard == [
        "[quality] skipped 1 of 3 corpus rows read that are not text documents "
        f"(the first: {path}:2: field 'content' is a int, not a string)"
    ]
    bad = tmp_path / "texts"
    bad.mkdir()
    (bad / "a.txt").write_text(text)
    (bad / "b.bin").write_bytes(b"\xff\xfe\x00 not text")
    heard.clear()
    assert "".join(corpus_pieces([str(bad)], log=heard.append)) == text
    assert heard and "b.bin: non-UTF-8 bytes at line 1" in heard[0]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"content": [text]}), tmp_path / "code.parquet")
    with pytest.raises(
        UserError, match=r"no column 'text' \(columns: content\); name .* --text-field"
    ):
        corpus_pieces([str(tmp_path / "code.parquet")])
    assert "".join(corpus_pieces([str(tmp_path / "code.parquet")], "content")) == text


def test_every_command_that_reads_a_corpus_names_the_text_field_flag(
    tmp_path, tokenizer_dir, capsys
):
    """A table without the text column gets the command line's fix, not the config's."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    table = tmp_path / "code.parquet"
    pq.write_table(pa.table({"content": ["def f(x):\n    return x\n" * 50]}), table)
    gpt2, llama2 = str(tokenizer_dir("gpt2")), str(tokenizer_dir("llama2"))
    for command in (
        ["audit", gpt2, llama2, "--corpus", str(table)],
        ["align", "--student-tokenizer", gpt2, "--teacher-tokenizer", llama2, "--input",
         str(table), "--output", str(tmp_path / "aligned.jsonl")],
    ):  # fmt: skip
        assert main(command) == 2
        err = capsys.readouterr().err
        assert "no column 'text' (columns: content); name the one that holds the text with " in err
        assert "--text-field" in err and "data.text_field" not in err, err


def test_a_corpus_is_read_only_as_far_as_the_split_takes_it(tmp_path, monkeypatch):
    """The split of a streamed corpus is the split of all of it, and reading stops once the
    training and held-out text are full: a corpus far larger than the experiment is not read
    whole."""
    from crossdistill.data.sources import JsonlSource

    docs = [
        f"# file {i}\n" + f"value_{i} = {i} * 2  # a line of code\n" * 400 for i in range(2_000)
    ]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    everything = corpus_pieces([str(path)])
    read_up_to = []  # the last row each read of the file parsed
    real_read = JsonlSource.read
    monkeypatch.setattr(
        JsonlSource, "read", lambda self, a, b: read_up_to.append(b) or real_read(self, a, b)
    )
    reader = CorpusReader([str(path)])
    assert split_pieces(reader, 200_000, 50_000) == split_pieces(everything, 200_000, 50_000)
    assert 0 < reader.rows <= max(read_up_to) < len(docs) // 5  # about 1 MB of the 31 MB


def test_a_corpus_file_the_read_never_reaches_is_named(tmp_path):
    """Corpus files are read in order, as far as the split takes: a later file the scale's bytes
    never reach is named in a warning, not dropped in silence; one that is reached is not."""

    def write(name: str, n: int) -> str:
        path = tmp_path / name
        rows = ({"text": f"# {name} {i}\n" + f"x_{i} = {i}\n" * 300} for i in range(n))
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)

    big, small, last = write("big.jsonl", 400), write("small.jsonl", 40), write("last.jsonl", 40)
    heard: list[str] = []
    write_corpus(
        tmp_path / "a", [big, last], train_bytes=300_000, val_bytes=30_000, log=heard.append
    )
    warned = [line for line in heard if "warning" in line]
    assert len(warned) == 1 and last in warned[0] and big not in warned[0], heard
    assert "0.3 MB" in warned[0] and "name the one you need first" in warned[0]
    heard.clear()
    write_corpus(
        tmp_path / "b", [small, last], train_bytes=300_000, val_bytes=30_000, log=heard.append
    )
    assert not [line for line in heard if "warning" in line], heard


def test_text_field_reaches_the_spec_and_an_empty_one_is_refused(tmp_path):
    args = build_parser().parse_args(
        ["bench", "quality", "--student-tokenizer", "s", "--teacher-tokenizer", "t",
         "--text-field", "content", "--out", str(tmp_path)]
    )  # fmt: skip
    assert spec_from_args(args).text_field == "content"
    for command in (
        ["bench", "quality", "--student-tokenizer", "s", "--teacher-tokenizer", "t"],
        ["audit", "s", "t"],
        ["align", "--student-tokenizer", "s", "--teacher-tokenizer", "t", "--input", "x"],
    ):
        # one name for the text column on every command that reads a corpus, `--field` kept
        short = build_parser().parse_args([*command, "--field", "body"])
        long = build_parser().parse_args([*command, "--text-field", "body"])
        assert vars(short) == vars(long) and "body" in vars(long).values()
    with pytest.raises(UserError, match="--text-field is empty"):
        _spec(tmp_path, text_field="").check()


def test_quick_experiment_end_to_end_then_reused_then_refused(tmp_path, tokenizer_dir, capsys):
    """Teachers, five cells of students, JSON and plot; a rerun trains nothing; a stricter
    threshold turns the same teachers into a one-line refusal and exit status 1."""
    argv = [
        "bench", "quality", "--scale", "quick", "--seeds", "2", "--json",
        "--student-tokenizer", str(tokenizer_dir("gpt2")),
        "--teacher-tokenizer", str(tokenizer_dir("llama2")),
        "--target", "first_piece", "--target", "context",
        "--out", str(tmp_path), "--max-teacher-spread", "1", "--min-teacher-gain", "0",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["teachers"]) == {"gpt2", "llama2"}
    assert all(math.isfinite(v) and 0 < v < 9 for v in report["teachers"].values())
    assert report["ce_only"]["n"] == 2 and report["same_kd"]["n"] == 2
    entry, context = report["cross"]
    assert entry["tokenizer"] == "llama2" and entry["bpb"]["n"] == 2
    assert math.isfinite(entry["gap_closed"]["mean"]) and entry["gap_closed"]["std"] >= 0
    assert isinstance(entry["beats_ce_every_seed"], bool) and report["default_loss"]
    assert (entry["target"], context["target"]) == ("first_piece", "context")
    assert context["cell"] == "cross-llama2-forward_kl-context" and context["bpb"]["n"] == 2
    assert all(math.isfinite(v) for v in context["bpb"]["runs"])
    # the teachers learned: each beats every CE-only student of this scale by a wide margin
    assert max(report["teachers"].values()) < 0.8 * min(report["ce_only"]["runs"])
    assert (tmp_path / "quality.png").stat().st_size > 1000
    assert len((tmp_path / "cells.jsonl").read_text().splitlines()) == 2 + 2 * 4
    assert json.loads((tmp_path / "summary.json").read_text())["cross"] == report["cross"]
    (data,) = (tmp_path / "data").iterdir()  # the text as split, named by its hash
    assert report["settings"]["corpus_digest"] == data.name and len(data.name) == 12
    assert report["settings"]["piece_bytes"] == SCALES["quick"].piece_bytes  # files cut too
    versions = report["settings"]["versions"]  # what a rerun's numbers also depend on
    assert (
        versions["torch"] == torch.__version__ and versions["python"] == platform.python_version()
    )

    # every student and teacher scored by class on the packing the cross students were
    # validated on: theirs are their validations, the others' within the packing's effect
    from benchmarks.bpb_by_class import main as by_class

    by_class([str(tmp_path), "--json", str(tmp_path / "by_class.json"), "--device", "cpu"])
    table = json.loads((tmp_path / "by_class.json").read_text())
    assert sorted(table["cells"]) == sorted(["ce", "same", entry["cell"], context["cell"]])
    for cell, runs in table["cells"].items():
        assert len(runs) == 2
        for row in (r["llama2"] for r in runs.values()):
            close = 1e-6 if cell.startswith("cross") else 3e-3
            assert row["total"] == pytest.approx(row["validation"], rel=close)
            assert sum(row["align"].values()) == pytest.approx(row["total"], rel=1e-9)
    rows = table["gap_closed"][entry["cell"]]
    ce_here = statistics.fmean(r["llama2"]["total"] for r in table["cells"]["ce"].values())
    assert rows["total"]["cross_gain"] == pytest.approx(ce_here - entry["bpb"]["mean"], rel=1e-4)

    start = time.perf_counter()
    assert main(argv) == 0  # everything reused
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["cross"] == report["cross"]
    assert time.perf_counter() - start < 30

    # a second teacher seed: the first's teachers and students are reused to the last digit,
    # the new teachers are runs of their own, and every KD cell learns from each
    one_target = [a for i, a in enumerate(argv) if "context" not in argv[i : i + 2]]
    assert main([*one_target, "--teacher-seeds", "2"]) == 0
    two = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for label, info in two["teacher_runs"].items():
        first, second = info["seeds"]["0"]["bpb"], info["seeds"]["1"]["bpb"]
        assert first == report["teachers"][label] and math.isfinite(second) and second != first
        assert two["teachers"][label] == pytest.approx((first + second) / 2, abs=1e-12)
    for old, new in zip(report["cross"], two["cross"]):
        assert new["teacher_seeds"] == [0, 1] and new["seeds"] == [0, 1] and new["bpb"]["n"] == 4
        assert new["bpb"]["runs"][:2] == old["bpb"]["runs"]  # teacher seed 0 first
        assert len(new["gap_closed_by_teacher_seed"]) == 2
    assert two["ce_only"] == report["ce_only"] and two["same_kd"]["n"] == 4
    rows = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert sum(r.get("teacher_seed") == 1 for r in rows) == 2 + 2 * 2  # teachers, KD students
    assert (tmp_path / "students" / "same" / "seed1-teacher1" / "final").is_dir()

    strict = [*argv[:-2], "--min-teacher-gain", "0.9"]  # the spread rule stays off
    assert main(strict) == 1
    captured = capsys.readouterr()
    refused = json.loads(captured.out.strip().splitlines()[-1])["refused"]
    assert "not 90% better than the CE-only student" in refused
    assert refused in captured.err


def _script(name: str, *args: str) -> dict:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / name
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_source_corpus_takes_each_distinct_file_once_in_path_order(tmp_path):
    """`benchmarks/docs_corpus.py`'s C-header and Perl corpora: the files with the asked
    suffixes below several roots, in path order, short files and repeated texts left out, cut at
    the byte limit."""
    from benchmarks.docs_corpus import source_texts

    one, two = tmp_path / "one", tmp_path / "two"
    (one / "sub").mkdir(parents=True)
    two.mkdir()
    long = {name: f"{name} " * 300 for name in ("a", "b", "c", "d")}
    (one / "b.pm").write_text(long["b"])
    (one / "sub" / "c.pod").write_text(long["c"])
    (one / "a.pl").write_text(long["a"])
    (one / "copy.pm").write_text(long["a"])  # the same text again: left out
    (one / "short.pm").write_text("1;\n")  # under 500 characters: left out
    (one / "notes.txt").write_text(long["d"])  # another suffix: left out
    (two / "d.pm").write_text(long["d"])
    roots, suffixes = [two, one], (".pm", ".pl", ".pod")
    texts = list(source_texts(roots, suffixes, limit=10**9))
    assert texts == [long["a"], long["b"], long["c"], long["d"]]  # path order over both roots
    size = len(long["a"].encode())
    assert list(source_texts(roots, suffixes, limit=2 * size)) == texts[:2]
    assert list(source_texts(roots, (".h",), limit=10**9)) == []


def test_java_corpus_reads_a_jdk_source_archive_in_path_order(tmp_path):
    """`docs_corpus.py --java`: the `.java` members of a JDK's `lib/src.zip`, in path order,
    short and repeated files left out, cut at the byte limit; a JDK without sources is refused
    with the fix."""
    import zipfile

    from benchmarks.docs_corpus import java_texts, jdk_sources

    jdk = tmp_path / "jdk"
    (jdk / "lib").mkdir(parents=True)
    long = {name: f"class {name} {{}}\n" * 60 for name in ("A", "B", "C")}
    with zipfile.ZipFile(jdk / "lib" / "src.zip", "w") as z:
        z.writestr("java.base/java/util/C.java", long["C"])
        z.writestr("java.base/java/lang/A.java", long["A"])
        z.writestr("java.base/java/lang/Copy.java", long["A"])  # the same text again
        z.writestr("java.base/java/lang/Short.java", "class S {}")  # under 500 characters
        z.writestr("java.base/java/lang/B.java", long["B"])
        z.writestr("java.base/java/lang/notes.html", long["C"] + "<p>")  # not Java
    archive = jdk_sources(jdk)
    assert list(java_texts(archive, limit=10**9)) == [long["A"], long["B"], long["C"]]
    assert list(java_texts(archive, limit=len(long["A"]) + 1)) == [long["A"]]
    with pytest.raises(SystemExit, match="no lib/src.zip under .*give --jdk"):
        jdk_sources(tmp_path / "no-jdk")


def test_rust_corpus_reads_rustdoc_source_pages(tmp_path):
    """`docs_corpus.py --rust`: the code of rustdoc's `src/**/*.rs.html` pages, with the line
    numbers and the highlighting gone and entities decoded, in path order, generated and
    repeated files left out; a documentation folder without sources is refused with the fix."""
    from benchmarks.docs_corpus import rust_code, rust_texts, rustdoc_sources

    def page(lines: list[str]) -> str:
        numbered = "\n".join(
            f"<a href=#{i} id={i} data-nosnippet>{i}</a>{line}" for i, line in enumerate(lines, 1)
        )
        return (
            '<html><head><script>var x = "<pre>";</script></head><body><nav>Files</nav>'
            f'<pre class="rust"><code>{numbered}</code></pre><footer>x</footer></body></html>'
        )

    body = [
        '<span class="kw">fn </span>main() -&gt; <span class="string">&quot;a&amp;b&quot;</span> {',
        '    <span class="kw">let</span> v: Vec&lt;u8&gt; = vec![]; // 10 &lt; 11',
        "}",
    ]
    plain = 'fn main() -> "a&b" {\n    let v: Vec<u8> = vec![]; // 10 < 11\n}'
    assert rust_code(page(body)) == plain
    assert rust_code("<html>no code block</html>") == ""

    src = tmp_path / "html" / "src"
    (src / "core" / "num").mkdir(parents=True)
    (src / "alloc").mkdir()
    long = {n: [f"// {n}"] + [f"fn {n}{i}() {{}}" for i in range(60)] for n in ("a", "b", "c")}
    (src / "core" / "num" / "b.rs.html").write_text(page(long["b"]))
    (src / "alloc" / "a.rs.html").write_text(page(long["a"]))
    (src / "alloc" / "copy.rs.html").write_text(page(long["a"]))  # the same code again
    (src / "core" / "gen.rs.html").write_text(
        page(["// This code is automatically generated. DO NOT MODIFY."] + long["c"])
    )
    (src / "core" / "short.rs.html").write_text(page(["fn f() {}"]))  # under 500 characters
    (src / "core" / "index.html").write_text(page(long["c"]))  # not a source page
    texts = list(rust_texts(rustdoc_sources(tmp_path / "html"), limit=10**9))
    assert texts == ["\n".join(long["a"]), "\n".join(long["b"])]
    with pytest.raises(SystemExit, match="no src/ under .*give --rustdoc"):
        rustdoc_sources(tmp_path / "none")


def test_js_corpus_leaves_out_minified_and_generated_files(tmp_path):
    """`docs_corpus.py --js`: the `.js` files under the npm modules folder in path order,
    without minified ones (a line over 1,000 characters), generated ones and repeats; a missing
    folder is refused with the fix."""
    from benchmarks.docs_corpus import js_texts

    root = tmp_path / "node_modules"
    (root / "pkg" / "lib").mkdir(parents=True)
    long = {n: "".join(f"const {n}{i} = {i}\n" for i in range(60)) for n in ("a", "b", "c")}
    (root / "pkg" / "lib" / "b.js").write_text(long["b"])
    (root / "pkg" / "a.js").write_text(long["a"])
    (root / "pkg" / "a.min.js").write_text("var a=" + "1+" * 600 + "1;\n" + long["c"])
    (root / "pkg" / "gen.js").write_text("// Code generated by a tool. DO NOT EDIT.\n" + long["c"])
    (root / "pkg" / "a.json").write_text(long["c"])  # not JavaScript
    assert list(js_texts(root, limit=10**9)) == [long["a"], long["b"]]
    assert list(js_texts(root, limit=len(long["a"]))) == [long["a"]]
    with pytest.raises(SystemExit, match="does not exist: .*give --node-modules"):
        list(js_texts(tmp_path / "none", limit=10))


def test_a_gzip_corpus_written_twice_has_one_md5(tmp_path, monkeypatch):
    """`docs_corpus.py` writes `.gz` corpora with no time in the header: a rebuild of one corpus
    is byte-equal to the first build (its md5, recorded beside a result, can be checked), and
    reads back as the texts written."""
    import gzip
    import hashlib

    from benchmarks.docs_corpus import write_jsonl

    texts = ["class A {}\n", "é and ü\n" * 3]
    digests = []
    for i, when in enumerate((1_000_000_000, 1_500_000_000)):
        out = tmp_path / str(i) / "java.jsonl.gz"
        out.parent.mkdir()
        monkeypatch.setattr(time, "time", lambda t=when: t)  # what gzip stamps in a header
        assert write_jsonl(out, iter(texts)) == (2, sum(len(t.encode()) for t in texts))
        monkeypatch.undo()
        digests.append(hashlib.md5(out.read_bytes()).hexdigest())
        with gzip.open(out, "rt", encoding="utf-8") as f:
            assert [json.loads(line)["text"] for line in f] == texts
    assert digests[0] == digests[1]


def test_target_bias_reads_the_first_bytes_or_documents_spread_through_the_corpus(tmp_path):
    """`target_bias.py --spread`: whole documents at an even stride through a corpus ordered by
    source, as the bench's students read it; without it, the corpus's first bytes."""
    from benchmarks.target_bias import texts_of

    docs = [f"doc {i:02d} " + "x" * 993 for i in range(20)]  # 1,000 bytes each
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert texts_of([str(corpus)], 5000) == docs[:5]
    spread = texts_of([str(corpus)], 5000, spread=True)
    assert spread == [docs[i] for i in (0, 4, 8, 12, 16)]


def test_depth_routing_counts_where_the_text_puts_an_alternative_inside_a_student_token(
    tokenizer_dir,
):
    """`target_bias.py --depth-routing`: after Llama-2's ` get` the text goes on with `attr`
    twice and `ter` twice, Llama-3's ` getattr` and ` getter`; each of the four steps sees the
    other continuation as half of what follows the prefix, and the join names the text's token.
    An identical teacher has no student-longer chunk, so no step."""
    from benchmarks.target_bias import ROUTES, depth_routing
    from crossdistill.models import load_tokenizer

    llama3 = load_tokenizer(str(tokenizer_dir("llama3")))
    llama2 = load_tokenizer(str(tokenizer_dir("llama2")))
    r = depth_routing(["x getattr getter getattr getter"], llama3, llama2)
    assert r["steps"] == 4 and r["alternatives_per_step"] == pytest.approx(0.5)
    assert r["routing"] == {k: float(k == "right") for k in ROUTES}
    code = "".join(f"def function_{i}(argument):\n    return argument\n" for i in range(200))
    far = depth_routing([code], llama3, llama2)
    assert far["steps"] > 500 and sum(far["routing"].values()) == pytest.approx(1.0)
    assert depth_routing([code], llama3, llama3)["steps"] == 0


def test_target_bias_script_on_real_tokenizers(tokenizer_dir, tmp_path):
    """Identical tokenizers: the first-piece target is right at every KD position; a
    finer-grained teacher (Llama-2 under a Llama-3 student) leaves it wrong on many, mostly
    where the student's token runs past the teacher's, and the prefix target far less."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(
        "".join(f"def function_{i}(argument):\n    return argument\n" for i in range(800))
    )
    llama3 = str(tokenizer_dir("llama3"))
    result = _script(
        "target_bias.py", "--student", llama3, "--teacher", llama3, "--teacher",
        str(tokenizer_dir("llama2")), "--corpus", str(corpus), "--json",
    )  # fmt: skip
    same, far = result["pairs"][llama3], result["pairs"][str(tokenizer_dir("llama2"))]
    assert same["right"] == 1.0 and same["kd_positions"] > 1000
    kinds = ("right", "student_longer", "student_shorter", "other")
    assert sum(far[k] for k in kinds) == pytest.approx(1.0)
    assert far["right"] < 0.95 and far["student_longer"] > far["student_shorter"]
    assert far["label_bytes_where_wrong"] > far["target_bytes_where_wrong"]
    # the prefix target's groups hold the observed token wherever the first piece missed it
    assert same["prefix_right"] == 1.0 and far["prefix_right"] > far["right"] + 0.05
    # hkl pairs every token of an identical teacher exactly; each KD position has one class
    assert same["hkl_exact"] == 1.0
    hkl = ("hkl_exact", "hkl_relaxed", "hkl_unpaired")
    assert sum(far[k] for k in hkl) == pytest.approx(1.0) and far["hkl_exact"] > 0.9
    # the lookahead target: no chunk of one student token over several teacher tokens under an
    # identical teacher; under Llama-2 the path starts wherever it reaches, and the counts agree
    # as shares of the multi positions and of all KD positions
    assert same["multi"] == 0.0 and same["lookahead_reach"] == 0.0
    assert 0.0 < far["multi"] <= far["student_longer"] + far["right"]
    assert 0.0 < far["lookahead_reach"] <= far["lookahead_started"] <= 1.0
    assert far["lookahead_reach_of_kd"] == pytest.approx(far["lookahead_reach"] * far["multi"])
    assert list(far["multi_length"]) == ["2", "3", "4", ">4"]
    assert sum(far["multi_length"].values()) == pytest.approx(1.0)
    # the step past the end: taken wherever a path reaches the student's token, so on every
    # one-to-one chunk of the identical teacher; the joinable and contrary shares are shares
    assert same["end_step"] == 1.0 and 0.5 < far["end_step"] <= 1.0
    for r in (same, far):
        assert 0.0 < r["end_joinable"] <= 1.0 and 0.0 <= r["end_observed_joins"] < 0.1
    # the groups at one-to-one KD positions: one token each under an identical teacher (the
    # target then says what a same-tokenizer teacher says); under Llama-2 most hold several
    assert same["one_to_one"] == 1.0 and same["grouped"] == 0.0 and same["group_size"] == 1.0
    assert far["one_to_one"] == pytest.approx(far["right"], abs=0.01)
    assert far["grouped"] > 0.5 and far["group_size"] > 10.0


def test_student_noise_script_repeats_one_config_identically_on_cpu(tokenizer_dir, tmp_path):
    result = _script(
        "student_noise.py", "--tokenizer", str(tokenizer_dir("gpt2")), "--scale", "quick",
        "--lrs", "2e-3", "--repeats", "2", "--jobs", "1", "--out", str(tmp_path),
    )  # fmt: skip
    (entry,) = result["runs"].values()
    assert len(entry["runs"]) == 2 and math.isfinite(entry["mean"])
    assert entry["range"] == 0.0  # the CPU is deterministic: repeats agree to the bit


def test_kd_headroom_script_grid_on_cpu(tokenizer_dir, tmp_path):
    """Every cell of the grid (student text, top-k) is trained and compared with its own CE-only
    student; the students' text is the first bytes of the teacher's, whole pieces."""
    result = _script(
        "kd_headroom.py", "--tokenizer", str(tokenizer_dir("gpt2")), "--scale", "quick",
        "--teacher-steps", "4", "--student-steps", "3", "--kd-ratios", "0", "0.5",
        "--top-k", "8", "64", "--student-bytes", "20000", "0", "--seeds", "0", "--jobs", "1",
        "--out", str(tmp_path),
    )  # fmt: skip
    cells = result["cells"]
    assert sorted(cells) == sorted(
        f"small bytes {n} {kind}"
        for n in (0, 20000)
        for kind in ("kd 0", "kd 0.5 k 8 T 1", "kd 0.5 k 64 T 1")
    )
    assert all(math.isfinite(c["mean"]) for c in cells.values())
    for n in (0, 20000):
        ce = cells[f"small bytes {n} kd 0"]["runs"]["0"]
        for k in (8, 64):
            cell = cells[f"small bytes {n} kd 0.5 k {k} T 1"]
            assert cell["change_vs_ce"]["0"] == pytest.approx(cell["runs"]["0"] / ce - 1)
    # other text and another top-k are other runs, not reused ones
    assert cells["small bytes 0 kd 0"]["mean"] != cells["small bytes 20000 kd 0"]["mean"]
    assert (
        cells["small bytes 0 kd 0.5 k 8 T 1"]["mean"]
        != cells["small bytes 0 kd 0.5 k 64 T 1"]["mean"]
    )
    (data,) = (tmp_path / "data").iterdir()
    full = (data / "train.jsonl").read_text().splitlines()
    share = (data / "train-spread-20000.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in full]
    assert [json.loads(line)["text"] for line in share] == spread_pieces(texts, 20000)
    assert 0 < len(share) < len(full)


def test_kd_headroom_script_puts_every_kd_cell_under_each_teacher(tokenizer_dir, tmp_path):
    """Several `--teacher-steps`: one teacher each, in a folder of its own, and each KD cell
    under each of them, compared with the one CE-only student of its seed."""
    result = _script(
        "kd_headroom.py", "--tokenizer", str(tokenizer_dir("gpt2")), "--scale", "quick",
        "--teacher-steps", "6", "2", "--student-steps", "3", "--kd-ratios", "0", "0.5",
        "--top-k", "8", "--seeds", "0", "--jobs", "1", "--out", str(tmp_path),
    )  # fmt: skip
    assert sorted(result["teachers"]) == ["2", "6"]
    assert result["teachers"]["2"] != result["teachers"]["6"]  # two runs, not one reused
    assert all((tmp_path / f"teacher-steps{n}" / "final").is_dir() for n in (2, 6))
    cells = result["cells"]
    assert sorted(cells) == sorted(
        ["small bytes 0 kd 0"] + [f"small bytes 0 kd 0.5 k 8 T 1 teacher {n}" for n in (6, 2)]
    )
    ce = cells["small bytes 0 kd 0"]["runs"]["0"]
    under = [cells[f"small bytes 0 kd 0.5 k 8 T 1 teacher {n}"] for n in (6, 2)]
    for cell in under:
        assert cell["change_vs_ce"]["0"] == pytest.approx(cell["runs"]["0"] / ce - 1)
    assert under[0]["mean"] != under[1]["mean"]


def test_teacher_size_script_trains_each_size_and_counts_its_parameters(tokenizer_dir, tmp_path):
    """One teacher per tokenizer and size, as the bench trains them; each teacher's distance
    from the one on the student's tokenizer is its own bits per byte over that one's, and the
    parameter counts are a real model's."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    result = _script(
        "teacher_size.py", "--student-tokenizer", str(tokenizer_dir("gpt2")),
        "--teacher-tokenizer", str(tokenizer_dir("llama2")), "--scale", "quick",
        "--sizes", "scale", "128x1", "--teacher-steps", "3", "--jobs", "1", "--out", str(tmp_path),
    )  # fmt: skip
    sizes = {entry["size"]: entry for entry in result["sizes"]}
    assert sorted(sizes) == ["128x1", "scale"]
    assert sizes["scale"]["shape"] == SCALES["quick"].teacher
    assert sizes["128x1"]["shape"] == teacher_shape(128, 1)
    for entry in sizes.values():
        gpt2, llama2 = entry["teachers"]["gpt2"], entry["teachers"]["llama2"]
        assert all(math.isfinite(t["bpb"]) for t in (gpt2, llama2))
        assert gpt2["vs_same"] == 0.0
        assert llama2["vs_same"] == pytest.approx(llama2["bpb"] / gpt2["bpb"] - 1)
        assert entry["spread"] == pytest.approx(abs(llama2["vs_same"]))
        for name, teacher in (("gpt2", gpt2), ("llama2", llama2)):
            vocab = teacher["embedding_parameters"] // entry["shape"]["hidden_size"]
            assert (
                vocab % 64 == 0 and vocab - 64 < len(load_tokenizer(tokenizer_dir(name))) <= vocab
            )
            config = LlamaConfig(**entry["shape"], vocab_size=vocab, tie_word_embeddings=True)
            with torch.device("meta"):
                model = LlamaForCausalLM(config)
            total = sum(p.numel() for p in model.parameters())
            assert teacher["body_parameters"] + teacher["embedding_parameters"] == total
    assert sizes["scale"]["teachers"]["gpt2"]["bpb"] != sizes["128x1"]["teachers"]["gpt2"]["bpb"]
    rows = [json.loads(line) for line in (tmp_path / "teachers.jsonl").read_text().splitlines()]
    assert len(rows) == 4


def test_a_pair_of_targets_is_one_kd_term_per_target_at_half_the_weight(tmp_path, tokenizer_dir):
    """`--target lookahead_end+lookahead_prefix_end`: one cell whose students learn from the same
    teacher in two KD terms, one under each target, each at half the weight; a single target
    keeps its one term at full weight; an unknown or repeated target is refused at load."""
    from pathlib import Path

    from crossdistill.bench.quality import Experiment, model_entry

    teacher_tok = str(tokenizer_dir("llama2"))
    pair = "lookahead_end+lookahead_prefix_end"
    spec = parsed_spec(tmp_path, "--target", pair, "--target", "lookahead_prefix_end")
    assert spec.targets == [pair, "lookahead_prefix_end"]
    spec = replace(spec, student_tokenizer=str(tokenizer_dir("gpt2")),
                   teacher_tokenizers=[teacher_tok], scale_name="quick", scale=SCALES["quick"],
                   seeds=2)  # fmt: skip
    exp = Experiment(spec, log=lambda _: None)
    exp.teacher_jobs()  # writes the corpus the runs' configs name; trains nothing
    exp.teacher_paths[("llama2", 0)] = Path(teacher_tok)
    student = model_entry(spec.scale.student, spec.student_tokenizer, exp.vocab[teacher_tok])
    cells = {cell.name: cell for cell in exp.cells}
    both = exp.student_job(cells[f"cross-llama2-forward_kl-{pair}"], student, seed=0).cfg
    one = exp.student_job(cells["cross-llama2-forward_kl-lookahead_prefix_end"], student, 0).cfg
    assert [(t.name, t.target, t.weight, t.path) for t in both.teachers] == [
        ("teacher_lookahead_end", "lookahead_end", 0.5, teacher_tok),
        ("teacher_lookahead_prefix_end", "lookahead_prefix_end", 0.5, teacher_tok),
    ]
    assert [(t.name, t.target, t.weight) for t in one.teachers] == [
        ("teacher", "lookahead_prefix_end", 1.0)
    ]
    assert both.train.kd_ratio == one.train.kd_ratio
    with pytest.raises(UserError, match="unknown --target 'lookahead_ends'"):
        replace(spec, targets=["lookahead_end+lookahead_ends"]).check()
    with pytest.raises(UserError, match="a target twice"):
        replace(spec, targets=["lookahead_end+lookahead_end"]).check()


def test_teacher_cache_is_built_once_per_teacher_and_every_kd_student_reads_its_own(
    tmp_path, tokenizer_dir, capsys
):
    """`--teacher-cache`: one build per teacher over the students' and the held-out text, in
    windows of the teacher's own sequence length; each KD student reads its teacher's cache (the
    same-tokenizer cell the student tokenizer's, the cross cell the other), CE-only students
    none; a rerun rebuilds nothing and trains nothing."""
    from pathlib import Path

    from crossdistill.config import Config, from_dict
    from crossdistill.train.teacher_cache import inspect_cache

    argv = [
        "bench", "quality", "--scale", "quick", "--seeds", "2", "--json",
        "--student-tokenizer", str(tokenizer_dir("gpt2")),
        "--teacher-tokenizer", str(tokenizer_dir("llama2")),
        "--target", "lookahead_prefix_end", "--student-bytes", str(2 * PIECE_BYTES),
        "--teacher-cache", "--out", str(tmp_path),
        "--max-teacher-spread", "1", "--min-teacher-gain", "0",
    ]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert report["settings"]["teacher_cache"] is True
    assert "read each teacher's top-k from its cache" in captured.err  # the table, under --json
    rows = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert sorted(r["cell"] for r in rows if r["cell"].startswith("cache-")) == [
        "cache-gpt2",
        "cache-llama2",
    ]
    folders = {}
    for label, info in report["teacher_runs"].items():
        cache = info["caches"]["0"]
        folders[label] = cache["folder"]
        assert math.isfinite(cache["bpb_on_cached_text"]) and cache["bpb_on_cached_text"] > 0
    for cell, label in (
        ("same", "gpt2"),
        ("cross-llama2-forward_kl-lookahead_prefix_end", "llama2"),
    ):
        for seed in range(2):
            run = tmp_path / "students" / cell / f"seed{seed}"
            cfg = from_dict(Config, json.loads((run / "config.json").read_text()))
            (t,) = cfg.teachers
            assert t.cache == folders[label]
            assert Path(t.path) == Path(report["teacher_runs"][label]["run"]) / "final"
            info = inspect_cache(t.cache, cfg=cfg)
            # every document a student reads, trains or is scored on, under the teacher's length
            assert info["coverage"] == 1.0 and info["damaged_shards"] == []
            assert info["context"] == report["teacher_runs"][label]["seq_len"]
            assert info["top_k"] == t.top_k and info["teacher"]["path"] == t.path
    ce = json.loads((tmp_path / "students" / "ce" / "seed0" / "config.json").read_text())
    assert ce["teachers"] == []
    # the cached teachers taught: each KD cell moved away from CE only on every seed
    for entry in (report["same_kd"], report["cross"][0]["bpb"]):
        assert all(abs(a - b) > 1e-4 for a, b in zip(entry["runs"], report["ce_only"]["runs"]))

    shards = {p: p.stat().st_mtime_ns for f in folders.values() for p in Path(f).rglob("*.cdc")}
    assert shards
    start = time.perf_counter()
    assert main(argv) == 0  # everything reused: no shard written again, no student retrained
    again = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert again["cross"] == report["cross"] and again["same_kd"] == report["same_kd"]
    assert {p: p.stat().st_mtime_ns for p in shards} == shards
    assert time.perf_counter() - start < 30


def test_seed_split_script_trains_each_order_and_init_apart(tokenizer_dir, tmp_path):
    """`seed_split.py`: the CE-only and the KD student at each (data order, init) pair, from the
    bench's own teacher and cache; the order and the init each change the student."""
    result = _script(
        "seed_split.py", "--scale", "quick", "--student-tokenizer", str(tokenizer_dir("gpt2")),
        "--teacher-tokenizer", str(tokenizer_dir("llama2")), "--student-bytes",
        str(2 * PIECE_BYTES), "--teacher-cache", "--orders", "0", "1", "--inits", "0", "1",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert result["cell"] == "cross-llama2-forward_kl"
    pairs = {(p["order"], p["init"]): p for p in result["pairs"]}
    assert sorted(pairs) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for p in pairs.values():
        assert math.isfinite(p["kd"]) and p["change_vs_ce"] == pytest.approx(p["kd"] / p["ce"] - 1)
    ce = {k: p["ce"] for k, p in pairs.items()}
    assert ce[(0, 0)] != ce[(1, 0)] and ce[(0, 0)] != ce[(0, 1)]
    teachers = sorted(p.name.split("-")[0] for p in (tmp_path / "teachers").iterdir())
    assert teachers == ["llama2"]  # only the teacher the cell learns from
    runs = tmp_path / "split" / "cross-llama2-forward_kl" / "order1-init0"
    cfg = json.loads((runs / "config.json").read_text())
    assert (cfg["data"]["seed"], cfg["train"]["seed"]) == (1, 0) and cfg["teachers"][0]["cache"]


def test_kd_warmup_cells_reach_the_student_runs_and_the_table(tmp_path, tokenizer_dir):
    """`--kd-warmup-steps 0 --kd-warmup-steps 6`: each cross cell runs without and with a
    6-step warm-up of the KD weight, the same-tokenizer cell without; the report pairs the
    warm-up cell with the first and names it; a warm-up past the students' steps is refused."""
    spec, exp, student = _quick_cells(
        tmp_path, tokenizer_dir, "--kd-warmup-steps", "0", "--kd-warmup-steps", "6"
    )
    assert spec.kd_warmup_steps == [0, 6]
    base = "cross-llama2-forward_kl-first_piece"
    assert [cell.name for cell in exp.cells] == ["ce", "same", base, f"{base}-kd_warmup6"]
    runs = {cell.name: exp.student_job(cell, student, seed=0).cfg for cell in exp.cells}
    assert runs[f"{base}-kd_warmup6"].train.kd_warmup_steps == 6
    assert runs[base].train.kd_warmup_steps == runs["same"].train.kd_warmup_steps == 0
    fake = {"ce": {0: 2.1, 1: 2.2}, "same": {0: 1.9, 1: 2.0}, base: {0: 2.0, 1: 2.1},
            f"{base}-kd_warmup6": {0: 1.95, 1: 2.15}}  # fmt: skip
    report = summarize({"gpt2": 1.0, "llama2": 1.0}, fake, exp.cells, "gpt2", spec)
    warm = report["cross"][1]
    assert warm["kd_warmup_steps"] == 6 and report["cross"][0]["kd_warmup_steps"] == 0
    assert warm["change_vs_target"]["cell"] == base and warm["change_vs_target"]["better"] == 1
    buffer = io.StringIO()
    print_table(report, file=buffer)
    assert "cross KD llama2 forward_kl first_piece kd_warmup_steps 6" in buffer.getvalue()
    with pytest.raises(UserError, match="--kd-warmup-steps 13: give 0 .* up to the students' 12"):
        replace(spec, kd_warmup_steps=[13]).check()
    with pytest.raises(UserError, match="--kd-warmup-steps -1"):
        replace(spec, kd_warmup_steps=[-1]).check()


def test_kd_ratio_cells_pair_each_weight_with_its_own_same_tokenizer_cell(tmp_path, tokenizer_dir):
    """`--kd-ratio 0.5 --kd-ratio 0.3`: the same-tokenizer and the cross cell run under each
    weight, the first's under their plain names; each cross cell's gap closed divides by the
    same-tokenizer gain of its own weight (by hand below), and a weight whose same-tokenizer
    students lose to CE only refuses its own cells alone. The teacher's cache does not depend
    on the students' weight, so every weight reads one build."""
    spec, exp, student = _quick_cells(
        tmp_path, tokenizer_dir, "--kd-ratio", "0.5", "--kd-ratio", "0.3", "--kd-ratio", "0.5"
    )
    assert spec.kd_ratios == [0.5, 0.3]
    base = "cross-llama2-forward_kl-first_piece"
    names = [cell.name for cell in exp.cells]
    assert names == ["ce", "same", "same-kd0.3", base, f"{base}-kd0.3"]
    runs = {cell.name: exp.student_job(cell, student, seed=0).cfg for cell in exp.cells}
    assert runs["ce"].train.kd_ratio == 0.0
    assert runs["same"].train.kd_ratio == runs[base].train.kd_ratio == 0.5
    assert runs["same-kd0.3"].train.kd_ratio == runs[f"{base}-kd0.3"].train.kd_ratio == 0.3
    assert runs["same-kd0.3"].teachers[0].path == runs["same"].teachers[0].path

    fake = {"ce": {0: 2.1, 1: 2.2}, "same": {0: 1.9, 1: 2.0}, "same-kd0.3": {0: 2.05, 1: 2.1},
            base: {0: 2.0, 1: 2.1}, f"{base}-kd0.3": {0: 2.07, 1: 2.12}}  # fmt: skip
    report = summarize({"gpt2": 1.0, "llama2": 1.0}, fake, exp.cells, "gpt2", spec)
    assert report["refused"] is None and report["kd_ratio"] == 0.5
    assert report["same_kd"]["runs"] == [1.9, 2.0]
    by_weight = report["same_kd_by_kd_ratio"]
    assert sorted(by_weight) == ["0.3", "0.5"] and by_weight["0.3"]["runs"] == [2.05, 2.1]
    assert by_weight["0.3"]["change_vs_ce"]["runs"] == pytest.approx(
        [2.05 / 2.1 - 1, 2.1 / 2.2 - 1]
    )
    first, low = report["cross"]
    assert first["kd_ratio"] == 0.5 and low["kd_ratio"] == 0.3
    assert first["gap_closed"]["runs"] == pytest.approx([0.1 / 0.2, 0.1 / 0.2], abs=1e-12)
    # against its own weight's same-tokenizer students: (2.1 − 2.07) / (2.1 − 2.05), 0.08 / 0.1
    assert low["gap_closed"]["runs"] == pytest.approx([0.6, 0.8], abs=1e-12)
    assert low["change_vs_target"]["cell"] == base
    buffer = io.StringIO()
    print_table(report, file=buffer)
    table = buffer.getvalue()
    assert "same-tokenizer KD kd_ratio 0.3" in table
    assert "cross KD llama2 forward_kl first_piece kd_ratio 0.3" in table
    # the reference gains 9.3%; the weaker weight 3.5%, under --min-same-gain: a note on it alone
    (note,) = report["warnings"]
    assert note.startswith("same-tokenizer KD at KD weight 0.3 gains 3.5% over CE only, under 5%")

    # the weaker weight's same-tokenizer students lose on seed 1: its cells alone are refused
    fake["same-kd0.3"] = {0: 2.0, 1: 2.25}
    report = summarize({"gpt2": 1.0, "llama2": 1.0}, fake, exp.cells, "gpt2", spec)
    first, low = report["cross"]
    assert report["refused"] is None and first["refused"] is None and "gap_closed" in first
    assert "gap_closed" not in low
    assert low["refused"].startswith("same-tokenizer KD at KD weight 0.3 is not better than CE")

    # one cache build for every weight: the build's folder does not change with the weights
    # asked for, and the students of both weights read it
    weights = tmp_path / "teacher"  # what the build's folder name reads of a checkpoint
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"weights")
    exp.teacher_paths[("llama2", 0)] = weights
    exp.teacher_info["llama2"] = {"seq_len": spec.scale.seq_len}
    folder = exp.cache_job("llama2", 0).cfg.run.out_dir
    exp.spec, exp.cache_paths = replace(spec, kd_ratios=[0.3]), {}
    assert exp.cache_job("llama2", 0).cfg.run.out_dir == folder
    caches = {exp.student_job(c, student, seed=0).cfg.teachers[0].cache for c in exp.cells[3:]}
    assert caches == {folder}


def test_quality_gpu_script_collects_only_a_run_this_machine_started(tmp_path):
    """`benchmarks/quality_gpu.sh collect` where no run was started (a fresh machine) fails
    with that reason instead of reporting a finished run with no results; `start` without
    the tokenizers folder, or with a teacher tokenizer it lacks, starts nothing."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "quality_gpu.sh"
    env = {"PATH": "/usr/bin:/bin", "RUN": str(tmp_path / "run"), "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(script), "collect", "30"], env=env, capture_output=True,
                          text=True, timeout=20)  # fmt: skip
    assert done.returncode == 1
    assert "no run under" in done.stderr and "finished" not in done.stdout
    done = subprocess.run(["bash", str(script), "start"], env=env, capture_output=True,
                          text=True, timeout=20)  # fmt: skip
    assert done.returncode != 0 and "set TOK" in done.stderr
    assert not (tmp_path / "run").exists()
    # a teacher tokenizer named in TEACHERS that the folder lacks: named, nothing started
    (tmp_path / "tok" / "llama2" / "hf").mkdir(parents=True)
    env |= {"TOK": str(tmp_path / "tok"), "TEACHERS": "llama2 nope"}
    done = subprocess.run(["bash", str(script), "start"], env=env, capture_output=True,
                          text=True, timeout=20)  # fmt: skip
    assert done.returncode == 2 and f"no tokenizer {tmp_path}/tok/nope/hf" in done.stderr
    assert not (tmp_path / "run").exists()

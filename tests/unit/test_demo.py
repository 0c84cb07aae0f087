"""The demo's configs: the shipped configs/demo.yaml is what the demo runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from crossdistill.config import load_config, to_dict
from crossdistill.train import demo

REPO = Path(__file__).resolve().parents[2]


def test_shipped_demo_config_is_the_demo_kd_stage():
    out = Path("runs/demo")
    student = demo._model(demo.DEMO["student"], out / "tokenizers" / "tokenizer_student", 3072)
    teacher = {
        "name": "teacher",
        "path": str(out / "teacher" / "final"),
        "dtype": "float32",
        "loss": "forward_kl",
        "top_k": demo.DEMO["top_k"],
        "temperature": 1.0,
    }
    ran = demo.stage_config(
        out,
        "student_kd",
        student,
        demo.DEMO["student"]["steps"],
        demo.DEMO["student"]["lr"],
        0,
        demo.DEMO["eval_batches"],
        teachers=[teacher],
        train_file=demo.STUDENT_TEXT,
        batch=demo.DEMO["student"]["micro_batch_size"],
    )
    assert to_dict(load_config(REPO / "configs" / "demo.yaml")) == to_dict(ran)


def test_demo_reports_a_seed_where_kd_loses_and_finishes(capsys, tmp_path):
    """KD that does not beat CE only on a seed is a result to print, not an error: `make demo`
    finishes either way and says which it was."""
    base = {"teacher_bpb": 2.4, "ce_only_bpb": 2.8, "seconds": 1.0}
    demo._print_table({**base, "distilled_bpb": 2.87, "kd_change": 2.87 / 2.8 - 1}, tmp_path)
    out = capsys.readouterr().out
    assert "2.5% more bits per byte than CE only on this seed" in out
    demo._print_table({**base, "distilled_bpb": 2.66, "kd_change": 2.66 / 2.8 - 1}, tmp_path)
    assert "5.0% fewer bits per byte than CE only" in capsys.readouterr().out


def test_quick_demo_end_to_end(tmp_path, capsys):
    summary = demo.run_demo(tmp_path / "demo", quick=True)
    assert summary["kd_change"] == summary["distilled_bpb"] / summary["ce_only_bpb"] - 1
    for key in ("teacher_bpb", "ce_only_bpb", "distilled_bpb"):
        assert 0 < summary[key] < 20
    out = capsys.readouterr().out
    assert "held-out bits per byte" in out
    assert (tmp_path / "demo" / "summary.json").is_file()
    # the teacher trained on the files in pieces, the students on whole files
    read = {
        run: json.loads((tmp_path / "demo" / run / "config.json").read_text())["data"]["train"]
        for run in ("teacher", "student_ce", "student_kd")
    }
    data = tmp_path / "demo" / "data"
    assert read["teacher"] == [str(data / demo.TEACHER_TEXT)]
    assert read["student_ce"] == read["student_kd"] == [str(data / demo.STUDENT_TEXT)]
    # the students' text as read, not as asked for: whole files stop at the first that does not fit
    rows = (tmp_path / "demo" / "data" / demo.STUDENT_TEXT).read_text().splitlines()
    kb = sum(len(json.loads(r)["text"].encode()) for r in rows) // 1000
    assert f"steps on {kb} kB of the text ({len(rows)} whole files)" in out


def test_the_teachers_text_is_every_training_file_in_pieces(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(30):  # files of about 0.3 to 9 kB
        lines = [f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(10 + 25 * i)]
        (root / f"mod{i}.py").write_text("".join(lines))
    train, _, student = demo._write_corpus(tmp_path / "run", 0, root)

    def rows(name):
        lines = (tmp_path / "run" / "data" / name).read_text().splitlines()
        return [json.loads(line)["text"] for line in lines]

    size = demo.DEMO["teacher_piece_chars"]
    pieces = rows(demo.TEACHER_TEXT)
    assert "".join(pieces) == "".join(train)  # every file, in order, nothing lost
    assert len(pieces) > 2 * len(train)
    assert all(len(p) <= size * 5 // 4 and p.endswith("\n") for p in pieces)
    assert rows("train.jsonl") == train and rows(demo.STUDENT_TEXT) == student  # whole files
    assert demo.teacher_text(train, 0) == train


def test_a_saved_run_from_before_the_boundary_setting_is_a_run_that_ignored_it(tmp_path):
    """`teachers.N.boundary` came with a default ("condition") that runs saved before it did not
    train under: such a run is one under "ignore", retrained at today's default."""
    import json

    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.teachers and all(t.boundary == "condition" for t in cfg.teachers)
    raw = to_dict(cfg)
    for teacher in raw["teachers"]:
        del teacher["boundary"]
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(raw))
    assert demo._saved_config(saved) != to_dict(cfg)
    for teacher in cfg.teachers:
        teacher.boundary = "ignore"
    assert demo._saved_config(saved) == to_dict(cfg)


def test_a_saved_run_config_from_before_a_new_setting_still_matches(tmp_path):
    """A run written before a setting was added (its saved config lacks the key) is the same
    run as one with that setting at its default: reused, not retrained; a changed value or a
    key that no longer exists is a different run."""
    import json

    cfg = load_config(REPO / "configs" / "demo.yaml")
    raw = to_dict(cfg)
    del raw["student"]["parallel"]["pp_schedule"]
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(raw))
    assert demo._saved_config(saved) == to_dict(cfg)
    raw["train"]["steps"] += 1
    saved.write_text(json.dumps(raw))
    assert demo._saved_config(saved) != to_dict(cfg)
    raw["train"]["no_such_setting"] = 1
    saved.write_text(json.dumps(raw))
    assert demo._saved_config(saved) is None


def test_the_students_text_as_files_or_as_pieces_spread_through_the_teachers():
    """`files`: the first whole files that fit, which stops at the first one that does not;
    `pieces`: pieces of every file, about the same bytes, from many files, in their order."""
    from crossdistill.errors import UserError
    from crossdistill.train.demo import DEMO, student_share

    lines = [f"def f_{i}(x):\n    return x + {i}\n" for i in range(400)]
    files = ["".join(lines[k::40]) * 3 for k in range(40)]  # 40 files of ~2.6 kB
    files.insert(1, "big = 1\n" * 4000)  # a 32 kB second file, as a large stdlib module
    size = [len(f.encode()) for f in files]
    whole = student_share(files, 20_000, "files")
    assert whole == files[:1]  # the big file does not fit, and the files stop there
    pieces = student_share(files, 20_000, "pieces")
    got = sum(len(p.encode()) for p in pieces)
    assert abs(got - 20_000) <= 1.25 * DEMO["student_piece_chars"] and got < sum(size)
    sources = [next(i for i, f in enumerate(files) if p in f) for p in pieces]
    assert sources == sorted(sources) and len(set(sources)) >= 6  # spread, in order
    assert all(len(p) <= 1.25 * DEMO["student_piece_chars"] for p in pieces)
    filled = student_share(files, 20_000, "filled")  # passes over the big one, fills up
    assert filled == files[:1] + files[2 : len(filled) + 1]
    full = sum(len(f.encode()) for f in filled)
    assert full <= 20_000 < full + size[len(filled) + 1]  # the next small file would not fit
    assert student_share(files, 20_000) == whole  # the demo's default
    with pytest.raises(UserError, match="'files', 'filled' or 'pieces'"):
        student_share(files, 20_000, "lines")  # type: ignore[arg-type]

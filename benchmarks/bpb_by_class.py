"""Where a cross-tokenizer teacher's signal falls short: each student of a `bench quality` run,
and each teacher, scored on the held-out split, their bits split by the kind of text and by how
the student's and the teacher's tokens align there.

    python benchmarks/bpb_by_class.py OUT [--json FILE] [--device auto]

OUT is a finished (or partly finished) `crossdistill bench quality --out OUT`: its
`summary.json` names the cells and teachers, and each run folder keeps its final model.

The held-out text is packed as the students' validation packs it, and aligned with each cross
teacher's tokens into chunks, as training aligns it. The accounting is per chunk, since a chunk
is the smallest span whose bits both tokenizers' models give: a model's bits for a chunk are its
NLL of the chunk's tokens. Each chunk of a cross teacher's alignment is classed twice:
    text: digits (a student token of it holds a digit), whitespace (one holds two or more
          whitespace characters: indentation, blank lines), other;
    align: one_to_one (one token on each side), student_longer (one student token, several
          teacher tokens), student_shorter (several student tokens, one teacher token),
          many (several on each side).
A class's bits are over *all* held-out bytes, so the classes of a partition add up to the
model's bits per byte, and a class's gain over CE only is its share of the whole gain. Per class
and cross cell the table gives the gain of same-tokenizer KD over CE only, the cross cell's, the
gap closed (from the means over seeds), and how much worse the cross teacher is there than the
same-tokenizer teacher; a hint names each cross cell under `kd_chunks: all` whose chunks of
several tokens on both sides came out worse than CE only's, and each under the first-piece
target whose chunks of one student token over several teacher tokens did. Each student's total
is printed beside its own validation (`final_metrics.json`): for the students of the packing's
teacher they differ by the scoring's precision only (bfloat16 on a GPU); for the others, also by
the packing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

TEXT_CLASSES = ("digits", "whitespace", "other")
ALIGN_KINDS = ("one_to_one", "student_longer", "student_shorter", "many")
LN2 = math.log(2.0)


def text_class_of_tokens(tok) -> np.ndarray:
    """`[V]` int8: the text class (index into TEXT_CLASSES) of every token id of `tok`."""
    from crossdistill.alignment.token_bytes import TokenBytes
    from crossdistill.train.audit import CLASSES, token_classes

    holds = token_classes(TokenBytes.from_tokenizer(tok))
    digits, whitespace = holds[:, CLASSES.index("digits")], holds[:, CLASSES.index("whitespace")]
    return np.where(digits, 0, np.where(whitespace, 1, 2)).astype(np.int8)


def chunk_classes(chunks: np.ndarray, ids_s: np.ndarray, text_class: np.ndarray):
    """`(text [C], align [C])` int8 classes of the chunks `[C, 4]` of one teacher's alignment
    over the flat student ids `ids_s`: a chunk's text class is the first (in TEXT_CLASSES order)
    of its student tokens' classes."""
    s0, s1, t0, t1 = chunks.T
    len_s, len_t = s1 - s0, t1 - t0
    align = np.where(len_s > 1, np.where(len_t > 1, 3, 2), np.where(len_t > 1, 1, 0))
    tokens = np.repeat(s0, len_s) + _ranks_within(len_s)
    text = np.full(len(chunks), len(TEXT_CLASSES) - 1, dtype=np.int8)
    np.minimum.at(text, np.repeat(np.arange(len(chunks)), len_s), text_class[ids_s[tokens]])
    return text, align.astype(np.int8)


def _ranks_within(lengths: np.ndarray) -> np.ndarray:
    """`[sum(lengths)]`: 0..n-1 for each n of `lengths`, concatenated."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum())) - starts


def per_chunk(token_bits: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """`[C]`: the sum of `token_bits` over each span `[starts[c], ends[c])` of flat positions;
    `token_bits[j]` is the bits of token `j` (its prediction from position `j - 1`)."""
    cum = np.concatenate([[0.0], np.cumsum(token_bits)])
    return cum[ends] - cum[starts]


def shifted(position_bits: np.ndarray) -> np.ndarray:
    """Bits per position (position `p` predicts token `p + 1`) as bits per token."""
    return np.concatenate([[0.0], position_bits[:-1]])


def held_out(config: dict[str, Any], teacher_tokenizers: list[str]) -> tuple[Any, list[Any]]:
    """The student's tokenizer and the held-out batches of a student run, packed as its
    validation packs them, with `teacher_tokenizers`' chunks alongside."""
    from crossdistill.config import Config, from_dict
    from crossdistill.data import build_loader
    from crossdistill.models import load_tokenizer

    cfg = from_dict(Config, config)
    tok_s = load_tokenizer(cfg.student.tokenizer or cfg.student.path)
    toks_t = [load_tokenizer(path) for path in teacher_tokenizers]
    loader = build_loader(cfg.data, tok_s, toks_t, split="validation", pin_memory=False)
    return tok_s, [batch for batch, _ in loader.stream_batches()]


@torch.no_grad()
def token_bits(model: torch.nn.Module, side: Any, rows: int = 2048) -> np.ndarray:
    """`[B·T]` float64: the model's NLL in bits of each token of one side of a batch (a
    `StudentBatch` or `TeacherBatch`; token `j` predicted from position `j - 1`), 0 for a token
    that is no label. The lm_head runs over `rows` positions at a time, in float32."""
    from crossdistill.losses.chunked import label_logprobs
    from crossdistill.models.attention import segments_of
    from crossdistill.models.forward import final_hidden

    dev = next(model.parameters()).device
    ids, pos = side.input_ids.to(dev), side.position_ids.to(dev)
    hidden = final_hidden(model, ids, pos, segments_of(side, dev)).flatten(0, 1)
    weight = model.get_output_embeddings().weight
    labels = side.labels.to(dev).flatten()
    logp = label_logprobs(hidden.float(), weight.float(), labels, rows)  # the loss's chunked pass
    return shifted(-logp.double().cpu().numpy() / LN2)


def partitions(batches: list[Any], text_class: np.ndarray) -> list[list[dict[str, np.ndarray]]]:
    """Per batch, per teacher: its chunks and their `text` and `align` classes."""
    out = []
    for b in batches:
        ids_s = b.student.input_ids.flatten().numpy()
        row = []
        for teacher in b.teachers:
            chunks = teacher.chunks.numpy()
            text, align = chunk_classes(chunks, ids_s, text_class)
            row.append({"chunks": chunks, "text": text, "align": align})
        out.append(row)
    return out


def class_sums(bits: list[np.ndarray], parts: list[list[dict]], k: int, side: str) -> dict:
    """Per class of teacher `k`'s partition (and in total), the sum of `bits` (per batch, per
    token of `side`: "student" or "teacher") over its chunks."""
    text = np.zeros(len(TEXT_CLASSES))
    align = np.zeros(len(ALIGN_KINDS))
    for x, row in zip(bits, parts):
        c = row[k]["chunks"]
        lo, hi = (c[:, 0], c[:, 1]) if side == "student" else (c[:, 2], c[:, 3])
        per = per_chunk(x, lo, hi)
        np.add.at(text, row[k]["text"], per)
        np.add.at(align, row[k]["align"], per)
    return {
        "total": float(text.sum()),
        "text": dict(zip(TEXT_CLASSES, text.tolist())),
        "align": dict(zip(ALIGN_KINDS, align.tolist())),
    }


def per_byte(sums: dict, n_bytes: float) -> dict:
    return {k: v / n_bytes if isinstance(v, float) else per_byte(v, n_bytes)
            for k, v in sums.items()}  # fmt: skip


def student_runs(out: Path, cells: list[str]) -> dict[str, dict[str, Path]]:
    """`cell -> folder -> run folder` of every finished student of `cells`."""
    runs: dict[str, dict[str, Path]] = {}
    for cell in cells:
        for run in sorted((out / "students" / cell).glob("seed*")):
            if (run / "final" / "config.json").is_file():
                runs.setdefault(cell, {})[run.name] = run
    return runs


def teacher_folder(info: dict[str, Any], seed: int | None = None) -> Path:
    """The final model of a teacher run: of teacher seed `seed` when there are several (by
    default the lowest, whichever finished first)."""
    seeds = info.get("seeds") or {}
    if not seeds:
        return Path(info["run"]) / "final"
    return Path(seeds[str(min(map(int, seeds)) if seed is None else seed)]["run"]) / "final"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the --out folder of a bench quality run")
    ap.add_argument("--json", type=Path, help="also write the table as JSON here")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    from crossdistill.eval.model import load_eval_model

    summary = json.loads((args.out / "summary.json").read_text())
    same = summary["same_tokenizer"]
    cells = ["ce", "same"] + [e["cell"] for e in summary["cross"]]
    runs = student_runs(args.out, cells)
    if "ce" not in runs or "same" not in runs or same not in summary["teacher_runs"]:
        sys.exit(f"{args.out} has no finished teachers, CE-only and same-tokenizer students yet")
    config = json.loads((next(iter(runs["ce"].values())) / "config.json").read_text())
    table: dict[str, Any] = {"out": str(args.out), "teachers": {}, "cells": {}}
    models: dict[Path, Any] = {}

    def model(folder: Path):
        if folder not in models:
            models[folder] = load_eval_model(str(folder), args.device).model
        return models[folder]

    for label, info in summary["teacher_runs"].items():
        if label == same:
            continue
        # the held-out text packed as the students of this teacher were validated on it (a
        # cross teacher's chunks decide where long documents break between rows), so their
        # totals are their validations; every other student is scored on the same packing
        tok_s, batches = held_out(config, [info["tokenizer"]])
        parts = partitions(batches, text_class_of_tokens(tok_s))
        n_bytes = float(sum(b.student.num_target_bytes for b in batches))

        def sums(bits: list[np.ndarray], side: str = "student", parts=parts, n_bytes=n_bytes):
            return per_byte(class_sums(bits, parts, 0, side), n_bytes)

        on_student = [b.student for b in batches]
        on_teacher = [b.teachers[0] for b in batches]
        nb = [shifted(x.target_bytes.flatten().numpy().astype(np.float64)) for x in on_student]
        same_m, cross_m = (
            model(teacher_folder(summary["teacher_runs"][same])),
            model(teacher_folder(info)),
        )
        table["teachers"][label] = {
            "byte_share": sums(nb),
            "same_teacher": sums([token_bits(same_m, x) for x in on_student]),
            "cross_teacher": sums([token_bits(cross_m, x) for x in on_teacher], "teacher"),
        }
        for cell, folders in runs.items():
            for folder, run in folders.items():
                row = sums([token_bits(model(run / "final"), x) for x in on_student])
                row["validation"] = json.loads((run / "final_metrics.json").read_text())[
                    "val/bpb/student"
                ]
                table["cells"].setdefault(cell, {}).setdefault(folder, {})[label] = row
                print(f"[by class] {label} packing: {cell} {folder}: {row['total']:.4f} bits "
                      f"per byte (its validation: {row['validation']:.4f})",
                      file=sys.stderr)  # fmt: skip
    table["gap_closed"] = gap_closed(table, summary["cross"])
    table["hints"] = hints(table["gap_closed"], summary["cross"])
    print_table(table)
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


def gap_closed(table: dict[str, Any], cross: list[dict]) -> dict[str, Any]:
    """Per cross cell, per class of its teacher's partition: the gains of same-tokenizer and
    cross KD over CE only and the gap closed (from the means over seeds), and how many more
    bits the cross teacher spends there than the same-tokenizer teacher."""
    cells, out = table["cells"], {}
    for entry in cross:
        cell, label = entry["cell"], entry["tokenizer"]
        if cell not in cells or label not in table["teachers"]:
            continue
        teachers = table["teachers"][label]
        keys = [("total",)] + [("text", c) for c in TEXT_CLASSES]
        keys += [("align", a) for a in ALIGN_KINDS]
        rows = {}
        for key in keys:
            ce, same, x = (
                statistics.fmean(_at(r[label], key) for r in cells[name].values())
                for name in ("ce", "same", cell)
            )
            rows["/".join(key)] = {
                "byte_share": _at(teachers["byte_share"], key),
                "same_gain": ce - same,
                "cross_gain": ce - x,
                "gap_closed": (ce - x) / (ce - same) if ce != same else None,
                "teacher_gap": _at(teachers["cross_teacher"], key)
                - _at(teachers["same_teacher"], key),
            }
        out[cell] = rows
    return out


def hints(gap: dict[str, Any], cross: list[dict]) -> list[str]:
    """What the split suggests, one line per cross cell and cause, where a kind of chunk came out
    worse than CE only's (its gain, the mean over seeds, below zero):
    - under `kd_chunks: all`, the chunks of several tokens on both sides, which `single_side`
      leaves out of KD (on the manual pages, 45% worse; on C headers those chunks gained 58% and
      `single_side` changed nothing);
    - under the first-piece target (named, or chosen by `auto`), the chunks of one student token
      over several teacher tokens, where the first piece gives the teacher's first token's mass
      to a shorter student token and `lookahead_prefix_end` follows the teacher's path (on
      Perl's near pair and the demo's pair, worse than CE only on every seed under the first
      piece, better under `lookahead_prefix_end`; `lookahead` did not gain there on the demo's)."""
    out = []
    for entry in cross:
        rows = gap.get(entry["cell"])
        if rows is None:
            continue
        target = entry.get("chosen_target") or entry.get("target", "first_piece")
        checks = [
            (
                entry.get("kd_chunks", "all") == "all",
                "align/many",
                "chunks of several tokens on both sides",
                "teachers.N.kd_chunks: single_side leaves them out of KD; "
                "`bench quality --kd-chunks all --kd-chunks single_side` measures it",
            ),
            (
                target == "first_piece",
                "align/student_longer",
                "chunks of one student token over several teacher tokens",
                "the first piece gives the teacher's mass of its first token to a shorter "
                "student token there; teachers.N.target: lookahead_prefix_end follows the "
                "teacher's path to the student's token; "
                "`bench quality --target first_piece --target lookahead_prefix_end` measures it",
            ),
        ]
        for applies, kind, what, fix in checks:
            row = rows[kind]
            if not applies or row["cross_gain"] >= 0:
                continue
            same = row.get("same_gain")
            if row["gap_closed"] is None:
                closed = ""
            elif same is not None and same <= 0:  # a share of a loss would read as a gain
                closed = f" (same-tokenizer KD is worse than CE only there too, by {-same:.4f})"
            else:
                closed = f" (gap closed {row['gap_closed']:.0%})"
            out.append(
                f"{entry['cell']}: its {what} ({row['byte_share']:.1%} of the bytes) are worse "
                f"than CE only's by {-row['cross_gain']:.4f} bits per byte of the whole{closed}: "
                + fix
            )
    return out


def _at(d: dict, key: tuple[str, ...]) -> float:
    for k in key:
        d = d[k]
    return d  # type: ignore[return-value]


def print_table(table: dict[str, Any]) -> None:
    for cell, rows in table["gap_closed"].items():
        print(f"\n{cell}: bits per held-out byte, means over seeds")
        print(f"  {'chunks':24s} {'bytes':>7s} {'same KD gain':>13s} {'cross KD gain':>14s} "
              f"{'closed':>7s} {'teacher behind by':>18s}")  # fmt: skip
        for name, r in rows.items():
            closed = "" if r["gap_closed"] is None else f"{r['gap_closed']:7.0%}"
            print(f"  {name:24s} {r['byte_share']:7.1%} {r['same_gain']:13.4f} "
                  f"{r['cross_gain']:14.4f} {closed:>7s} {r['teacher_gap']:18.4f}")  # fmt: skip
    for hint in table.get("hints", []):
        print(f"\nhint: {hint}")


if __name__ == "__main__":
    main()

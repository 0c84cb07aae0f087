"""How far each target puts a cross teacher from a model of the student's own tokenizer: at every
KD position of a `bench quality` run's held-out text, the KD loss (forward KL over the target's
buckets) that a student would pay if it were the run's same-tokenizer teacher, split by the kind
of chunk.

    python benchmarks/target_fidelity.py OUT --target first_piece --target lookahead_split \
        [--past-end all --past-end canonical] [--boundary ignore --boundary condition] \
        [--split-context none --split-context wide --split-context previous] \
        [--student RUN ...] [--reach] [--observed] [--other-seeds] [--table-text FILE] \
        [--json FILE] [--device cpu]

OUT is a `crossdistill bench quality --out OUT` whose teachers are trained. The same-tokenizer
teacher stands in for the student a perfect distillation would give: a target that makes it pay
where it is right pulls a student away from it there, which the held-out bits of the students
(`bpb_by_class.py`) then show as a loss. `--student RUN` adds a finished student run folder (or
any model folder with the student's tokenizer) as a second stand-in, to read the numbers against
a model that did not see the teacher.

A target's buckets are what it compares: a group of student tokens is one bucket, so a target
with groups compares less and its numbers are lower for that alone. Compare targets class by
class, and read a class where two targets differ by much more than the groups can hide (the
groups hold the teacher's *other* tokens, a few percent of the mass at a right first piece).

`--reach` (with `--student`) asks how much a target could pass on at all (`bucket_reach`): of
the same-tokenizer teacher's difference from the student, as the forward KL over that teacher's
own top-k and tail (what same-tokenizer KD compares), the part the target's buckets still hold
when the same-tokenizer teacher's own distribution fills them. A share well under 100% at a kind
of chunk is information no teacher behind that target can give there; near 100%, what is lost
there is in the cross teacher's numbers, not in the buckets.

`--observed` splits each target's distance from the same-tokenizer teacher, by the chain rule,
into the part from the bucket that holds the text's own next token against all the others, and
the rest: whether a target is far from that teacher on the text it saw or on the alternatives
(`observed_split`).

Under `--boundary condition` each target's table is followed by how often the student's token
rules out some of the teacher's top-k at a KD position, how much of the teacher's mass it drops
there, and how often more than a tenth (`boundary_drops`). `--table-text FILE` counts the
table on another training file than the run's (a quick run's text rules out next to nothing).

`--other-seeds` (a run with `--teacher-seeds N`, N ≥ 2) adds a floor: at the same KD positions,
the loss the first same-tokenizer teacher would pay under same-tokenizer KD from that tokenizer's
teacher of another seed (its own top-k and tail; `seed_floor`). A model of the student's own
tokenizer differs from the first by that much for its seed alone, so a cross target's distance
from the first teacher, read against it class by class, separates what the target adds from
what any second model differs by.

Chunks are classed as `bpb_by_class.py` classes them (text: digits / whitespace / other; align:
one_to_one / student_longer / student_shorter / many) at their KD position. Numbers are nats per
KD position of the class, means over the held-out text; `share` is the class's share of the KD
positions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.bpb_by_class import (  # noqa: E402
    ALIGN_KINDS,
    TEXT_CLASSES,
    chunk_classes,
    held_out,
    teacher_folder,
    text_class_of_tokens,
)
from crossdistill.losses.reference import bucket_logprobs  # noqa: E402


def classes_by_row(chunks: np.ndarray, text: np.ndarray, align: np.ndarray, rows: int):
    """`[rows]` text and align class of the chunk whose KD position each student row is (−1:
    none)."""
    t = np.full(rows, -1, dtype=np.int64)
    a = np.full(rows, -1, dtype=np.int64)
    s0 = chunks[:, 0]
    ok = (s0 > 0) & (chunks[:, 2] > 0)
    t[s0[ok] - 1] = text[ok]
    a[s0[ok] - 1] = align[ok]
    return t, a


def class_masks(text: np.ndarray, align: np.ndarray) -> dict[str, np.ndarray]:
    """Per class name, the mask of the entries (rows or chunks) of that class, from their text
    and align classes (−1: none): every text class, every align kind, and the one-to-one and
    student-longer kinds within each text class."""
    out = {"all": text >= 0}
    out |= {f"text/{c}": text == j for j, c in enumerate(TEXT_CLASSES)}
    out |= {f"align/{c}": align == j for j, c in enumerate(ALIGN_KINDS)}
    out |= {
        f"{c}/{a}": (text == j) & (align == k)
        for j, c in enumerate(TEXT_CLASSES)
        for k, a in enumerate(ALIGN_KINDS)
        if a in ("one_to_one", "student_longer")
    }
    return out


@torch.no_grad()
def hidden_and_head(model: torch.nn.Module, side: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's final hidden states `[B·T, H]` on one side of a batch, and its lm_head."""
    from crossdistill.models.attention import segments_of
    from crossdistill.models.forward import final_hidden

    dev = next(model.parameters()).device
    ids, pos = side.input_ids.to(dev), side.position_ids.to(dev)
    hidden = final_hidden(model, ids, pos, segments_of(side, dev)).flatten(0, 1).float()
    return hidden, model.get_output_embeddings().weight.float()


def term_of(tcfg: Any, projection: Any, tb: Any, hidden_t, head_t, device, ids_s) -> Any:
    """Teacher `tcfg`'s KD term on batch side `tb` (student inputs `ids_s`), as a training step
    builds it."""
    from crossdistill.distributed.runtime import make_term
    from crossdistill.losses.target_kinds import reads_past_end, target_depth
    from crossdistill.losses.targets import target_rows, teacher_targets

    depth = target_depth(tcfg.target, False)
    rows = target_rows(tb.chunks.to(device), depth, reads_past_end(tcfg.target, False))
    targets = teacher_targets(
        hidden_t, head_t, rows, tb.labels.to(device).flatten(), tcfg.top_k, tcfg.temperature
    )
    targets.depth = depth
    slot = SimpleNamespace(cfg=tcfg, projection=projection)
    term = make_term(slot, tb, targets, device, ids_s)
    term.denominator = torch.ones((), device=device)
    return term


def float64_plan(term: Any, labels: Tensor) -> Any:
    """`term`'s plan in float64, KD at weight 1 and CE over 1 token, as every reading here
    takes it."""
    from crossdistill.losses.plan import build_plan

    return build_plan(labels, [term], kd_ratio=1.0, ce_denominator=1.0, dtype=torch.float64)


def row_losses(term: Any, labels, hidden_s, head_s) -> np.ndarray:
    """`[N]` float64: the term's KD loss at each student row with the stand-in's `hidden_s`,
    `head_s` (NaN on rows without KD): the plain full-logits reference, each row's value read
    as the gradient of the total by that row's weight."""
    from crossdistill.losses.reference import reference_loss

    plan = float64_plan(term, labels)
    plan.ce_weight = torch.zeros_like(plan.ce_weight)
    tp = plan.terms[0]
    kd = tp.report_weight > 0
    weight = kd.to(torch.float64).requires_grad_(True)
    tp.row_weight = weight
    loss = reference_loss(hidden_s, head_s, plan)[0]
    (per_row,) = torch.autograd.grad(loss, weight)
    return torch.where(kd, per_row, float("nan")).cpu().numpy()


def _bucket_kl(a: Tensor, b: Tensor) -> Tensor:
    """`[N]` forward KL between two rows of bucket log-probabilities (0·log 0 = 0)."""
    return torch.where(a > float("-inf"), a.exp() * (a - b), 0.0).sum(1)


def _one_part_plan(term: Any, labels: Tensor) -> tuple[Any, Any]:
    """`term`'s float64 plan as `row_losses` builds it, and its one bucket divergence
    (`--reach` and `--observed` read no other)."""
    tp = float64_plan(term, labels).terms[0]
    if len(tp.parts) != 1:
        raise SystemExit(f"--reach and --observed read targets of one bucket divergence, not "
                         f"{len(tp.parts)}: leave out lookahead_mix, and the gold and hkl "
                         "losses")  # fmt: skip
    return tp, tp.parts[0]


def _kd_slices(kd: Tensor, part: Any, ref: tuple[Tensor, Tensor], temperature: float, rows: int):
    """Per slice of at most `rows` rows: the KD rows `sel`, `part` cut to them, `ref`'s
    float64 log-probabilities there at `temperature`, and those summed into the cut's buckets,
    which it checks hold `ref`'s whole distribution once."""
    from dataclasses import replace

    h, w = ref
    per_row = ("logq", "ids", "valid", "logq_tail")
    for r0 in range(0, kd.shape[0], rows):
        sel = torch.nonzero(kd[r0 : r0 + rows]).flatten() + r0
        if sel.numel() == 0:
            continue
        lp = torch.log_softmax((h[sel.to(h.device)].double() @ w.double().t()) / temperature, 1)
        cut = replace(part, **{k: getattr(part, k)[sel.to(getattr(part, k).device)].to(h.device)
                               for k in per_row if getattr(part, k) is not None})  # fmt: skip
        bp = bucket_logprobs(cut, lp)
        if (bp.exp().sum(1) - 1).abs().max() > 1e-9:
            raise SystemExit("the target's buckets do not hold the vocabulary once each")
        yield sel, cut, lp, bp


@torch.no_grad()
def bucket_reach(
    term: Any, labels: Tensor, ref: tuple[Tensor, Tensor], other: tuple[Tensor, Tensor],
    top_k: int, rows: int = 256,
) -> dict[str, np.ndarray]:  # fmt: skip
    """How much of the difference between two models of the student's tokenizer a target can
    pass on at all. At each KD row of `term`, the forward KL from `ref` (the same-tokenizer
    teacher, as its hidden states and lm_head) to `other` (a student) summed over the whole
    vocabulary (`full`), over `ref`'s own top-k and tail (`own`: what same-tokenizer KD
    compares) and over `term`'s buckets (`target`: what it compares; a perfect teacher behind
    the target would show the student no more). `[N]` float64 each, NaN on rows without KD."""
    from crossdistill.losses.plan import Part

    tp, part = _one_part_plan(term, labels)
    kd = (tp.report_weight > 0).cpu()
    out = {k: np.full(kd.shape[0], np.nan) for k in ("full", "own", "target")}
    for sel, cut, lp, bp in _kd_slices(kd, part, ref, tp.temperature, rows):
        h, w = other
        lq = torch.log_softmax((h[sel.to(h.device)].double() @ w.double().t()) / tp.temperature, 1)
        top = lp.topk(min(top_k, lp.shape[1]), 1).indices
        ones = torch.ones_like(top, dtype=torch.bool)
        own = Part("forward_kl", lp.gather(1, top), ids=top, valid=ones)
        at = sel.numpy()
        out["full"][at] = _bucket_kl(lp, lq).cpu().numpy()
        out["own"][at] = (
            _bucket_kl(bucket_logprobs(own, lp), bucket_logprobs(own, lq)).cpu().numpy()
        )
        out["target"][at] = _bucket_kl(bp, bucket_logprobs(cut, lq)).cpu().numpy()
    return out


def seed_floor(
    term: Any, labels: Tensor, other_seed: tuple[Tensor, Tensor], ref: tuple[Tensor, Tensor],
    top_k: int, rows: int = 256,
) -> np.ndarray:  # fmt: skip
    """At each KD row of `term`, the forward KL from `other_seed` (a teacher of the student's
    tokenizer from another seed) to `ref` (the same-tokenizer teacher) over `other_seed`'s own
    top-k and tail: the loss `ref`, standing in for the student, would pay under
    same-tokenizer KD from `other_seed`. `[N]` float64, NaN on rows without KD."""
    return bucket_reach(term, labels, other_seed, ref, top_k, rows)["own"]


@torch.no_grad()
def observed_split(
    term: Any, labels: Tensor, ref: tuple[Tensor, Tensor], rows: int = 256
) -> dict[str, np.ndarray]:
    """Where a target's distance from a model of the student's tokenizer lies: at the bucket
    that holds the text's own next token or at the others. At each KD row of `term`, the
    target's (`t_obs`) and `ref`'s (`p_obs`) probability of that bucket, the forward KL from
    the target to `ref` over all buckets (`kl`, what `row_losses` reads) and its part from
    that bucket against the rest alone (`kl_obs`: the two-way KL; `kl − kl_obs` is the rest's,
    by the chain rule), and whether the bucket is the tail (`in_tail`). `[N]` float64 each,
    NaN on rows without KD or without a next token."""
    tp, part = _one_part_plan(term, labels)
    kd = ((tp.report_weight > 0) & (labels >= 0)).cpu()  # a KD row with a token
    keys = ("t_obs", "p_obs", "kl", "kl_obs", "in_tail")
    out = {k: np.full(kd.shape[0], np.nan) for k in keys}
    for sel, cut, lp, bp in _kd_slices(kd, part, ref, tp.temperature, rows):
        lt = torch.cat([cut.logq, cut.logq_tail.unsqueeze(1)], 1).double()
        hot = torch.full_like(lp, float("-inf"))
        hot.scatter_(1, labels[sel.to(labels.device)].to(lp.device).unsqueeze(1), 0.0)
        obs = bucket_logprobs(cut, hot).argmax(1, keepdim=True)  # the one bucket holding it
        t, q = lt.gather(1, obs)[:, 0].exp(), bp.gather(1, obs)[:, 0].exp()
        two = torch.stack([t, 1 - t], 1).log(), torch.stack([q, 1 - q], 1).log()
        at = sel.numpy()
        out["t_obs"][at], out["p_obs"][at] = t.cpu().numpy(), q.cpu().numpy()
        out["kl"][at] = _bucket_kl(lt, bp).cpu().numpy()
        out["kl_obs"][at] = _bucket_kl(*two).cpu().numpy()
        out["in_tail"][at] = (obs[:, 0] == lt.shape[1] - 1).double().cpu().numpy()
    return out


@torch.no_grad()
def end_step_mass(sb, tb, hidden_t, head_t, joins_s, joins_t, top_k: int) -> dict[str, np.ndarray]:
    """At each chunk of one student token whose next teacher token is in the text: of the
    teacher's top-k mass at the position after the chunk's last teacher token, the part the
    step past the end (`lookahead_end` and the targets after it) moves to a longer student token
    (`moved`), the part of that whose teacher token x the teacher's own tokenizer would have
    joined with its last token t into one token t·x (`moved_joined`: mass on a split that
    tokenizer does not write), and all such mass (`joined`). Per chunk `[C]`, NaN where the
    step does not apply."""
    from crossdistill.losses.targets import teacher_targets

    chunks = tb.chunks.long()
    s0, s1, t0, t1 = chunks.unbind(-1)
    ids_s, ids_t = sb.input_ids.flatten().long(), tb.input_ids.flatten().long()
    labels_t = tb.labels.flatten().long()
    last = (t1 - 1).clamp(min=0)
    ok = (s1 - s0 == 1) & (t1 > t0) & (s0 > 0) & (labels_t[last] >= 0)
    rows = torch.where(ok, last, -1)
    dev = hidden_t.device
    tg = teacher_targets(hidden_t, head_t, rows.to(dev), labels_t.to(dev), top_k)
    ids, p = tg.topk_ids.long().cpu(), tg.topk_logprobs.double().exp().cpu()
    joined_s = joins_s.lookup(ids_s[s0.clamp(min=0)].unsqueeze(-1), ids) >= 0
    joined_t = joins_t.lookup(ids_t[last].unsqueeze(-1), ids) >= 0
    nan = torch.full_like(p[:, 0], float("nan"))
    return {
        "moved": torch.where(ok, (p * joined_s).sum(-1), nan).numpy(),
        "moved_joined": torch.where(ok, (p * (joined_s & joined_t)).sum(-1), nan).numpy(),
        "joined": torch.where(ok, (p * joined_t).sum(-1), nan).numpy(),
    }


# a KD row where `boundary: condition` drops more than this share of the teacher's mass is
# counted apart (`boundary_drops`): the rows whose target the condition reshapes most
LARGE_DROP = 0.1


def boundary_drops(term: Any, rows: int) -> dict[str, np.ndarray]:
    """Per student row `[rows]` that is a KD position (nan elsewhere): whether
    `boundary: condition` drops any of the teacher's top-k entries there (`any`), the
    teacher's mass it drops (`mass`, at the targets' temperature), and whether that is more
    than `LARGE_DROP` of it (`large`)."""
    from crossdistill.losses.plan import boundary_dropped

    out = {k: np.full(rows, np.nan) for k in ("any", "mass", "large")}
    read = boundary_dropped(term)
    if read is None:
        return out
    _, lp, _, dropped = read
    ok = (term.before[:, 0] >= 0).cpu().numpy()
    at = (term.chunks[:, 0] - 1).cpu().numpy()[ok]
    out["any"][at] = dropped.any(-1).double().cpu().numpy()[ok]
    out["mass"][at] = torch.where(dropped, lp[:, 0].double().exp(), 0.0).sum(-1).cpu().numpy()[ok]
    out["large"][at] = (out["mass"][at] > LARGE_DROP).astype(np.float64)
    return out


def add_by_class(cell: dict[str, dict[str, float]], got: dict[str, np.ndarray], row_class) -> None:
    """Adds per-row values `got` (NaN off the KD rows) into `cell`'s sums by row class."""
    for name, mask in row_class.items():
        m = mask & ~np.isnan(next(iter(got.values())))
        acc = cell.setdefault(name, {k: 0.0 for k in got} | {"rows": 0})
        for k, v in got.items():
            acc[k] += float(v[m].sum())
        acc["rows"] += int(m.sum())


def means_by_class(cells: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """`add_by_class`'s sums as means per KD row, with the row counts."""
    return {
        name: {k: v / max(acc["rows"], 1) for k, v in acc.items() if k != "rows"}
        | {"rows": acc["rows"]}
        for name, acc in cells.items()
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the --out folder of a bench quality run")
    ap.add_argument("--target", action="append", required=True, help="a target to measure")
    ap.add_argument("--student", action="append", type=Path, default=[],
                    help="another stand-in for the student: a run or model folder")  # fmt: skip
    ap.add_argument("--past-end", action="append", choices=["all", "canonical"],
                    help="teachers.N.past_end of the targets that read past the end (repeatable: "
                    "one column each; default all)")  # fmt: skip
    ap.add_argument("--many-chunks", action="append", choices=["first_piece", "path"],
                    help="teachers.N.many_chunks of the lookahead targets (repeatable: one "
                    "column each; default path)")  # fmt: skip
    ap.add_argument("--deep-alternatives", action="append", choices=["join", "longest"],
                    help="teachers.N.deep_alternatives of the lookahead targets (repeatable: one "
                    "column each; default join)")  # fmt: skip
    ap.add_argument("--split-context", action="append", choices=["none", "wide", "previous"],
                    help="teachers.N.split_context of lookahead_split (repeatable: one column "
                    "each; default none)")  # fmt: skip
    ap.add_argument("--boundary", action="append", choices=["ignore", "condition"],
                    help="teachers.N.boundary of every target (repeatable: one column each; "
                    "default: the config's)")  # fmt: skip
    ap.add_argument("--table-text", type=Path,
                    help="count the boundary table on this training file (JSONL), not on the "
                    "run's own text: a quick run's text is too short to rule anything out")  # fmt: skip
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", type=int, default=0, help="at most this many (0: all)")
    ap.add_argument("--reach", action="store_true",
                    help="also how much of the same-tokenizer teacher's difference from each "
                    "--student each target's buckets can hold (bucket_reach)")  # fmt: skip
    ap.add_argument("--observed", action="store_true",
                    help="also split each target's distance from the same-tokenizer teacher "
                    "into the bucket of the text's own token and the rest (observed_split)")  # fmt: skip
    ap.add_argument("--other-seeds", action="store_true",
                    help="also the same-tokenizer teacher's other seeds as targets of "
                    "same-tokenizer KD, the floor of a second model's distance (seed_floor)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.reach and not args.student:
        ap.error(
            "--reach compares the same-tokenizer teacher with a student: name one with --student"
        )
    from dataclasses import replace

    from crossdistill.config import Config, TeacherConfig, from_dict
    from crossdistill.eval.model import load_eval_model
    from crossdistill.losses.target_kinds import target_kind
    from crossdistill.models import load_tokenizer
    from crossdistill.train.build import build_projection_for

    for t in args.target:  # target_kind: an unknown name is one line listing the targets
        if target_kind(t).mix and (args.reach or args.observed):
            ap.error(
                f"--reach and --observed read one bucket divergence; {t} has two: leave it out"
            )
    default_end, default_many = TeacherConfig.past_end, TeacherConfig.many_chunks
    default_deep = TeacherConfig.deep_alternatives
    default_context = TeacherConfig.split_context
    args.split_context = list(dict.fromkeys(args.split_context or [default_context]))
    args.past_end = list(dict.fromkeys(args.past_end or [default_end]))
    args.many_chunks = list(dict.fromkeys(args.many_chunks or [default_many]))
    args.deep_alternatives = list(dict.fromkeys(args.deep_alternatives or [default_deep]))
    default_boundary = TeacherConfig.boundary
    args.boundary = list(dict.fromkeys(args.boundary or [default_boundary]))
    summary = json.loads((args.out / "summary.json").read_text())
    same = summary["same_tokenizer"]
    ce_runs = sorted((args.out / "students" / "ce").glob("seed*/config.json"))
    if same not in summary.get("teacher_runs", {}) or not ce_runs:
        sys.exit(f"{args.out} has no finished same-tokenizer teacher and CE-only student yet")
    config = json.loads(ce_runs[0].read_text())
    data = from_dict(Config, config).data
    if args.table_text is not None:  # the boundary table counted on other text than the run's
        data = replace(data, train=[str(args.table_text)])
    dev = torch.device(args.device)
    same_info = summary["teacher_runs"][same]
    stand_ins = {"same_teacher": teacher_folder(same_info)}
    for folder in args.student:
        stand_ins[folder.name if folder.name != "final" else folder.parent.name] = (
            folder / "final" if (folder / "final" / "config.json").is_file() else folder
        )
    models = {k: load_eval_model(str(v), args.device).model for k, v in stand_ins.items()}
    other_seeds = {}
    if args.other_seeds:
        seeds = same_info.get("seeds", {})
        if len(seeds) < 2:
            sys.exit(
                f"--other-seeds reads a second teacher of {same}; {args.out} has one: run "
                "bench quality with --teacher-seeds 2"
            )
        other_seeds = {
            f"seed {s}": load_eval_model(str(teacher_folder(same_info, s)), args.device).model
            for s in sorted(map(int, seeds))[1:]
        }
    table: dict[str, Any] = {"out": str(args.out), "teachers": {}}
    for label, info in summary["teacher_runs"].items():
        if label == same:
            continue
        tok_t = load_tokenizer(info["tokenizer"])
        tok_s, batches = held_out(config, [info["tokenizer"]])
        batches = batches[: args.batches] if args.batches else batches
        text_class = text_class_of_tokens(tok_s)
        teacher = load_eval_model(str(teacher_folder(info)), args.device).model
        rows_t = teacher.get_output_embeddings().weight.shape[0]
        rows_s = next(iter(models.values())).get_output_embeddings().weight.shape[0]
        base = TeacherConfig(path=str(teacher_folder(info)), top_k=64)
        tcfgs = {
            " ".join(
                [t]
                + [
                    v
                    for v, d in (
                        (end, default_end),
                        (many, default_many),
                        (deep, default_deep),
                        (bound, default_boundary),
                        (ctx, default_context),
                    )
                    if v != d
                ]
            ): replace(
                base,
                target=t,
                past_end=end,
                many_chunks=many,
                deep_alternatives=deep,
                boundary=bound,
                split_context=ctx,
            )
            for t in args.target
            for bound in args.boundary
            for end in (args.past_end if target_kind(t).past_end else [default_end])
            for many in (args.many_chunks if target_kind(t).lookahead else [default_many])
            for deep in (args.deep_alternatives if target_kind(t).lookahead else [default_deep])
            for ctx in (args.split_context if target_kind(t).split else [default_context])
        }
        projections = {
            t: build_projection_for(c, tok_t, tok_s, rows_t, rows_s, dev, data=data)
            for t, c in tcfgs.items()
        }
        from crossdistill.alignment.projection import build_joins, own_joins
        from crossdistill.losses.projection import Joins

        joins_s = Joins.from_rows(torch.from_numpy(build_joins(tok_t, tok_s)), rows_t, rows_s)
        joins_t = Joins.from_rows(torch.from_numpy(own_joins(tok_t)), rows_t, rows_t)
        sums: dict[str, dict[str, dict[str, list[float]]]] = {}
        reach: dict[str, dict[str, dict[str, dict[str, float]]]] = {}
        observed: dict[str, dict[str, dict[str, float]]] = {}
        floor: dict[str, dict[str, dict[str, float]]] = {}
        drops: dict[str, dict[str, dict[str, float]]] = {}
        ends: dict[str, dict[str, list[float]]] = {}
        for i, b in enumerate(batches):
            sb, tb = b.student, b.teachers[0]
            n = sb.input_ids.numel()
            chunks = tb.chunks.numpy()
            text, align = chunk_classes(chunks, sb.input_ids.flatten().numpy(), text_class)
            t_row, a_row = classes_by_row(chunks, text, align, n)
            row_class = class_masks(t_row, a_row)
            hidden_t, head_t = hidden_and_head(teacher, tb)
            by_chunk = class_masks(text, align)
            mass = end_step_mass(sb, tb, hidden_t, head_t, joins_s, joins_t, base.top_k)
            for name, mask in by_chunk.items():
                m = mask & ~np.isnan(mass["moved"])
                acc = ends.setdefault(name, {k: [0.0, 0] for k in mass})
                for k, v in mass.items():
                    acc[k][0] += float(v[m].sum())
                    acc[k][1] += int(m.sum())
            labels = sb.labels.flatten().to(dev)
            stand = {who: hidden_and_head(model, sb) for who, model in models.items()}
            for t, tcfg in tcfgs.items():
                term = term_of(tcfg, projections[t], tb, hidden_t, head_t, dev, sb.input_ids)
                # the floor once, at the first target's KD rows: every target has the same
                for who, model in other_seeds.items() if t == next(iter(tcfgs)) else []:
                    got = seed_floor(term, labels, hidden_and_head(model, sb),
                                     stand["same_teacher"], base.top_k)  # fmt: skip
                    add_by_class(floor.setdefault(who, {}), {"nats": got}, row_class)
                for who in (w for w in stand if args.reach and w != "same_teacher"):
                    got = bucket_reach(term, labels, stand["same_teacher"], stand[who], base.top_k)
                    add_by_class(reach.setdefault(who, {}).setdefault(t, {}), got, row_class)
                if term.projection.boundaries is not None:
                    add_by_class(drops.setdefault(t, {}), boundary_drops(term, n), row_class)
                if args.observed:
                    got = observed_split(term, labels, stand["same_teacher"])
                    add_by_class(observed.setdefault(t, {}), got, row_class)
                for who, (hidden_s, head_s) in stand.items():
                    per_row = row_losses(term, labels, hidden_s, head_s)
                    cell = sums.setdefault(who, {}).setdefault(t, {})
                    for name, mask in row_class.items():
                        m = mask & ~np.isnan(per_row)
                        acc = cell.setdefault(name, [0.0, 0])
                        acc[0] += float(per_row[m].sum())
                        acc[1] += int(m.sum())
            print(f"[fidelity] {label}: batch {i + 1}/{len(batches)}", file=sys.stderr)
        table["teachers"][label] = {
            who: {
                t: {
                    name: {"nats": v / max(c, 1), "share": c / max(cells["all"][1], 1)}
                    for name, (v, c) in cells.items()
                }
                for t, cells in per_t.items()
            }
            for who, per_t in sums.items()
        }
        if reach:
            table.setdefault("reach", {})[label] = {
                who: {t: means_by_class(cells) for t, cells in per_t.items()}
                for who, per_t in reach.items()
            }
        if observed:
            table.setdefault("observed", {})[label] = {
                t: means_by_class(cells) for t, cells in observed.items()
            }
        if drops:
            table.setdefault("boundary_drops", {})[label] = {
                t: means_by_class(cells) for t, cells in drops.items()
            }
        if floor:
            table.setdefault("seed_floor", {})[label] = {
                who: means_by_class(cells) for who, cells in floor.items()
            }
        table["end_step"] = {
            label: {
                name: {k: v / max(c, 1) for k, (v, c) in acc.items()}
                | {"share": acc["moved"][1] / max(ends["all"]["moved"][1], 1)}
                for name, acc in ends.items()
            }
        }
    print_table(table)
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


def print_table(table: dict[str, Any]) -> None:
    for label, per_t in table.get("observed", {}).items():
        for t, per_class in per_t.items():
            print(f"\nteacher {label}, target {t}: the bucket of the text's own token, nats and "
                  "probabilities per KD position: the target's distance from the same-tokenizer "
                  "teacher (KL), the part from that bucket against the rest, the two "
                  "probabilities of that bucket, and how often it is the tail")  # fmt: skip
            print(f"  {'class':28s} {'KL':>8s} {'its part':>9s} {'target':>8s} {'teacher':>8s} "
                  f"{'in tail':>8s}")  # fmt: skip
            for name, r in per_class.items():
                print(f"  {name:28s} {r['kl']:8.4f} {r['kl_obs']:9.4f} {r['t_obs']:8.4f} "
                      f"{r['p_obs']:8.4f} {r['in_tail']:8.1%}")  # fmt: skip
    for label, per_who in table.get("reach", {}).items():
        for who, per_t in per_who.items():
            print(f"\nteacher {label}: the same-tokenizer teacher's forward KL to {who}, nats per "
                  "KD position: over the whole vocabulary, over that teacher's own top-k and "
                  "tail, and over each target's buckets (its share of the own)")  # fmt: skip
            targets = list(per_t)
            print(
                f"  {'class':28s} {'full':>8s} {'own':>8s} "
                + " ".join(f"{t:>24s}" for t in targets)
            )
            for name, r in per_t[targets[0]].items():
                vals = " ".join(
                    f"{per_t[t][name]['target']:10.4f} ({per_t[t][name]['target'] / max(r['own'], 1e-12):5.0%})"
                    + " " * 6
                    for t in targets
                )
                print(f"  {name:28s} {r['full']:8.4f} {r['own']:8.4f} {vals}")
    for label, per_who in table.get("seed_floor", {}).items():
        print(f"\nchunks of teacher {label}: what the same-tokenizer teacher pays under "
              "same-tokenizer KD from its tokenizer's teacher of another seed, nats per KD "
              "position of each class")  # fmt: skip
        print(f"  {'class':28s} " + " ".join(f"{who:>10s}" for who in per_who))
        for name in next(iter(per_who.values())):
            print(f"  {name:28s} " + " ".join(f"{r[name]['nats']:10.4f}" for r in per_who.values()))
    for label, per_t in table.get("boundary_drops", {}).items():
        for t, per_class in per_t.items():
            print(f"\nteacher {label}, target {t}: the KD positions where the student's token "
                  "rules out some of the teacher's top-k, and the teacher's mass dropped there, "
                  "per KD position")  # fmt: skip
            print(f"  {'class':28s} {'with a drop':>12s} {'mass':>8s} "
                  f"{'over ' + format(LARGE_DROP, '.0%'):>9s}")  # fmt: skip
            for name, r in per_class.items():
                print(f"  {name:28s} {r['any']:12.1%} {r['mass']:8.4f} {r['large']:9.2%}")
    for label, rows in table.get("end_step", {}).items():
        print(f"\nteacher {label}, at the position after a chunk of one student token: its "
              "top-k mass the step past the end moves to a longer student token, the part of "
              "that on a split its own tokenizer does not write, and all mass on such splits")  # fmt: skip
        print(f"  {'class':28s} {'share':>7s} {'moved':>8s} {'moved, not written':>19s} "
              f"{'not written':>12s}")  # fmt: skip
        for name, r in rows.items():
            print(f"  {name:28s} {r['share']:7.1%} {r['moved']:8.4f} {r['moved_joined']:19.4f} "
                  f"{r['joined']:12.4f}")  # fmt: skip
    for label, per_who in table["teachers"].items():
        for who, per_t in per_who.items():
            targets = list(per_t)
            print(f"\nteacher {label}, the student stood in for by {who}: KD loss, nats per KD "
                  "position of each class")  # fmt: skip
            print(f"  {'class':28s} {'share':>7s} " + " ".join(f"{t:>20s}" for t in targets))
            for name in per_t[targets[0]]:
                share = per_t[targets[0]][name]["share"]
                vals = " ".join(f"{per_t[t][name]['nats']:20.4f}" for t in targets)
                print(f"  {name:28s} {share:7.1%} {vals}")


if __name__ == "__main__":
    main()

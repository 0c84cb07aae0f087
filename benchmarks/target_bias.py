"""Where does the first-piece target put the teacher's probability of the text that follows?

At each KD position (the start of an aligned chunk) the first-piece projection gives the
teacher's probability of its observed next token t to `first_piece(t)`, the first student piece of
t's bytes. The student's observed next token is `label`. When `first_piece(t) == label` the
target's observed-path mass sits on the token the student has to predict; when it does not, the
target teaches the student to put that mass on another token, one its own tokenizer would not
emit there. This counts, on real text and real tokenizers, how often and why:

- `right`: `first_piece(t) == label`;
- `student_longer`: the student's token spans the chunk, the teacher needed several tokens (the
  teacher's first token is a strict prefix of the student's: the target under-weights the longer
  student token that actually follows);
- `student_shorter`: the chunk has several student tokens and the first piece of t is not the
  student's first token (the student splits t's bytes otherwise in context);
- `other`: the rest (both sides several tokens).

It also counts the share of the student's positions that are KD positions at all (one per
aligned chunk; a student position inside a chunk of several student tokens gets CE only), and
`prefix_right`: under the byte-prefix target (`teachers.N.target: prefix`), the share of KD
positions where the observed teacher token's event is the group the observed student token
belongs to (the teacher's mass of the text that follows lands on a group holding the student's
token).

Over the `multi` KD positions (share of all KD positions), those whose chunk is one student
token over m > 1 teacher tokens `t_0 … t_{m−1}`, it counts what the lookahead target
(`teachers.N.target: lookahead`, `losses.lookahead`) reads there, as shares of the multi
positions (`*_of_kd`: the same counts as shares of all KD positions):

- `lookahead_started`: the path starts, a student token spells `t_0` (`a_1`), so the teacher's
  positions after the KD position are read;
- `lookahead_reach`: the path follows the observed teacher tokens all the way to the student's
  token within `LOOKAHEAD_DEPTH` teacher positions: m ≤ D and, for every d < m, the bytes of
  `t_0 … t_d` are a student token (`a_{d+1}`; the last is the student's token itself);
- `multi_length`: the shares of the multi positions with m = 2, 3, 4 and more.

Over all KD positions, how the `hkl` loss (X-Token's hybrid KL) pairs the observed teacher
token (`alignment.projection.relaxed_matches`): `hkl_exact`, with its exact student twin (as
`gold` does); `hkl_relaxed`, with a longer student token it starts; `hkl_unpaired`, neither.

Over the one-to-one KD positions (one token on each side), how much a group of the prefix targets
(`lookahead_prefix`, `lookahead_prefix_end`) leaves to the student, with the observed teacher
token standing in for the teacher's alternatives there: `one_to_one`, their share of all KD
positions; `grouped`, the share of them whose teacher token's group (the student tokens whose
first teacher piece it is) holds more than one student token, so the target gives the group's
total and not its split; `group_size`, the mean size of those groups.

Over all KD positions, what `teachers.N.target: lookahead_end` reads past the student's token:

- `end_step`: the path reaches the student's token (one student token, m < D, every prefix a
  student token), so the teacher's position after it is read;
- `end_joinable`: of those, the student has some token spelling its token followed by a teacher
  token (the step can move mass there);
- `end_observed_joins`: of those, the text's own next teacher token is one of them: the student
  has the longer token but its tokenizer did not use it here (byte-level BPE merges in its own
  order), and the step moves that continuation's share onto a token the text did not use.

    python benchmarks/target_bias.py --student $TOK/llama3/hf --teacher $TOK/qwen3/hf \\
        --teacher $TOK/llama2/hf [--corpus FILE ...] [--bytes 2000000] [--spread] [--json]

With `--depth-routing`, how the lookahead target routes a teacher's alternatives inside a student
token, with the text standing in for a teacher that knows it (`depth_routing`): after a prefix
`t_0 … t_{d−1}` (d ≥ 1) of an observed student-longer chunk's path, an alternative x ≠ `t_d`
goes to the student token spelling the prefix then x, or to the prefix's token `a_d` where the
student has none. Every place in the text where the same prefix is followed by some x is a
sample of where that mass belongs: the student token the text used there. `routing` splits the
alternatives' mass (each observed step weighing the continuations seen after its prefix, less
its own) into `right` (the rule names the text's token), `under_join` / `under_fallback` (the
text's token is longer than the join / than `a_d`: the mass belongs to a token the rule does
not reach), `over` (the text used `a_d` where the rule joins) and `other`.

No model is run: alignment and projection only, seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossdistill.alignment import align  # noqa: E402
from crossdistill.alignment.projection import (  # noqa: E402
    _student_lookup,
    build_projection,
    joins_of,
    relaxed_matches,
)
from crossdistill.alignment.token_bytes import TokenBytes  # noqa: E402
from crossdistill.bench.quality_corpus import corpus_pieces, spread_pieces  # noqa: E402
from crossdistill.losses import LOOKAHEAD_DEPTH, PrefixGroups  # noqa: E402
from crossdistill.models import load_tokenizer  # noqa: E402
from crossdistill.train.audit import FIRST_PIECE_KINDS as KINDS  # noqa: E402
from crossdistill.train.audit import first_bytes, first_piece_kinds  # noqa: E402


def texts_of(corpora: list[str], limit: int, spread: bool = False) -> list[str]:
    """About `limit` bytes of the corpora: their first bytes, or with `spread` whole documents at
    an even stride through them, as the bench's students read a corpus ordered by source."""
    if corpora:
        pieces = corpus_pieces(corpora)
    else:
        from crossdistill.train.demo_assets import stdlib_corpus

        pieces, _ = stdlib_corpus(max_files=100_000, seed=0, train_bytes=limit, val_bytes=1)
    return spread_pieces(pieces, limit) if spread else first_bytes(pieces, limit)


def path_length(ids_t, pieces_t: list[bytes], known: set[bytes]) -> int:
    """How many of the teacher tokens `ids_t` the lookahead target's path follows: the largest d
    such that the bytes of each of their first 1 … d tokens are a student token (`known`)."""
    spelled = b""
    for d, t in enumerate(ids_t):
        piece = pieces_t[t]
        if not piece or spelled + piece not in known:
            return d
        spelled += piece
    return len(ids_t)


def pair_counts(texts: list[str], tok_s, tok_t) -> dict:
    bytes_s, bytes_t = TokenBytes.from_tokenizer(tok_s), TokenBytes.from_tokenizer(tok_t)
    projection = build_projection(tok_t, tok_s)
    forward = projection.first_piece
    first = forward.numpy()
    exact, paired = projection.exact.numpy(), relaxed_matches(tok_t, tok_s, projection) >= 0
    hkl = np.zeros(3, dtype=np.int64)  # exact, relaxed, unpaired
    groups = PrefixGroups.from_first_pieces(build_projection(tok_s, tok_t).first_piece, forward)
    event_s, event_t = groups.student_event.numpy(), groups.teacher_event.first_piece.numpy()
    size = np.bincount(event_s, minlength=groups.num_events + 1)[: groups.num_events]
    size_of_t = np.where(event_t >= 0, size[event_t.clip(min=0)], 0)  # a teacher id's group
    one_to_one = grouped = group_sizes = 0
    counts = dict.fromkeys(KINDS, 0)
    label_bytes = target_bytes = predicted = prefix_right = 0
    pieces_t, known = bytes_t.pieces(), {p for p in bytes_s.pieces() if p}
    lengths = np.zeros(LOOKAHEAD_DEPTH + 2, dtype=np.int64)  # multi positions by m, m > D as D + 1
    reach = started = 0
    joins = joins_of(bytes_t, bytes_s)
    joinable = np.zeros(len(bytes_s.lengths), dtype=bool)
    joinable[joins[:, 0]] = True
    join_keys = set((joins[:, 0].astype(np.int64) * len(pieces_t) + joins[:, 1]).tolist())
    end_step = end_joinable = end_observed = 0
    enc_s = tok_s.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    enc_t = tok_t.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    for es, et in zip(enc_s, enc_t):
        ids_s, ids_t = np.asarray(es.ids), np.asarray(et.ids)
        predicted += max(len(ids_s) - 1, 0)  # student positions that predict a next token
        chunks = align(ids_s, ids_t, bytes_s, bytes_t).chunks
        kinds = first_piece_kinds(ids_s, ids_t, chunks, first)
        for k, v in kinds.items():
            counts[k] += int(v.sum())
        at = chunks[(chunks[:, 0] > 0) & (chunks[:, 2] > 0)]
        label, target, right = ids_s[at[:, 0]], first[ids_t[at[:, 2]]], kinds["right"]
        prefix_right += int((event_s[label] == event_t[ids_t[at[:, 2]]]).sum())
        observed_t = ids_t[at[:, 2]]
        hkl += np.bincount(
            np.where(exact[observed_t], 0, np.where(paired[observed_t], 1, 2)), minlength=3
        )
        label_bytes += int(bytes_s.lengths[label[~right]].sum())
        target_bytes += int(bytes_s.lengths[target[~right & (target >= 0)]].sum())
        multi = at[(at[:, 1] - at[:, 0] == 1) & (at[:, 3] - at[:, 2] > 1)]
        m = np.minimum(multi[:, 3] - multi[:, 2], LOOKAHEAD_DEPTH + 1)
        lengths += np.bincount(m, minlength=lengths.size)
        for t0, t1 in multi[:, 2:].tolist():
            followed = path_length(ids_t[t0 : min(t1, t0 + LOOKAHEAD_DEPTH)], pieces_t, known)
            started += followed > 0
            reach += followed == t1 - t0
        single = observed_t[(at[:, 1] - at[:, 0] == 1) & (at[:, 3] - at[:, 2] == 1)]
        one_to_one += single.size
        grouped += int((size_of_t[single] > 1).sum())
        group_sizes += int(size_of_t[single].sum())
        one = at[at[:, 1] - at[:, 0] == 1]
        for s0, t0, t1 in one[:, [0, 2, 3]].tolist():
            m = t1 - t0
            if m >= LOOKAHEAD_DEPTH or path_length(ids_t[t0:t1], pieces_t, known) < m:
                continue
            end_step += 1
            if joinable[ids_s[s0]]:
                end_joinable += 1
                nxt = int(ids_t[t1]) if t1 < len(ids_t) else -1
                end_observed += nxt >= 0 and int(ids_s[s0]) * len(pieces_t) + nxt in join_keys
    total = sum(counts.values())
    out: dict = {"kd_positions": total}
    out.update({k: v / max(total, 1) for k, v in counts.items()})
    wrong = total - counts["right"]
    out["label_bytes_where_wrong"] = label_bytes / max(wrong, 1)
    out["target_bytes_where_wrong"] = target_bytes / max(wrong, 1)
    # the student's predicting positions that are KD positions (one per aligned chunk): the
    # rest sit inside chunks of several student tokens and get CE only
    out["student_positions_with_kd"] = total / max(predicted, 1)
    out["prefix_right"] = prefix_right / max(total, 1)
    for name, count in zip(("hkl_exact", "hkl_relaxed", "hkl_unpaired"), hkl.tolist()):
        out[name] = count / max(total, 1)
    n_multi = int(lengths.sum())
    out["multi"] = n_multi / max(total, 1)
    out["lookahead_reach"] = reach / max(n_multi, 1)
    out["lookahead_started"] = started / max(n_multi, 1)
    out["lookahead_reach_of_kd"] = reach / max(total, 1)
    out["lookahead_started_of_kd"] = started / max(total, 1)
    out["one_to_one"] = one_to_one / max(total, 1)
    out["grouped"] = grouped / max(one_to_one, 1)
    out["group_size"] = group_sizes / max(one_to_one, 1)
    out["end_step"] = end_step / max(total, 1)
    out["end_joinable"] = end_joinable / max(end_step, 1)
    out["end_observed_joins"] = end_observed / max(end_joinable, 1)
    names = [str(k) for k in range(2, LOOKAHEAD_DEPTH + 1)] + [f">{LOOKAHEAD_DEPTH}"]
    out["multi_length"] = {k: int(v) / max(n_multi, 1) for k, v in zip(names, lengths[2:])}
    return out


ROUTES = ("right", "under_join", "under_fallback", "over", "other")


def depth_routing(texts: list[str], tok_s, tok_t) -> dict:
    """`--depth-routing` (module docstring): the shares of ROUTES in the alternatives' mass at
    depths 1 … D − 1 of the observed student-longer chunks' paths, and that mass per step."""
    bytes_s, bytes_t = TokenBytes.from_tokenizer(tok_s), TokenBytes.from_tokenizer(tok_t)
    pieces_s, pieces_t = bytes_s.pieces(), bytes_t.pieces()
    student = _student_lookup(bytes_s)  # the id the projection's joins pick for shared bytes
    seen: dict[tuple, dict[int, list[int]]] = {}  # prefix -> x -> counts by route
    steps: list[tuple[tuple, int]] = []  # (prefix, observed x) of the student-longer paths
    enc_s = tok_s.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    enc_t = tok_t.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    for es, et in zip(enc_s, enc_t):
        ids_s, ids_t = np.asarray(es.ids), np.asarray(et.ids)
        for s0, s1, t0, t1 in align(ids_s, ids_t, bytes_s, bytes_t).chunks.tolist():
            if s1 <= s0 or t1 <= t0 or s0 >= len(ids_s):
                continue
            s = int(ids_s[s0])
            spelled = b""
            for d in range(1, min(LOOKAHEAD_DEPTH, len(ids_t) - t0)):
                spelled += pieces_t[int(ids_t[t0 + d - 1])]
                a = student.get(spelled)
                if a is None:
                    break
                x = int(ids_t[t0 + d])
                r = student.get(spelled + pieces_t[x], a)
                longer = pieces_s[s].startswith(pieces_s[r]) and s != r
                route = (
                    0 if s == r
                    else (1 if r != a else 2) if longer
                    else 3 if s == a
                    else 4
                )  # fmt: skip
                prefix = tuple(ids_t[t0 : t0 + d].tolist())
                seen.setdefault(prefix, {}).setdefault(x, [0] * len(ROUTES))[route] += 1
                if s1 - s0 == 1 and t1 - t0 > d:
                    steps.append((prefix, x))
    mass = np.zeros(len(ROUTES))
    for prefix, observed in steps:
        after = seen[prefix]
        n = sum(sum(c) for c in after.values())
        for x, counts in after.items():
            if x != observed:
                mass += np.asarray(counts) / n
    total = float(mass.sum())
    return {
        "steps": len(steps),
        "alternatives_per_step": total / max(len(steps), 1),
        "routing": {k: float(v) / max(total, 1e-12) for k, v in zip(ROUTES, mass)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--student", required=True, help="the student's tokenizer folder")
    p.add_argument("--teacher", action="append", required=True, help="a teacher's tokenizer")
    p.add_argument("--corpus", action="append", default=[])
    p.add_argument("--bytes", type=int, default=2_000_000, help="text to read (UTF-8 bytes)")
    p.add_argument(
        "--spread",
        action="store_true",
        help="whole documents spread evenly through the corpus, not its first bytes",
    )
    p.add_argument(
        "--depth-routing",
        action="store_true",
        help="also route the lookahead target's alternatives inside student tokens by the text",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    texts = texts_of(args.corpus, args.bytes, args.spread)
    tok_s = load_tokenizer(args.student)
    rows = {}
    for path in args.teacher:
        tok_t = load_tokenizer(path)
        rows[path] = pair_counts(texts, tok_s, tok_t)
        if args.depth_routing:
            rows[path]["depth_routing"] = depth_routing(texts, tok_s, tok_t)
    result = {
        "student": args.student,
        "corpus": args.corpus or ["python standard library"],
        "bytes": sum(len(t.encode()) for t in texts),
        "spread": args.spread,
        "pairs": rows,
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        "| teacher | KD positions | right | student longer | student shorter | other "
        "| student positions with KD | prefix target right |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for path, r in rows.items():
        cells = " | ".join(f"{r[k]:.1%}" for k in KINDS)
        tail = f"{r['student_positions_with_kd']:.1%} | {r['prefix_right']:.1%}"
        print(f"| {path} | {r['kd_positions']} | {cells} | {tail} |")
    names = list(next(iter(rows.values()))["multi_length"])
    print(
        "\n| teacher | multi (of KD positions) | lookahead started (of multi) "
        "| lookahead reach (of multi) | "
        + " | ".join(f"m {k}" if k[0] == ">" else f"m = {k}" for k in names)
        + " |"
    )
    print("|---" * (4 + len(names)) + "|")
    for path, r in rows.items():
        cells = " | ".join(f"{r[k]:.1%}" for k in ("multi", "lookahead_started", "lookahead_reach"))
        tail = " | ".join(f"{v:.1%}" for v in r["multi_length"].values())
        print(f"| {path} | {cells} | {tail} |")
    print("\n| teacher | one to one (of KD positions) | grouped (of those) | mean group size |")
    print("|---|---|---|---|")
    for path, r in rows.items():
        print(f"| {path} | {r['one_to_one']:.1%} | {r['grouped']:.1%} | {r['group_size']:.2f} |")
    print("\n| teacher | end step (of KD positions) | joinable (of end steps) | observed joins |")
    print("|---|---|---|---|")
    for path, r in rows.items():
        cells = " | ".join(
            f"{r[k]:.1%}" for k in ("end_step", "end_joinable", "end_observed_joins")
        )
        print(f"| {path} | {cells} |")
    if args.depth_routing:
        print("\n| teacher | steps | alternatives per step | " + " | ".join(ROUTES) + " |")
        print("|---" * (3 + len(ROUTES)) + "|")
        for path, r in rows.items():
            dr = r["depth_routing"]
            cells = " | ".join(f"{dr['routing'][k]:.1%}" for k in ROUTES)
            print(f"| {path} | {dr['steps']} | {dr['alternatives_per_step']:.2f} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

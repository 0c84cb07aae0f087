"""How much the student's previous token says about `lookahead_split`'s share, counted on the
text alone (no model).

`lookahead_split` gives an alternative teacher token x the share `π_x` of its mass for the
student token that spells x exactly, and the rest for the student's longer tokens that start with
x (`train/short_share.py`). `π_x` is one number per teacher token, counted on the training text.
A share that also reads the student's token before the KD position (a table per pair of that
token and x, drawn toward `π_x`) could follow the context. This counts what it would gain: at
the boundaries `boundary_counts` counts (x at a boundary of both tokenizations, the student's
token there x's exact one or a longer one; `short_share.boundary_events`), the binary log-loss
of the observed outcome under `π_x` and under the conditioned share, both counted on four
documents in five and read on the fifth. The target applies the share only to the alternatives,
at the teacher's mass on them, so this says where a share can gain, not how much the target
moves. A run counts `π_x` on a smaller sample than the pairs (what `target: auto` reads), so
`π_x` counted on that much is reported too, and the gain's two parts show apart: the larger
sample's and the previous token's.

    python benchmarks/split_context.py CORPUS.jsonl.gz [CORPUS ...] --teacher $TOK/mistral/hf \
        [--student $TOK/llama3/hf] [--bytes 5000000] [--share-bytes N] [--top-pairs N] \
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.teacher_boundary_share import read_texts  # noqa: E402

# every this many documents, one reads the shares the others count: documents in path order
# (a corpus's files) change kind along the way, and a cut at one place would read the shares on
# files of another kind
READ_EVERY = 5
# a share of x outside this range is no choice between the exact token and the longer ones
AMBIGUOUS = (0.05, 0.95)


def log_losses(
    counted: np.ndarray, read: np.ndarray, v_t: int, sampled: np.ndarray | None = None
) -> dict[str, float]:
    """Binary log-loss (nats per boundary) on `read`'s events (`short_share.boundary_events`)
    of the share `π_x` and of the share per (x, previous student token) drawn toward `π_x`
    (`short_share.pair_shares`), both counted on `counted`'s; over all of `read` and over its
    events whose `π_x` lies in `AMBIGUOUS`. With `sampled` (the events of the smaller sample
    a run counts `π_x` on), also `π_x` counted on those alone (`share_sampled`)."""
    from crossdistill.train.short_share import counts_of, pair_shares, short_shares

    pi = short_shares(*counts_of(counted, v_t))
    keys, shares = pair_shares(counted, pi)
    x, y = read[:, 0], read[:, 2] == 1
    query = np.where(read[:, 1] >= 0, read[:, 1] * v_t + x, -1)
    at = np.clip(np.searchsorted(keys, query), 0, max(len(keys) - 1, 0))
    found = (keys[at] == query) & (query >= 0) if len(keys) else np.zeros(len(read), bool)
    cond = np.where(found, shares[at] if len(keys) else 0.0, pi[x])

    def loss(share: np.ndarray, m: np.ndarray) -> float:
        q = np.clip(share[m], 1e-9, 1 - 1e-9)
        return float(-np.where(y[m], np.log(q), np.log1p(-q)).mean()) if m.any() else float("nan")

    every = np.ones(len(read), dtype=bool)
    amb = (pi[x] > AMBIGUOUS[0]) & (pi[x] < AMBIGUOUS[1])
    small = {}
    if sampled is not None:
        small["share_sampled"] = loss(short_shares(*counts_of(sampled, v_t))[x], every)
    return small | {
        "events": len(read),
        "exact_rate": float(y.mean()) if len(read) else float("nan"),
        "share": loss(pi[x], every),
        "share_by_previous": loss(cond, every),
        "ambiguous": float(amb.mean()) if len(read) else float("nan"),
        "share_ambiguous": loss(pi[x], amb),
        "share_by_previous_ambiguous": loss(cond, amb),
    }


def top_pairs(tok_s, tok_t, counted: np.ndarray, v_t: int, n: int) -> list[dict]:
    """The `n` pairs of `counted`'s events whose share sets them furthest from their teacher
    token's own, weighed by how often they occur (the difference times the square root of the
    count): the previous student token, the teacher token, the count and both shares."""
    from crossdistill.train.short_share import counts_of, pair_counts, pair_shares, short_shares

    pi = short_shares(*counts_of(counted, v_t))
    keys, shares = pair_shares(counted, pi)
    count = pair_counts(counted, v_t)[1]
    weight = np.abs(shares - pi[keys % v_t]) * np.sqrt(count)
    out = []
    for i in np.argsort(-weight)[:n].tolist():
        u, x = divmod(int(keys[i]), v_t)
        out.append({"previous": tok_s.decode([u]), "teacher": tok_t.convert_ids_to_tokens(x),
                    "count": int(count[i]), "token_share": float(pi[x]),
                    "pair_share": float(shares[i])})  # fmt: skip
    return out


def measure(tok_s, tok_t, texts: list[str], share_bytes: int, pairs: int = 0) -> dict[str, float]:
    """`log_losses` with one document in `READ_EVERY` of `texts` reading and the rest counting,
    and `π_x` also counted on the counting documents' first `share_bytes` characters; with
    `pairs`, also that many `top_pairs` of the counting documents."""
    from crossdistill.alignment.projection import build_projection
    from crossdistill.train.short_share import boundary_events

    first = build_projection(tok_t, tok_s).first_piece.numpy()
    of_student = build_projection(tok_s, tok_t).first_piece.numpy()
    reading = [t for i, t in enumerate(texts) if i % READ_EVERY == READ_EVERY - 1]
    counting = [t for i, t in enumerate(texts) if i % READ_EVERY != READ_EVERY - 1]
    counted = boundary_events(tok_s, tok_t, counting, first, of_student)
    read = boundary_events(tok_s, tok_t, reading, first, of_student)
    head, n = [], 0
    for text in counting:
        if n >= share_bytes:
            break
        head.append(text[: share_bytes - n])
        n += len(head[-1])
    sampled = boundary_events(tok_s, tok_t, head, first, of_student)
    got = log_losses(counted, read, first.shape[0], sampled)
    if pairs:
        got["top_pairs"] = top_pairs(tok_s, tok_t, counted, first.shape[0], pairs)
    return got


def main(argv: list[str] | None = None) -> None:
    from crossdistill.train.auto_target import SAMPLE_BYTES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", nargs="+", type=Path)
    ap.add_argument("--teacher", required=True)
    ap.add_argument("--student", default=None, help="default: $CROSSDISTILL_TOKENIZERS/llama3/hf")
    ap.add_argument("--bytes", type=int, default=5_000_000, help="characters read per corpus")
    ap.add_argument("--share-bytes", type=int, default=SAMPLE_BYTES,
                    help="characters a run counts its per-token shares on (default: what "
                    "lookahead_split reads, auto_target.SAMPLE_BYTES)")  # fmt: skip
    ap.add_argument("--top-pairs", type=int, default=0,
                    help="also list this many pairs whose share differs most from their token's")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from crossdistill.models import load_tokenizer

    student = args.student or os.path.join(os.environ.get("CROSSDISTILL_TOKENIZERS", ""),
                                           "llama3", "hf")  # fmt: skip
    tok_s, tok_t = load_tokenizer(student), load_tokenizer(args.teacher)
    table = {"teacher": args.teacher, "student": student, "bytes": args.bytes,
             "share_bytes": args.share_bytes, "corpora": {}}  # fmt: skip
    print("corpus | events | exact | share on the run's sample | share | share by previous | "
          "ambiguous | there: share, by previous")  # fmt: skip
    for path in args.corpus:
        got = measure(tok_s, tok_t, read_texts(path, args.bytes), args.share_bytes, args.top_pairs)
        table["corpora"][path.name] = got
        print(f"{path.name} | {got['events']:,} | {got['exact_rate']:.1%} | "
              f"{got['share_sampled']:.4f} | {got['share']:.4f} | "
              f"{got['share_by_previous']:.4f} | {got['ambiguous']:.1%} | "
              f"{got['share_ambiguous']:.4f}, {got['share_by_previous_ambiguous']:.4f}")  # fmt: skip
        for p in got.get("top_pairs", []):
            print(f"  after {p['previous']!r}: {p['teacher']!r} {p['count']:,} times, share "
                  f"{p['pair_share']:.2f} against {p['token_share']:.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()

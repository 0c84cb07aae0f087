"""How much of the text a teacher's own token boundary rules out at a KD position, counted on the
text alone (no model).

At a KD position the teacher's last token t ended; the student's context does not say so. Where the
text, at a student boundary, goes on past the end of bytes that the teacher writes as token t
with a longer teacher token instead (after Mistral's `ENT` the text mostly goes on as `ENTRY`,
which Mistral writes as one token), the position is no KD position. Per teacher token t, with J
the KD positions after t and X the student boundaries where the teacher's token spells t and then
goes on, X / (J + X) is the share of such continuations after t; averaged over the KD positions,
it bounds from above (a model that reads the context does better than one share per token) the
mass a target conditioned on the teacher's boundary lacks there.

    python benchmarks/teacher_boundary_share.py CORPUS.jsonl.gz --teacher $TOK/mistral/hf \
        [--student $TOK/llama3/hf] [--bytes 2000000] [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def read_texts(path: Path, limit: int) -> list[str]:
    """The first documents of a JSONL(.gz) corpus's `text` field, up to `limit` characters."""
    opener = gzip.open if path.suffix == ".gz" else open
    texts, n = [], 0
    with opener(path, "rt") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            n += len(texts[-1])
            if n >= limit:
                break
    return texts


def shares(tok_s, tok_t, texts: list[str]) -> dict:
    """Counts per teacher token (module docstring) and their mean over the KD positions."""
    from crossdistill.alignment.chunks import make_side
    from crossdistill.train.auto_target import encoded_sample

    pipe, ids_s, ids_t = encoded_sample(tok_s, tok_t, texts)
    bt = pipe.bytes_t
    by_bytes = {}
    for i, p in enumerate(bt.pieces()):
        if p:
            by_bytes.setdefault(p, i)
    kd, past, first = collections.Counter(), collections.Counter(), collections.Counter()
    for s, t in zip(ids_s, ids_t):
        side_s, side_t = make_side(s, pipe.bytes_s), make_side(t, bt)  # dummy prefix dropped
        text = side_t.stream().tobytes()
        ends_s, ends_t, starts_t = side_s.ends, side_t.ends, side_t.starts
        for p in np.unique(ends_s[:-1][side_s.lens[:-1] > 0]).tolist():
            if p <= 0:
                continue
            k = int(np.searchsorted(ends_t, p))  # the teacher token over byte p - 1
            q, e = int(starts_t[k]), int(ends_t[k])
            if e == p:
                kd[int(t[k])] += 1
            elif (w := by_bytes.get(text[q:p])) is not None:
                past[w] += 1
                first[text[p : p + 1].decode("latin-1")] += 1
    total = sum(kd.values())
    mean = sum(kd[w] * past[w] / (kd[w] + past[w]) for w in kd) / max(total, 1)
    top = sorted(kd, key=lambda w: -kd[w] * past[w] / (kd[w] + past[w]))[:8]
    return {
        "kd_positions": total,
        "continuations": sum(past.values()),
        "mean_share": mean,
        "top_tokens": [
            {"token": bt.token_bytes(w).decode("utf-8", "replace"), "kd": kd[w], "past": past[w]}
            for w in top
        ],
        "first_bytes": first.most_common(8),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path, nargs="+")
    ap.add_argument("--teacher", required=True, help="the teacher's tokenizer folder")
    ap.add_argument("--student", required=True, help="the student's tokenizer folder")
    ap.add_argument("--bytes", type=int, default=2_000_000, help="text read per corpus")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    from crossdistill.models import load_tokenizer

    tok_s, tok_t = load_tokenizer(args.student), load_tokenizer(args.teacher)
    out = {}
    for path in args.corpus:
        got = out[path.name] = shares(tok_s, tok_t, read_texts(path, args.bytes))
        print(f"{path.name}: {got['kd_positions']:,} KD positions, {got['continuations']:,} "
              f"continuations past a teacher token, mean share {got['mean_share']:.3%}")  # fmt: skip
        for r in got["top_tokens"][:5]:
            print(f"  {r['token']!r:>12s}  KD {r['kd']:>6,}  past {r['past']:>6,}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

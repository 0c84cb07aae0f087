"""Where a student's probability goes when the next token is ordinary text: each student of a
`bench quality` run (every target's folder, also ones trained beside the bench), and the
same-tokenizer teacher, scored on the held-out positions whose label is not a digit token.

    python benchmarks/label_mass.py OUT [--seed seed0] [--batches 20] [--json FILE]

Per model: the mean bits of the label there, and the mean mass it puts on the student's digit
tokens and on the student tokens the cross teacher's tokenizer does not spell as one token (the
tokens the prefix groups of `lookahead_prefix_end` and `lookahead_split` hold), with the
non-digit part of those apart. A target that teaches the groups' members too much mass leaves
it on them where the text does not go there. Written for Perl's near pair, whose training text
is 16% digits (benchmarks/README.md, "The groups on Perl's near pair, and the held-out text
from the whole of the training stretch").
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bpb_by_class import TEXT_CLASSES, held_out, text_class_of_tokens  # noqa: E402


def model_folders(out: Path, seed: str, same: str, summary: dict) -> dict[str, Path]:
    """`name -> final model folder`: every student folder of `seed`, then the same-tokenizer
    teacher."""
    found = {
        run.parent.name: run / "final"
        for run in sorted((out / "students").glob(f"*/{seed}"))
        if (run / "final" / "config.json").is_file()
    }
    found[f"teacher-{same}"] = Path(summary["teacher_runs"][same]["run"]) / "final"
    return found


@torch.no_grad()
def label_mass(model, batches, digit: torch.Tensor, unspelled: torch.Tensor) -> dict[str, float]:
    """Mean bits of the label and mass on `digit` / `unspelled` tokens (`[V]` masks) over the
    held-out positions whose label is not a digit token."""
    from crossdistill.models.attention import segments_of
    from crossdistill.models.forward import final_hidden

    weight = model.get_output_embeddings().weight.float()
    sums = {"positions": 0, "bits": 0.0, "digit": 0.0, "unspelled": 0.0, "unspelled_other": 0.0}
    for batch in batches:
        side = batch.student
        hidden = final_hidden(model, side.input_ids, side.position_ids, segments_of(side, "cpu"))
        labels = side.labels.flatten()
        keep = labels >= 0
        keep &= ~digit[labels.clamp(min=0)]
        logp = torch.log_softmax(hidden.flatten(0, 1)[keep].float() @ weight.T, -1)
        p = logp.exp()
        sums["positions"] += int(keep.sum())
        sums["bits"] += -logp.gather(-1, labels[keep][:, None]).sum().item() / math.log(2)
        sums["digit"] += p[:, digit].sum().item()
        sums["unspelled"] += p[:, unspelled].sum().item()
        sums["unspelled_other"] += p[:, unspelled & ~digit].sum().item()
    n = max(sums.pop("positions"), 1)
    return {"positions": n, **{k: v / n for k, v in sums.items()}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the --out folder of a bench quality run")
    ap.add_argument("--seed", default="seed0", help="the students' seed folder (default seed0)")
    ap.add_argument("--batches", type=int, default=20, help="held-out batches read (default 20)")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    from crossdistill.alignment.projection import build_projection
    from crossdistill.eval.model import load_eval_model
    from crossdistill.models import load_tokenizer

    summary = json.loads((args.out / "summary.json").read_text())
    same = summary["same_tokenizer"]
    cross = [k for k in summary["teacher_runs"] if k != same]
    if len(cross) != 1:
        sys.exit(f"{args.out}: this reads a run with one cross teacher tokenizer, not {cross}")
    folders = model_folders(args.out, args.seed, same, summary)
    config = json.loads((args.out / "students" / "ce" / args.seed / "config.json").read_text())
    # packed as the cross teacher's students were validated (its chunks break long documents)
    tokenizer_t = summary["teacher_runs"][cross[0]]["tokenizer"]
    tok_s, batches = held_out(config, [tokenizer_t])
    batches = batches[: args.batches]
    tok_t = load_tokenizer(tokenizer_t)
    rows = int(config["student"]["overrides"].get("vocab_size", len(tok_s)))
    spelled = np.ones(rows, dtype=bool)  # rows past the tokenizer: never a label, no mass
    spelled[: len(tok_s)] = build_projection(tok_s, tok_t).exact.numpy()
    classes = np.full(rows, TEXT_CLASSES.index("other"), dtype=np.int8)
    classes[: len(tok_s)] = text_class_of_tokens(tok_s)
    digit = torch.from_numpy(classes == TEXT_CLASSES.index("digits"))
    unspelled = torch.from_numpy(~spelled)
    table = {}
    for name, folder in folders.items():
        model = load_eval_model(str(folder), "cpu").model
        table[name] = row = label_mass(model, batches, digit, unspelled)
        print(f"{name:50s} bits/label {row['bits']:.4f}  on digits {row['digit']:.4f}  "
              f"on unspelled {row['unspelled']:.4f} (not digits {row['unspelled_other']:.4f})  "
              f"over {row['positions']} positions", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(table, indent=2) + "\n")


if __name__ == "__main__":
    main()

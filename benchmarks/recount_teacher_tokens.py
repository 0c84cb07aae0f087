"""Recount the FLOPs of recorded `bench step` results with the teachers' tokens of exactly the
batches that were timed.

`bench step` results recorded before it counted the timed batches themselves (the
`teacher_tokens_per_student_token` it reports now) took the ratio from the one batch drawn before
warm-up; it varies from batch to batch by several percent (1.00–1.13 for Qwen3's tokenizer
against Llama-3's on the benchmark's text). The data are deterministic, so the timed batches can
be drawn again here, on the CPU, with the loader `bench step` builds on a CUDA machine, and the
FLOPs per token and the MFU recomputed from the recorded tokens/s. The text is the running
interpreter's standard library, so the batches are the recorded run's only under the same Python
version (`same_batches`: the batch drawn before warm-up gives the recorded ratio); otherwise the
recount is an estimate from the same kind of text.

    python benchmarks/recount_teacher_tokens.py --tokenizers $TOK results/step-*.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
from pathlib import Path

from crossdistill.bench.step import DATASHEET_BF16_TFLOPS

PEAK_TFLOPS = DATASHEET_BF16_TFLOPS["H200"]  # the recorded runs' device


def _bench_args(command: str, tokenizers: Path) -> argparse.Namespace:
    from crossdistill.bench.step import add_parser

    words = shlex.split(command)[3:]  # after "crossdistill bench step"
    words = [w.replace("/tmp/tok", str(tokenizers)) for w in words]
    for flag in ("--variant", "--ablate"):  # they do not change the data (and names change)
        while flag in words:
            i = words.index(flag)
            del words[i : i + 2]
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["step", *words])


def _timed_counts(args) -> tuple[list[float], ...]:
    """Teacher non-pad tokens per student token in the batch drawn before warm-up and over the
    batches `bench step` timed, and the teachers' row slots (padding included) per non-pad
    token over those batches."""
    from crossdistill.bench.step_setup import (
        bench_config,
        count_tokens,
        first_ratio,
        write_corpus,
    )
    from crossdistill.data import build_loader
    from crossdistill.models import load_tokenizer

    tok_s = load_tokenizer(args.student_tokenizer)
    toks_t = [load_tokenizer(t) for t in args.teacher_tokenizer]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench_config(args, write_corpus(Path(tmp), args))
        loader = iter(build_loader(cfg.data, tok_s, toks_t, split="train"))
        first = first_ratio(next(loader))  # what `bench step` drew before warm-up
        for _ in range(args.warmup * args.grad_accum):
            next(loader)
        counts = [0] * (1 + len(toks_t))
        slots = [0] * len(toks_t)
        for _ in range(args.steps * args.grad_accum):
            batch = next(loader)
            count_tokens(batch, counts)
            for k, tb in enumerate(batch.teachers):
                slots[k] += tb.doc_ids.numel()
    padded = [s / max(c, 1) for s, c in zip(slots, counts[1:])]
    return first, [c / counts[0] for c in counts[1:]], padded


def _flops(args, ratios: list[float]) -> float:
    import torch

    from crossdistill.bench.step import _flops_per_student_token, _shape
    from crossdistill.models.loading import build_meta_model

    def shape(arch):
        return _shape(build_meta_model(None, arch, dtype=torch.bfloat16))

    teachers = [(shape(arch), r) for arch, r in zip(args.teacher, ratios)]
    return _flops_per_student_token(shape(args.student), teachers, args.seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizers", type=Path, required=True, help="holds <name>/hf/ folders")
    ap.add_argument("results", nargs="+", type=Path)
    cli = ap.parse_args()
    for path in cli.results:
        rec = json.loads(path.read_text())
        args = _bench_args(rec["command"], cli.tokenizers)
        first, ratios, padded = _timed_counts(args)
        # the text is this interpreter's standard library: the batches are the recorded run's
        # only under the same Python version; else the recount is an estimate on other text
        same = first == rec["teacher_tokens_per_student_token"]
        flops = _flops(args, ratios)
        recorded = rec["flops_per_token"]
        again = _flops(args, rec["teacher_tokens_per_student_token"])
        assert abs(again - recorded) < 1e-6 * recorded, (path, again, recorded)
        row = {
            "file": path.name,
            "same_batches": same,
            "recorded_ratio": rec.get("teacher_tokens_per_student_token"),
            "timed_ratio": [round(r, 4) for r in ratios],
            "row_slots_per_teacher_token": [round(r, 4) for r in padded],
            "recorded_mfu": rec.get("mfu"),
            "recorded_flops_per_token": rec.get("flops_per_token"),
            "flops_per_token": flops,
            "mfu": rec["tokens_per_s"] * flops / (PEAK_TFLOPS * 1e12),
        }
        for key in ("variant", "ablate"):
            for k, v in rec.items():
                if k.startswith(f"{key}/") and k.endswith("/tokens_per_s"):
                    row[k.replace("tokens_per_s", "mfu")] = v * flops / (PEAK_TFLOPS * 1e12)
        if rec.get("naive_tokens_per_s"):
            row["naive_mfu"] = rec["naive_tokens_per_s"] * flops / (PEAK_TFLOPS * 1e12)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""The optimised step against the plain PyTorch path, on the same models and batches: losses
and gradient norms over N steps.

Optimised: varlen flash attention, compiled blocks, the Triton loss kernels and fused teacher
targets (what `crossdistill bench step --compile` times). Plain: transformers' SDPA attention
with the block mask, eager blocks, the PyTorch loss and target code (`train.loss_kernels:
pytorch`). Each is a run of the trainer's own components, built from its config. Both start from the same random init of real shapes and see the same batches from the
real collator; bf16 autocast on CUDA, so they agree to bf16 tolerance, not bit for bit.

    python benchmarks/optimised_vs_plain.py --student-tokenizer $TOK/llama3/hf \\
        --teacher qwen3-4b --teacher-tokenizer $TOK/qwen3/hf --steps 20 > result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--student", default="llama-3.2-1b")
    ap.add_argument("--student-tokenizer", required=True)
    ap.add_argument("--teacher", action="append", default=[])
    ap.add_argument("--teacher-tokenizer", action="append", default=[])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a few small layers (CPU smoke)")
    args = ap.parse_args(argv)
    # the fields `bench step`'s builder reads
    for name, value in dict(
        warmup=0, grad_accum=1, top_k=64, loss="forward_kl", loss_chunk_size=2048,
        checkpoint_blocks=0, checkpoint_scope="block", teacher_padding="auto",
    ).items():  # fmt: skip
        setattr(args, name, value)
    return args


def _run(args, batches: list, optimised: bool) -> dict[str, list[float]]:
    from crossdistill.bench.step_setup import build_bench
    from crossdistill.train.step import train_step

    options = (
        {"compile": args.device == "cuda", "attention": "auto", "loss_kernels": "auto"}
        if optimised
        else {"compile": False, "attention": "sdpa", "loss_kernels": "pytorch"}
    )
    bench = build_bench(argparse.Namespace(**{**vars(args), **options}))  # same initial weights
    c = bench.c
    losses, norms = [], []
    for batch in batches:
        window = [batch.to(bench.device)]
        metrics = train_step(c.student, c.slots, window, bench.settings, c.placement)
        norm = torch.nn.utils.clip_grad_norm_(c.student.parameters(), 1.0)
        c.optimizer.step()
        c.optimizer.zero_grad(set_to_none=True)
        losses.append(float(metrics["loss"]))
        norms.append(float(norm))
    del bench, c
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"loss": losses, "grad_norm": norms}


def main(argv: list[str] | None = None) -> None:
    from crossdistill.bench.step_setup import build_bench

    args = _args(sys.argv[1:] if argv is None else argv)
    feeder = build_bench(
        argparse.Namespace(**vars(args), compile=False, attention="auto", loss_kernels="auto")
    )
    batches = [next(feeder.loader) for _ in range(args.steps)]
    del feeder
    fast = _run(args, batches, optimised=True)
    plain = _run(args, batches, optimised=False)
    rel = {k: [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(fast[k], plain[k])] for k in fast}
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                "date": time.strftime("%Y-%m-%d"),
                "torch": torch.__version__,
                "command": "python benchmarks/optimised_vs_plain.py " + " ".join(sys.argv[1:]),
                "optimised": fast,
                "plain": plain,
                "max_rel_diff_loss": max(rel["loss"]),
                "max_rel_diff_grad_norm": max(rel["grad_norm"]),
                "loss_first_last": [plain["loss"][0], plain["loss"][-1]],
            }
        )
    )


if __name__ == "__main__":
    main()

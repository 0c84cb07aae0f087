"""What a student block keeps for backward, per activation-checkpointing scope, measured on the
CPU with saved-tensor hooks (unique storages, the parameters themselves left out).

A float32 model under bf16 autocast with compiled blocks, as the student trains on a GPU; two of
its blocks at two token counts split the kept bytes into a part per token and a fixed part
(autocast's bf16 copies of the weights). Multiply out for a GPU micro-batch: the MLP scope's
0.50 GiB per Llama-3.2-1B block at 8,192 tokens predicted here is what the H200 runs measured.

    python benchmarks/saved_activations.py [--arch llama-3.2-1b] > result.json
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _kept_bytes(model, tokens: int) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    pos = torch.arange(tokens)[None]
    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with hooks, torch.autocast("cpu", torch.bfloat16):
        out = model.model(input_ids=ids, position_ids=pos, use_cache=False)
    out.last_hidden_state.float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return sum(kept.values())


def main(argv: list[str] | None = None) -> None:
    from crossdistill.distributed.parallelize import apply_activation_checkpointing, apply_compile
    from crossdistill.models import build_causal_lm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, nargs=2, default=[256, 512])
    ap.add_argument(
        "--gpu-tokens", type=int, default=8192, help="tokens per micro-batch to scale to"
    )
    args = ap.parse_args(argv)
    blocks, (t0, t1) = 2, args.tokens
    out = {"arch": args.arch, "torch": torch.__version__, "command": " ".join(sys.argv)}
    for scope in ("none", "block", "mlp", "selective"):
        model = build_causal_lm(
            arch=args.arch, dtype=torch.float32, overrides={"num_hidden_layers": blocks}, seed=0
        )
        if scope != "none":
            apply_activation_checkpointing(model, 0, scope=scope)
        apply_compile(model)
        _kept_bytes(model, t1)  # compile
        a, b = _kept_bytes(model, t0), _kept_bytes(model, t1)
        per_token = (b - a) / (t1 - t0) / blocks
        fixed = (b - per_token * t1 * blocks) / blocks
        out[scope] = {
            "per_token_per_block_bytes": per_token,
            "fixed_per_block_bytes": fixed,
            f"per_block_gib_at_{args.gpu_tokens}_tokens": (fixed + per_token * args.gpu_tokens)
            / 2**30,
        }
        print(scope, out[scope], file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

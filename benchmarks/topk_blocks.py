"""Teacher top-k and target statistics on one `[rows, V]` chunk of bf16 logits, on this GPU:
`torch.topk` against `topk_by_blocks` (and its block-max pass alone), and the two CUDA flows
of a chunk's targets (`fused_chunk` flows "bitmask" and "blocks"), for the shipped teachers'
vocabularies. Each result is checked against `torch.topk`'s values first.

    python benchmarks/topk_blocks.py [--rows 2048] > result.json
"""

from __future__ import annotations

import argparse
import json

import torch
from device_ceilings import time_ms  # (this folder is on the path when run as a script)

VOCABS = {"qwen3": 151936, "llama-3": 128256, "phi-4-mini": 200064}


def main() -> None:
    from crossdistill.losses import targets

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=64)
    args = ap.parse_args()
    k, tiny = args.top_k, torch.finfo(torch.float32).tiny
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": args.rows}
    for name, vocab in VOCABS.items():
        z = (torch.randn(args.rows, vocab, device="cuda") * 2.5).bfloat16()
        nxt = torch.randint(0, vocab, (args.rows,), device="cuda")
        assert torch.equal(targets.topk_by_blocks(z, k)[0], z.topk(k, dim=1).values)
        row = {
            "torch.topk_ms": time_ms(lambda z=z: z.topk(k, dim=1)),
            "topk_by_blocks_ms": time_ms(lambda z=z: targets.topk_by_blocks(z, k)),
            "block_max_pass_ms": time_ms(lambda z=z: z.view(z.shape[0], -1, 128).amax(2)),
        }
        for flow in ("bitmask", "blocks"):
            got = targets.fused_chunk(z, nxt, k, 1.0, tiny, flow)
            assert torch.equal(z.gather(1, got[2]), z.topk(k, dim=1).values)
            row[f"chunk_targets_{flow}_ms"] = time_ms(
                lambda z=z, n=nxt, f=flow: targets.fused_chunk(z, n, k, 1.0, tiny, f)
            )
        out[f"{name} (V = {vocab})"] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""The varlen attention kernel on this GPU (PyTorch's FlashAttention-2 operators, what
`crossdistill.models.attention` calls) on the packed shapes of the shipped teachers and student:
ms, TFLOP/s over the causal work inside the documents (forward; forward + backward counted as
3.5× the forward), and the error against a float64 reference on one document. Another backend
can be added to `KERNELS` to compare it in the same run.

    python benchmarks/attention_backends.py [--tokens 8192] [--row 2048] > result.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from device_ceilings import time_ms  # (this folder is on the path when run as a script)

SHAPES = {  # name: (query heads, key/value heads, head dim)
    "qwen3-4b (teacher)": (32, 8, 128),
    "llama-3.2-3b (teacher)": (24, 8, 128),
    "llama-3.2-1b (student)": (32, 8, 64),
}


def _segments(tokens: int, row: int, seed: int) -> tuple[torch.Tensor, int, float]:
    """Rows of `row` tokens cut into 1-4 documents: (cu_seqlens, longest, causal pairs)."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    for _ in range(tokens // row):
        cuts = torch.randperm(row - 1, generator=g)[: int(torch.randint(0, 4, (1,), generator=g))]
        bounds = [0, *sorted((cuts + 1).tolist()), row]
        lengths += [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    return cu.cuda(), max(lengths), pairs


def flash(q, k, v, cu, longest, grad=None):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, longest, longest, 0.0, True, False
    )
    if grad is None:
        return out
    return torch.ops.aten._flash_attention_backward(
        grad, q, k, v, out, lse, cu, cu, longest, longest, 0.0, True, rng, unused
    )


KERNELS = {"flash": flash}


def _reference(q, k, v, n: int) -> torch.Tensor:
    """float64 causal attention over the first document (`n` tokens)."""
    q, k, v = (x[:n].double().transpose(0, 1) for x in (q, k, v))
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--row", type=int, default=2048)
    args = ap.parse_args()
    cu, longest, pairs = _segments(args.tokens, args.row, seed=0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "tokens": args.tokens, "row": args.row, "shapes": {}}  # fmt: skip
    for name, (h, h_kv, d) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(1)
        q = torch.randn(args.tokens, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (
            torch.randn(args.tokens, h_kv, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2)
        )
        grad = torch.randn_like(q)
        fwd_flop = 4 * pairs * h * d  # QKᵀ and PV over the causal pairs inside documents
        n0 = int(cu[1])
        want = _reference(q, k, v, n0)
        row: dict[str, float | str] = {}
        for label, fn in KERNELS.items():
            try:
                out = fn(q, k, v, cu, longest)
                row[f"{label}_error"] = float((out[:n0].double() - want).abs().max())
                row[f"{label}_vs_flash"] = float(
                    (out.float() - flash(q, k, v, cu, longest).float()).abs().max()
                )
                args_ = (q, k, v, cu, longest)
                f_ms = time_ms(lambda fn=fn, a=args_: fn(*a))
                fb_ms = time_ms(lambda fn=fn, a=args_, g=grad: fn(*a, g))
                row[f"{label}_fwd_ms"] = f_ms
                row[f"{label}_fwd_tflops"] = fwd_flop / f_ms / 1e9
                row[f"{label}_fwd_bwd_ms"] = fb_ms
                row[f"{label}_fwd_bwd_tflops"] = 3.5 * fwd_flop / fb_ms / 1e9
            except Exception as e:  # a backend this build lacks: say so, keep the others
                row[f"{label}_failed"] = f"{type(e).__name__}: {str(e)[:200]}"
        results["shapes"][name] = row
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

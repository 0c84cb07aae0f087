"""Measure a GPU's two ceilings once (bf16 matmul rate, device-to-device copy bandwidth) and
print the software there. Benchmarks report fractions of these beside the datasheet peak."""

from __future__ import annotations

import importlib
import json
import sys

import torch


def time_ms(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median CUDA-event time of `fn()` in ms (the other GPU scripts here use it too)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    info = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in [
        "transformers",
        "tokenizers",
        "numpy",
        "pyarrow",
        "yaml",
        "tqdm",
        "safetensors",
        "tiktoken",
        "triton",
        "tensorboard",
        "matplotlib",
    ]:
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "present")
        except ImportError:
            info[name] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        n = 8192
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: a @ b)
        info["bf16_matmul_tflops"] = round(2 * n**3 / ms / 1e9, 1)
        x = torch.empty(2 * 1024**3 // 2, device="cuda", dtype=torch.bfloat16).normal_()
        y = torch.empty_like(x)
        ms = time_ms(lambda: y.copy_(x))
        info["copy_tb_per_s"] = round(2 * x.numel() * 2 / ms / 1e9, 2)
    print(json.dumps(info))


if __name__ == "__main__":
    main()

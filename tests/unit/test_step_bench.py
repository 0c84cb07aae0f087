"""`crossdistill bench step` runs end to end on the CPU (tiny layers, real vocabularies and
tokenizers): its own step, the phase split, the profile, an ablation and the naive baseline."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from crossdistill.bench.profile import kind_of


def test_bench_step_smoke_on_cpu(tokenizer_dir):
    cmd = [
        sys.executable, "-m", "crossdistill", "bench", "step", "--tiny", "--device", "cpu",
        "--steps", "1", "--warmup", "1", "--seq-len", "64", "--micro-batch", "2", "--json",
        "--profile", "--ablate", "sdpa", "--baseline", "naive",
        "--student", "llama-3.2-1b", "--student-tokenizer", str(tokenizer_dir("llama2")),
        "--teacher", "qwen3-4b", "--teacher-tokenizer", str(tokenizer_dir("mistral")),
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "tokens_per_s", "naive_tokens_per_s", "ablate/sdpa/tokens_per_s", "loss_fraction",
        "loader_fraction", "flops_per_token",
    ):  # fmt: skip
        assert math.isfinite(result[key]) and result[key] > 0, key
    prof = result["profile"]
    assert prof["top"] and prof["busy_ms"] > 0 and prof["step_ms"] > 0
    assert abs(sum(prof["ms_by_kind"].values()) - prof["busy_ms"]) < 1e-6 * prof["busy_ms"] + 1e-9


def test_kernel_kinds():
    assert kind_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert kind_of("aten::mm") == "matmul"
    assert kind_of("flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert kind_of("triton_poi_fused_add_mul_0") == "triton"
    assert kind_of("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert kind_of("void multi_tensor_apply_kernel<...>") == "optimizer"

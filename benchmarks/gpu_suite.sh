#!/usr/bin/env bash
# The GPU benchmark suite, one call: device ceilings, the loss benchmark, and the full step
# benchmark for the two shipped teacher/student setups, each beside its naive baseline.
# Usage (on a CUDA machine, from the repository root):
#   TOK=/path/to/tokenizers OUT=/path/to/results bash benchmarks/gpu_suite.sh
# TOK holds <name>/hf/ tokenizer folders (llama3, qwen3, phi-4-mini). Results: $OUT/*.json.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-benchmarks/results}
TOK=${TOK:?set TOK to the tokenizers folder}
mkdir -p "$OUT"
stamp=$(date -u +%Y%m%d)
py=python3
$py benchmarks/device_ceilings.py | tee "$OUT/ceilings-$stamp.json"
$py -m crossdistill bench loss --device cuda --json | tee "$OUT/loss-$stamp.json"
$py -m crossdistill bench step --json --baseline naive --seq-len 2048 --micro-batch 4 \
    --student llama-3.2-1b --student-tokenizer "$TOK/llama3/hf" \
    --teacher qwen3-4b --teacher-tokenizer "$TOK/qwen3/hf" | tee "$OUT/step-qwen3-4b-llama-1b-2048-$stamp.json"
$py -m crossdistill bench step --json --baseline naive --seq-len 2048 --micro-batch 4 \
    --student llama-3.2-1b --student-tokenizer "$TOK/llama3/hf" \
    --teacher phi-4-mini --teacher-tokenizer "$TOK/phi-4-mini/hf" \
    --teacher llama-3.2-3b --teacher-tokenizer "$TOK/llama3/hf" | tee "$OUT/step-phi4mini-llama3b-llama-1b-2048-$stamp.json"

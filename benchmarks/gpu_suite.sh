#!/usr/bin/env bash
# The GPU benchmark suite: GPU tests, device ceilings, the loss benchmark, and the full step
# benchmark for the shipped teacher/student setups, each beside its naive baseline.
# Usage (on a CUDA machine, from the repository root):
#   TOK=/path/to/tokenizers OUT=/path/to/results [ONLY="tests step2048"] \
#       [EXTRA="--loss-chunk-size 2048" TAG=-name] bash benchmarks/gpu_suite.sh
# TOK holds <name>/hf/ tokenizer folders (llama3, qwen3, phi-4-mini). Results: $OUT/*.json.
# EXTRA: more `bench_step.py` arguments for the step2048 stage, TAG: a suffix for its file name.
# Stages (all by default; ONLY picks some, each fits one 10-minute call):
#   tests ceilings kernels loss step2048 ablate multi step4096 accum padding equal
# kernels: varlen attention and teacher top-k alone; ablate: the Qwen3 setup with each
# optimisation undone, each run in its own process (benchmarks/step_ablations.py); accum: the three setups with 4
# micro-batches per optimizer step and selective recomputation; padding: the two-teacher setup
# with its cross teacher on non-pad tokens vs padded rows, alternating runs; equal: optimised
# vs plain.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CROSSDISTILL_TOKENIZERS="${CROSSDISTILL_TOKENIZERS:-${TOK:-}}"
OUT=${OUT:-benchmarks/results}
TOK=${TOK:?set TOK to the tokenizers folder}
mkdir -p "$OUT"
stamp=$(date -u +%Y%m%d)
py=python3
stage() { [[ -z "${ONLY:-}" || " $ONLY " == *" $1 "* ]]; }
step() {  # name, then bench step arguments
    local name=$1; shift
    $py benchmarks/bench_step.py --json --split "$@" | tee "$OUT/step-$name-$stamp.json"
}
if stage tests; then
    $py -m pytest -m gpu -q -p no:cacheprovider tests/unit/test_attention.py \
        tests/unit/test_losses_gpu.py tests/unit/test_losses_targets.py \
        tests/unit/test_losses_fused.py tests/unit/test_teacher_padding.py 2>&1 | tail -20 | tee "$OUT/gpu-tests-$stamp.txt"
fi
stage ceilings && $py benchmarks/device_ceilings.py | tee "$OUT/ceilings-$stamp.json"
if stage kernels; then
    $py benchmarks/attention_backends.py | tee "$OUT/attention-backends-$stamp.json"
    $py benchmarks/topk_blocks.py | tee "$OUT/topk-blocks-$stamp.json"
fi
if stage loss; then
    for c in 2048 2752 4096; do
        $py -m crossdistill bench loss --device cuda --json --repeats 15 --chunk-size $c \
            | tee "$OUT/loss-chunk$c-$stamp.json"
    done
fi
S=(--student llama-3.2-1b --student-tokenizer "$TOK/llama3/hf")
Q=(--teacher qwen3-4b --teacher-tokenizer "$TOK/qwen3/hf")
P=(--teacher phi-4-mini --teacher-tokenizer "$TOK/phi-4-mini/hf"
   --teacher llama-3.2-3b --teacher-tokenizer "$TOK/llama3/hf")
stage step2048 && step qwen3-4b-llama-1b-2048${TAG:-} "${S[@]}" "${Q[@]}" --seq-len 2048 --micro-batch 4 ${EXTRA:-} \
    --steps 8 --warmup 3 --compile --baseline naive --profile
stage ablate && $py benchmarks/step_ablations.py --out "$OUT/ablations-$stamp.jsonl" -- "${S[@]}" \
    "${Q[@]}" --seq-len 2048 --micro-batch 4 --steps 8 --warmup 3 --compile
stage multi && step phi4mini-llama3b-llama-1b-2048 "${S[@]}" "${P[@]}" --seq-len 2048 \
    --micro-batch 4 --steps 8 --warmup 3 --compile --baseline naive
stage step4096 && step qwen3-4b-llama-1b-4096 "${S[@]}" "${Q[@]}" --seq-len 4096 --micro-batch 2 \
    --steps 8 --warmup 3 --compile --baseline naive
A=(--grad-accum 4 --loss-chunk-size 2048 --steps 4 --warmup 2 --compile
   --checkpoint-blocks 16 --checkpoint-scope selective)
if stage accum; then  # every student block's MLP elementwise work recomputed (Llama-1B: 16)
    step qwen3-4b-llama-1b-2048-accum4-sel16 "${S[@]}" "${Q[@]}" --seq-len 2048 --micro-batch 4 \
        "${A[@]}" --baseline naive
    step qwen3-4b-llama-1b-4096-accum4-sel16 "${S[@]}" "${Q[@]}" --seq-len 4096 --micro-batch 2 \
        "${A[@]}" --baseline naive
    step phi4mini-llama3b-llama-1b-2048-accum4-sel16 "${S[@]}" "${P[@]}" --seq-len 2048 \
        --micro-batch 4 "${A[@]}" --baseline naive
fi
if stage padding; then  # non-pad teacher bodies against the padded rows, each in its own process
    i=0
    for pad in drop keep drop keep; do
        i=$((i + 1))
        step phi4mini-llama3b-llama-1b-2048-accum4-sel16-$i-$pad "${S[@]}" "${P[@]}" --seq-len 2048 \
            --micro-batch 4 "${A[@]}" --teacher-padding $pad
    done
fi
stage equal && $py benchmarks/optimised_vs_plain.py "${S[@]}" "${Q[@]}" --seq-len 2048 \
    --micro-batch 2 --steps 20 | tee "$OUT/optimised-vs-plain-$stamp.json"
exit 0

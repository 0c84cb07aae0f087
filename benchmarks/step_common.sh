# Shared by step_2gpu.sh and step_4gpu.sh (sourced): the environment, the output folder, the
# stage filter (ONLY="a b" runs those stages) and the models and step settings of every stage.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TOK=${TOK:?set TOK to the tokenizers folder}
export CROSSDISTILL_TOKENIZERS="${CROSSDISTILL_TOKENIZERS:-$TOK}"
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
stamp=$(date -u +%Y%m%d)
stage() { [[ -z "${ONLY:-}" || " $ONLY " == *" $1 "* ]]; }
S=(--student llama-3.2-1b --student-tokenizer "$TOK/llama3/hf")
Q=(--teacher qwen3-4b --teacher-tokenizer "$TOK/qwen3/hf")
C=(--seq-len 4096 --compile --steps ${STEPS:-8} --warmup ${WARMUP:-3} --json)

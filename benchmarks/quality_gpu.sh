#!/usr/bin/env bash
# The quality experiment at GPU scale, detached, so it outlives one command's time limit.
# Usage, from the repository root of a CUDA machine:
#   TOK=/path/to/tokenizers bash benchmarks/quality_gpu.sh start [more bench quality arguments]
#   OUT=/path/to/results bash benchmarks/quality_gpu.sh collect [SECONDS]
# `start` launches the near pair (Llama-3 student, Qwen3 teacher) and the far pair (Llama-2
# teacher) into $RUN (default /tmp/quality), from a copy of the code in $RUN/code (TEACHERS names
# other teacher tokenizers under $TOK: TEACHERS=llama2 runs the far pair alone); `collect`
# waits up to SECONDS (default 0) for it to finish, then copies summary.json, cells.jsonl, the
# log and the plot to $OUT.
set -uo pipefail
RUN=${RUN:-/tmp/quality}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
case "${1:-}" in
start)
    shift
    TOK=${TOK:?set TOK to the tokenizers folder}
    teachers=()
    for name in ${TEACHERS:-qwen3 llama2}; do
        [ -d "$TOK/$name/hf" ] || { echo "no tokenizer $TOK/$name/hf (TEACHERS=${TEACHERS:-})" >&2; exit 2; }
        teachers+=(--teacher-tokenizer "$TOK/$name/hf")
    done
    mkdir -p "$RUN"
    # every run of the bench starts a fresh interpreter that imports the package and this
    # script again: run from a copy of them, so that the checkout may change while it goes
    # (a worker that cannot import them ends its run)
    rm -rf "$RUN/code" && mkdir -p "$RUN/code" && cp -r crossdistill benchmarks "$RUN/code"/ || exit 1
    export PYTHONPATH="$RUN/code"
    setsid nohup python3 "$RUN/code/benchmarks/bench_quality.py" --scale gpu --seeds "${SEEDS:-5}" \
        --student-tokenizer "$TOK/llama3/hf" "${teachers[@]}" --out "$RUN" --json "$@" \
        > "$RUN/stdout.json" 2> "$RUN/log.txt" < /dev/null &
    echo "started $! -> $RUN"
    ;;
collect)
    OUT=${OUT:?set OUT}
    # a detached run lives only on the machine that started it: a fresh machine has none, and
    # "finished" there would read as a run that ended with no results
    if [ ! -d "$RUN/code" ]; then
        echo "no run under $RUN on this machine: start one here (a run does not survive the machine that started it)" >&2
        exit 1
    fi
    deadline=$(( $(date +%s) + ${2:-0} ))
    while pgrep -f "$RUN/code/benchmarks/bench_quality.py" > /dev/null && (( $(date +%s) < deadline )); do sleep 10; done
    cp "$RUN"/summary.json "$RUN"/cells.jsonl "$RUN"/log.txt "$RUN"/stdout.json "$RUN"/quality.png "$OUT"/ 2>/dev/null
    pgrep -f "$RUN/code/benchmarks/bench_quality.py" > /dev/null && echo "still running" || echo "finished"
    tail -5 "$RUN/cells.jsonl" 2>/dev/null
    grep -v "^step " "$RUN/log.txt" | tail -5
    ;;
*)
    echo "usage: $0 start|collect" >&2
    exit 2
    ;;
esac

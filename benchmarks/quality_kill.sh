#!/usr/bin/env bash
# `bench quality --jobs 4` when one of its runs dies: the quick scale, and one run's process is
# killed with SIGKILL while the others train (as the kernel's out-of-memory killer ends one).
# The bench must stop at once, name the run and leave no process behind; the same command
# again must reuse every finished run and complete.
# Usage, from the repository root: bash benchmarks/quality_kill.sh cpu|cuda TOKENIZERS OUT
set -u
DEVICE=$1; TOK=$2; OUT=$3
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CMD="python3 -m crossdistill bench quality --scale quick --device $DEVICE --jobs 4 --seeds 2
    --student-tokenizer $TOK/llama3/hf --teacher-tokenizer $TOK/llama2/hf --out $OUT/run --json
    --keep-going"
echo $CMD > "$OUT/command.txt"
start=$(date +%s)
$CMD > "$OUT/first.json" 2> "$OUT/first.log" &
bench=$!
for _ in $(seq 300); do  # until the first run has finished, then a little more
    sleep 1
    grep -q "^\[quality\] teacher-" "$OUT/first.log" 2> /dev/null && break
done
sleep 3
victim=$(pgrep -n -f spawn_main)
echo "killed process $victim at $(( $(date +%s) - start )) s" | tee "$OUT/kill.txt"
kill -9 "$victim"
wait $bench
echo "first: exit status $? after $(( $(date +%s) - start )) s" | tee -a "$OUT/kill.txt"
grep "^RuntimeError" "$OUT/first.log" | tee -a "$OUT/kill.txt"
echo "processes left: $(pgrep -f spawn_main | wc -l)" | tee -a "$OUT/kill.txt"
again=$(date +%s)
$CMD > "$OUT/second.json" 2> "$OUT/second.log"
echo "second: exit status $? in $(( $(date +%s) - again )) s" | tee -a "$OUT/kill.txt"
grep "bits per byte (" "$OUT/first.log" "$OUT/second.log" | tee -a "$OUT/kill.txt"

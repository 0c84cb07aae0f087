#!/usr/bin/env bash
# The distillation step on two GPUs of one machine, layout by layout: `crossdistill bench step`
# under torchrun, Qwen3-4B-shaped teacher -> Llama-3.2-1B-shaped student (random weights, real
# tokenizers), sequence 4096, compiled blocks, each record beside the one-GPU run of the same
# command (`--one-gpu-reference`) where the layouts leave the command otherwise unchanged.
# Usage (from the repository root, on a machine with two GPUs):
#   TOK=/path/to/tokenizers OUT=/path/to/results [ONLY="fsdp separate"] bash benchmarks/step_2gpu.sh
# TOK holds llama3/hf and qwen3/hf. Records: $OUT/step-2gpu-<layout>-<date>.json, one per layout,
# written as each finishes (the table: benchmarks/README.md, "Two GPUs").
# Layouts (all by default, in this order):
#   fsdp          student FSDP over both GPUs, teacher FSDP (set: a teacher this size is
#                 replicated by default on GPUs)
#   defaults      the default layouts: student FSDP, teacher replicated
#   fsdp_keep     student FSDP with its blocks kept gathered from forward to backward, teacher FSDP
#   fsdp_keep_trep  the same, the teacher replicated (a copy per GPU: no gathers)
#   alone         the student alone (no teacher) on one GPU: the step's student time
#   separate      the teacher on GPU 1, the student on GPU 0, targets streamed (teachers.0.placement)
#   pp2_alone     the student in two pipeline stages, no teacher, 8 micro-batches (the bubble)
#   pp2           the same with the teacher (each stage computes half of its targets)
#   pp2_interleaved  pp2 with the interleaved schedule, two stages on each GPU
#   tp2 cp2       student and teacher tensor / context parallel over both GPUs
#   s_fsdp_t_tp2  student FSDP, teacher tensor parallel
#   s_tp2         student tensor parallel, teacher replicated, one micro-batch of two sequences:
#                 both ranks compute the teacher's targets of the micro-batch (profiled per rank)
#   s_tp2_shared  the same in two micro-batches of one sequence: each rank computes one
#                 micro-batch's targets and broadcasts them to the other (profiled per rank)
#   separate_pp2  the student on GPU 0, the teacher as a two-stage pipeline on GPUs 1 and 0 (three
#                 processes on two GPUs: a check of the path, not a speed)
#   long_one      one sequence of 32,768 tokens per micro-batch on one GPU (its error is the
#                 record where it does not fit); the teacher allows 65,536 positions; the
#                 Llama-3.2-1B-shaped student
#   long_cp2      the same, student and teacher context parallel over both GPUs
#   long3b_one    a Llama-3.2-3B-shaped student at 32,768 tokens on one GPU, nothing recomputed
#                 (more memory than an 80 GiB GPU holds: there its error is the record)
#   long3b_cp2    the same, context parallel over both GPUs (the student sharded over them)
#   long3b_ckpt14_one, long3b_ckpt14_cp2   the same two with half the student's blocks recomputed
source "$(dirname "$0")/step_common.sh"
one() {  # name, then bench step arguments: one process
    local name=$1; shift
    python3 -m crossdistill bench step "$@" | tail -1 > "$OUT/step-2gpu-$name-$stamp.json"
    echo "$name: $(head -c 300 "$OUT/step-2gpu-$name-$stamp.json")"
}
two() {  # name, then bench step arguments: torchrun over both GPUs
    local name=$1; shift
    python3 -m torch.distributed.run --nproc_per_node 2 -m crossdistill bench step "$@" \
        | tail -1 > "$OUT/step-2gpu-$name-$stamp.json"
    echo "$name: $(head -c 300 "$OUT/step-2gpu-$name-$stamp.json")"
}
T=(--set teachers.0.parallel.dp_shard=2)
stage fsdp && two fsdp "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 "${T[@]}" --one-gpu-reference
stage defaults && two defaults "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 --one-gpu-reference
K=(--set student.parallel.reshard_after_forward=false)
stage fsdp_keep && two fsdp_keep "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 "${K[@]}" \
    "${T[@]}" --one-gpu-reference
stage fsdp_keep_trep && two fsdp_keep_trep "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 "${K[@]}" \
    --set teachers.0.parallel.dp_replicate=2 --set teachers.0.parallel.dp_shard=1
stage alone && one alone "${S[@]}" "${C[@]}" --micro-batch 2
stage separate && two separate "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 \
    --teacher-placement separate
P=(--micro-batch 1 --grad-accum 8 --set student.parallel.pp=2 --one-gpu-reference)
stage pp2_alone && two pp2_alone "${S[@]}" "${C[@]}" "${P[@]}"
stage pp2 && two pp2 "${S[@]}" "${Q[@]}" "${C[@]}" "${P[@]}"
I=(--set student.parallel.pp_schedule=Interleaved1F1B --set student.parallel.pp_stages_per_rank=2)
stage pp2_interleaved && two pp2_interleaved "${S[@]}" "${Q[@]}" "${C[@]}" "${P[@]}" "${I[@]}"
stage tp2 && two tp2 "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 \
    --set student.parallel.tp=2 --set teachers.0.parallel.tp=2
stage cp2 && two cp2 "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 \
    --set student.parallel.cp=2 --set teachers.0.parallel.cp=2
stage s_fsdp_t_tp2 && two s_fsdp_t_tp2 "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 \
    --set teachers.0.parallel.tp=2
bench2() {  # name, then benchmarks/bench_step.py arguments (profiles): torchrun over both GPUs
    local name=$1; shift
    python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_step.py "$@" \
        | tail -1 > "$OUT/step-2gpu-$name-$stamp.json"
    echo "$name: $(head -c 300 "$OUT/step-2gpu-$name-$stamp.json")"
}
stage s_tp2 && bench2 s_tp2 "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 --profile \
    --set student.parallel.tp=2
stage s_tp2_shared && bench2 s_tp2_shared "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 1 \
    --grad-accum 2 --profile --set student.parallel.tp=2
if stage separate_pp2; then
    python3 -m torch.distributed.run --nproc_per_node 3 -m crossdistill bench step "${S[@]}" \
        "${Q[@]}" "${C[@]}" --micro-batch 2 --teacher-placement separate --teacher-ranks 2 \
        --set teachers.0.parallel.pp=2 | tail -1 > "$OUT/step-2gpu-separate_pp2-$stamp.json"
    echo "separate_pp2: $(head -c 300 "$OUT/step-2gpu-separate_pp2-$stamp.json")"
fi
L=(--seq-len 32768 --set teachers.0.overrides.max_position_embeddings=65536 --compile --steps 4 --warmup 2 --json --micro-batch 1)
long_pair() {  # name prefix, student preset, then extra arguments: one GPU (its error is the
    # record where it does not fit), then context parallel over both GPUs
    local name=$1 student=$2; shift 2
    local args=(--student "$student" --student-tokenizer "$TOK/llama3/hf" "${Q[@]}" "${L[@]}" "$@")
    if stage "${name}_one"; then
        python3 -m crossdistill bench step "${args[@]}" \
            > "$OUT/step-2gpu-${name}_one-$stamp.json" 2> "$OUT/step-2gpu-${name}_one-$stamp.err"
        echo "${name}_one: exit $?, $(tail -c 300 "$OUT/step-2gpu-${name}_one-$stamp.err")"
    fi
    stage "${name}_cp2" && two "${name}_cp2" "${args[@]}" \
        --set student.parallel.cp=2 --set teachers.0.parallel.cp=2
}
long_pair long llama-3.2-1b
long_pair long3b llama-3.2-3b
long_pair long3b_ckpt14 llama-3.2-3b --checkpoint-blocks 14
exit 0

#!/usr/bin/env bash
# The distillation step on four GPUs of one machine, the heterogeneous layouts against FSDP:
# `benchmarks/bench_step.py` (the bench's own command plus a profile of every rank) under
# torchrun, Qwen3-4B-shaped teacher -> Llama-3.2-1B-shaped student (random weights, real
# tokenizers), sequence 4096, compiled blocks.
# Usage (from the repository root, on a machine with four GPUs):
#   TOK=/path/to/tokenizers OUT=/path/to/results [ONLY="fsdp4 hetero"] bash benchmarks/step_4gpu.sh
# TOK holds llama3/hf and qwen3/hf. Records: $OUT/step-4gpu-<layout>-<date>.json, one per layout,
# written as each finishes; `profile_per_rank` holds each rank's time by kernel kind and by phase
# of the step (teachers, their input exchange, counts, student forward / loss / backward,
# optimizer; on the GPU: kernel time, communication, compute and idle inside each phase).
# Layouts (all by default, in this order):
#   fsdp4           the defaults: student FSDP over the four GPUs, teacher replicated; with the
#                   one-GPU run of the same command first
#   hsdp            the student in HSDP (2 replicas of FSDP over 2 GPUs), teacher replicated
#   hetero          student TP2 x DP2 (FSDP), teacher TP2 x CP2 (each teacher rank pair reads
#                   both data ranks' sequences)
#   s_tp2dp2        the same student, the teacher replicated: the student's layout alone
#   s_tp2dp2_shared the same as s_tp2dp2 in two micro-batches of one sequence per step: the
#                   tensor-parallel pair computes the replicated teacher's targets once (each
#                   rank one micro-batch, broadcast to the other)
#   t_tp2cp2        student FSDP over four, the teacher TP2 x CP2: the teacher's layout alone
#   pp2dp2          the student in two pipeline stages, each FSDP over two GPUs, 8 micro-batches
#   pp2tp2          two pipeline stages, each tensor parallel over two GPUs
#   separate        the student on GPU 0, the teacher on GPU 1
#   separate_pp2    the student on GPU 0, the teacher as a two-stage pipeline on GPUs 1 and 2
source "$(dirname "$0")/step_common.sh"
procs() {  # processes, name, then the program and its arguments: torchrun over that many GPUs
    local n=$1 name=$2; shift 2
    python3 -m torch.distributed.run --nproc_per_node "$n" "$@" \
        | tail -1 > "$OUT/step-4gpu-$name-$stamp.json"
    echo "$name: $(head -c 300 "$OUT/step-4gpu-$name-$stamp.json")"
}
four() { local name=$1; shift; procs 4 "$name" benchmarks/bench_step.py "$@"; }
# separate teachers: the package's command (it splits the job into the student's and the
# teacher's processes)
separate() { local n=$1 name=$2; shift 2; procs "$n" "$name" -m crossdistill bench step "$@"; }
ST=(--set student.parallel.tp=2)
TT=(--set teachers.0.parallel.tp=2 --set teachers.0.parallel.cp=2)
stage fsdp4 && four fsdp4 "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 --profile \
    --one-gpu-reference
stage hsdp && four hsdp "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 \
    --set student.parallel.dp_replicate=2 --set student.parallel.dp_shard=2
stage hetero && four hetero "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 --profile \
    "${ST[@]}" "${TT[@]}"
stage s_tp2dp2 && four s_tp2dp2 "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 --profile \
    "${ST[@]}"
stage s_tp2dp2_shared && four s_tp2dp2_shared "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 1 \
    --grad-accum 2 --profile "${ST[@]}"
stage t_tp2cp2 && four t_tp2cp2 "${S[@]}" "${Q[@]}" "${C[@]}" --micro-batch 2 --profile \
    "${TT[@]}"
P=(--micro-batch 1 --grad-accum 8 --set student.parallel.pp=2)
stage pp2dp2 && four pp2dp2 "${S[@]}" "${Q[@]}" "${C[@]}" "${P[@]}"
stage pp2tp2 && four pp2tp2 "${S[@]}" "${Q[@]}" "${C[@]}" "${P[@]}" "${ST[@]}"
SEP=(--micro-batch 2 --teacher-placement separate)
stage separate && separate 2 separate "${S[@]}" "${Q[@]}" "${C[@]}" "${SEP[@]}"
stage separate_pp2 && separate 3 separate_pp2 "${S[@]}" "${Q[@]}" "${C[@]}" "${SEP[@]}" \
    --teacher-ranks 2 --set teachers.0.parallel.pp=2
exit 0

"""The default data parallelism of a teacher: a frozen model whose weights take at most a quarter
of a GPU is replicated on every data rank (no parameter gathers in its forwards), a larger one,
or any off the GPU, sharded; degrees a config sets are kept."""

from __future__ import annotations

from crossdistill.config import ParallelConfig as P
from crossdistill.distributed.setup import teacher_parallel
from crossdistill.models.loading import resolve_hf_config, weight_bytes

GIB = 2**30


def test_weights_are_counted_without_memory():
    hf = resolve_hf_config(None, "qwen3-4b", {})
    assert 7.4 * GIB < weight_bytes(hf, "bfloat16") < 7.6 * GIB  # 4.02 B parameters
    assert weight_bytes(hf, "float32") == 2 * weight_bytes(hf, "bf16")


def test_a_teacher_that_fits_is_replicated():
    hf = resolve_hf_config(None, "qwen3-4b", {})  # 7.5 GiB in bf16
    assert teacher_parallel(P(), 2, hf, "bfloat16", 80 * GIB) == P(dp_replicate=2, dp_shard=1)
    assert teacher_parallel(P(), 8, hf, "bfloat16", 80 * GIB) == P(dp_replicate=8, dp_shard=1)
    # tensor parallel inside each replica
    assert teacher_parallel(P(tp=2), 4, hf, "bf16", 80 * GIB) == P(tp=2, dp_replicate=2, dp_shard=1)


def test_a_teacher_too_big_or_off_the_gpu_is_sharded():
    hf = resolve_hf_config(None, "qwen3-4b", {})
    assert teacher_parallel(P(), 2, hf, "bfloat16", 24 * GIB) == P()  # 7.5 > 6 GiB
    assert teacher_parallel(P(), 2, hf, "float32", 40 * GIB) == P()  # 15 > 10 GiB
    assert teacher_parallel(P(), 2, hf, "bfloat16", None) == P()  # CPU: as configured


def test_set_degrees_are_kept():
    hf = resolve_hf_config(None, "qwen3-4b", {})
    for set_ in (P(dp_shard=2), P(dp_replicate=2, dp_shard=1), P(tp=2), P(cp=2)):
        assert teacher_parallel(set_, 2, hf, "bfloat16", 80 * GIB) == set_
    assert teacher_parallel(P(), 1, hf, "bfloat16", 80 * GIB) == P()  # one rank: nothing to do

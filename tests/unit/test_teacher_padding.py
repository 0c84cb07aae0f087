"""A cross teacher's body on its non-pad tokens alone (`[1, N]`, the padding of every row
dropped) gives the targets of the padded `[B, T_t]` rows: same top-k ids, same log-probs in
float64, on real tokenizers, the real collator and tiny real architectures. The choice is the
placement's `teacher_padding` (`train.teacher_padding` of the config)."""

from __future__ import annotations

import argparse

import pytest
import torch

from crossdistill.bench.step_setup import build_bench
from crossdistill.distributed.runtime import Placement


def _args(tokenizer_dir, teachers, **kw):
    base = dict(
        student="llama-3.2-1b", student_tokenizer=str(tokenizer_dir("llama3")),
        teacher=[arch for arch, _ in teachers],
        teacher_tokenizer=[str(tokenizer_dir(tok)) for _, tok in teachers],
        seq_len=96, micro_batch=3, grad_accum=1, warmup=0, steps=2, top_k=8,
        loss="forward_kl", loss_chunk_size=64, checkpoint_blocks=0, checkpoint_scope="block",
        compile=False, tiny=True, device="cpu", attention="auto", teacher_padding="auto",
        loss_kernels="auto",
    )  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def _placed(bench, mode: str) -> Placement:
    p = bench.c.placement
    return Placement(p.env, p.student, p.teachers, teacher_padding=mode)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_targets_without_padding_equal_the_padded_rows(tokenizer_dir, temperature):
    bench = build_bench(_args(tokenizer_dir, [("qwen3-4b", "qwen3"), ("phi-4-mini", "phi-4-mini")]))
    for slot in bench.c.slots:
        slot.teacher.model.double()
    places = {mode: _placed(bench, mode) for mode in ("keep", "drop")}
    padded_somewhere = False
    for _ in range(2):
        batch = next(bench.loader)
        for k, (slot, tb) in enumerate(zip(bench.c.slots, batch.teachers)):
            slot.cfg.temperature = temperature
            padded_somewhere |= tb.real_index.numel() < tb.input_ids.numel()
            got = {}
            for mode, place in places.items():
                assert (place._real_rows(slot, tb) is None) == (mode == "keep")
                got[mode] = place.teacher_targets(slot, k, tb, 64)
            want, have = got["keep"], got["drop"]
            kd = tb.kd_valid  # other rows are filler the loss masks out (either way finite)
            assert torch.equal(want.topk_ids[kd], have.topk_ids[kd])
            assert torch.equal(want.next_valid, have.next_valid)
            for name in ("topk_logprobs", "tail_logprob", "next_logprobs"):
                a, b = getattr(want, name), getattr(have, name)
                assert b.isfinite().all() or name == "tail_logprob", name
                assert not b.isnan().any(), name
                if name != "next_logprobs":
                    a, b = a[kd], b[kd]
                torch.testing.assert_close(b, a, rtol=0, atol=1e-10, msg=name)
    assert padded_somewhere  # the case the path exists for was exercised


def test_auto_keeps_the_padded_rows_off_flash(tokenizer_dir):
    """On the CPU (no flash kernel) `auto` keeps `[B, T_t]`: the masked fallback over one row of
    N tokens would cost N² instead of B·T_t²."""
    bench = build_bench(_args(tokenizer_dir, [("qwen3-4b", "qwen3")]))
    batch = next(bench.loader)
    assert bench.c.placement.teacher_padding == "auto"
    assert bench.c.placement._real_rows(bench.c.slots[0], batch.teachers[0]) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_drops_the_padding_and_agrees_in_bf16(tokenizer_dir):
    """On CUDA `auto` runs the bf16 teacher on its non-pad tokens (flash covers every layer);
    its targets agree with the padded rows' to bf16 rounding."""
    args = _args(
        tokenizer_dir, [("phi-4-mini", "phi-4-mini")], seq_len=512, micro_batch=4, top_k=16,
        loss_chunk_size=512, device="cuda",
    )  # fmt: skip
    bench = build_bench(args)
    slot, tb = bench.c.slots[0], next(bench.loader).teachers[0]
    got = {}
    for mode in ("keep", "auto"):
        place = _placed(bench, mode)
        assert (place._real_rows(slot, tb) is None) == (mode == "keep")
        got[mode] = place.teacher_targets(slot, 0, tb, 512)
    kd = tb.kd_valid.cuda()
    want, have = got["keep"], got["auto"]
    for name in ("topk_logprobs", "tail_logprob"):
        a, b = getattr(want, name)[kd].float(), getattr(have, name)[kd].float()
        assert b.isfinite().all(), name
        torch.testing.assert_close(
            b.sort(-1).values if b.dim() > 1 else b,
            a.sort(-1).values if a.dim() > 1 else a,
            rtol=0,
            atol=0.05,
        )
    same = (want.topk_ids[kd, 0] == have.topk_ids[kd, 0]).float().mean()
    assert same > 0.98, same

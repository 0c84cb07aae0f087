"""A cross teacher's body on its non-pad tokens alone (`[1, N]`, the padding of every row
dropped) gives the targets of the padded `[B, T_t]` rows: same top-k ids, same log-probs in
float64, on real tokenizers, the real collator and tiny real architectures."""

from __future__ import annotations

import argparse

import pytest
import torch

from crossdistill.bench.step_setup import build_bench
from crossdistill.train import step as train_step


def _bench(tokenizer_dir, teachers):
    args = argparse.Namespace(
        student="llama-3.2-1b", student_tokenizer=str(tokenizer_dir("llama3")),
        teacher=[arch for arch, _ in teachers],
        teacher_tokenizer=[str(tokenizer_dir(tok)) for _, tok in teachers],
        seq_len=96, micro_batch=3, grad_accum=1, warmup=0, steps=2, top_k=8,
        loss="forward_kl", loss_chunk_size=64, checkpoint_blocks=0, checkpoint_scope="block",
        compile=False, tiny=True, device="cpu",
    )  # fmt: skip
    bench = build_bench(args)
    for slot in bench.slots:
        slot.teacher.model.double()
    return bench


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_targets_without_padding_equal_the_padded_rows(tokenizer_dir, temperature, monkeypatch):
    bench = _bench(tokenizer_dir, [("qwen3-4b", "qwen3"), ("phi-4-mini", "phi-4-mini")])
    dev = torch.device("cpu")
    padded_somewhere = False
    for _ in range(2):
        batch = next(bench.loader)
        for slot, tb in zip(bench.slots, batch.teachers):
            slot.cfg.temperature = temperature
            padded_somewhere |= tb.real_index.numel() < tb.input_ids.numel()
            got = {}
            for mode in ("off", "on"):
                monkeypatch.setitem(train_step.DROP_TEACHER_PADDING, "mode", mode)
                hidden, rows = train_step.teacher_hidden(slot, tb, dev)
                assert (rows is None) == (mode == "off")
                assert hidden.shape[0] == (tb.input_ids.numel() if rows is None else rows.numel())
                got[mode] = train_step.targets_from_hidden(slot, tb, hidden, rows, 64, dev)
            want, have = got["off"], got["on"]
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
    bench = _bench(tokenizer_dir, [("qwen3-4b", "qwen3")])
    batch = next(bench.loader)
    assert train_step.DROP_TEACHER_PADDING["mode"] == "auto"
    hidden, rows = train_step.teacher_hidden(bench.slots[0], batch.teachers[0], bench.device)
    assert rows is None and hidden.shape[0] == batch.teachers[0].input_ids.numel()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_drops_the_padding_and_agrees_in_bf16(tokenizer_dir, monkeypatch):
    """On CUDA `auto` runs the bf16 teacher on its non-pad tokens (flash covers every layer);
    its targets agree with the padded rows' to bf16 rounding."""
    args = argparse.Namespace(
        student="llama-3.2-1b", student_tokenizer=str(tokenizer_dir("llama3")),
        teacher=["phi-4-mini"], teacher_tokenizer=[str(tokenizer_dir("phi-4-mini"))],
        seq_len=512, micro_batch=4, grad_accum=1, warmup=0, steps=2, top_k=16,
        loss="forward_kl", loss_chunk_size=512, checkpoint_blocks=0, checkpoint_scope="block",
        compile=False, tiny=True, device="cuda",
    )  # fmt: skip
    bench = build_bench(args)
    slot, tb = bench.slots[0], next(bench.loader).teachers[0]
    got = {}
    for mode in ("off", "auto"):
        monkeypatch.setitem(train_step.DROP_TEACHER_PADDING, "mode", mode)
        hidden, rows = train_step.teacher_hidden(slot, tb, bench.device)
        assert (rows is None) == (mode == "off")
        got[mode] = train_step.targets_from_hidden(slot, tb, hidden, rows, 512, bench.device)
    kd = tb.kd_valid.cuda()
    want, have = got["off"], got["auto"]
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

"""Layout rules, TP row orders and context-parallel sharding: one process, no process group."""

from __future__ import annotations

import pytest
import torch

from crossdistill.config import ParallelConfig
from crossdistill.distributed import cp
from crossdistill.distributed.layout import ParallelLayout
from crossdistill.distributed.tp_plans import family_plan, fused_row_order
from crossdistill.distributed.vocab import vocab_range
from crossdistill.errors import UserError
from crossdistill.models.loading import resolve_hf_config


def test_dp_shard_takes_what_the_other_degrees_leave():
    lay = ParallelLayout.from_config(ParallelConfig(tp=2, cp=2), 8)
    assert (lay.dp_replicate, lay.dp_shard, lay.cp, lay.tp) == (1, 2, 2, 2)
    assert lay.dp == 2 and lay.world_size == 8
    lay = ParallelLayout.from_config(ParallelConfig(dp_replicate=2, dp_shard=2), 4)
    assert lay.dp == 4


@pytest.mark.parametrize(
    ("cfg", "world", "rule"),
    [
        (ParallelConfig(tp=3), 8, "does not divide the world size 8"),
        (ParallelConfig(dp_shard=2, tp=2), 8, "must equal the world size"),
        (ParallelConfig(tp=0), 2, "tp must be >= 1"),
        (ParallelConfig(dp_shard=0), 2, "dp_shard must be >= 1 or -1"),
    ],
)
def test_degrees_that_do_not_fit_the_world_are_refused(cfg, world, rule):
    with pytest.raises(UserError, match=rule):
        ParallelLayout.from_config(cfg, world, "teachers.0")


@pytest.mark.parametrize(
    ("cfg", "rule"),
    [
        (
            ParallelConfig(pp=2, pp_schedule="Interleaved1F1B"),
            "pp_schedule = Interleaved1F1B runs several stages on each pipeline rank, but "
            "pp_stages_per_rank = 1",
        ),
        (
            ParallelConfig(pp=2, pp_schedule="GPipe", pp_stages_per_rank=2),
            "pp_stages_per_rank = 2 with pp_schedule = GPipe, which runs one stage per rank",
        ),
        (
            ParallelConfig(pp=1, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2),
            "pp_stages_per_rank = 2 with pp = 1",
        ),
        (ParallelConfig(pp=2, pp_stages_per_rank=0), "pp_stages_per_rank must be >= 1"),
    ],
)
def test_stages_per_rank_must_fit_the_schedule(cfg, rule):
    with pytest.raises(UserError, match=rule):
        ParallelLayout.from_config(cfg, 2)


def test_every_pipeline_stage_needs_a_block():
    """Each of pp x pp_stages_per_rank stages holds a block at least."""
    interleaved = ParallelConfig(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=2)
    lay = ParallelLayout.from_config(interleaved, 4)
    assert (lay.pp, lay.stages_per_rank, lay.stages, lay.dp_shard) == (2, 2, 4, 2)
    assert "pp=2 pp_stages_per_rank=2 " in lay.describe()
    lay.check_model(resolve_hf_config(arch="tiny-llama", overrides={"num_hidden_layers": 4}))
    message = r"pp x pp_stages_per_rank = 2 x 2 = 4 is larger than the model's 2 blocks"
    with pytest.raises(UserError, match=message):
        lay.check_model(resolve_hf_config(arch="tiny-llama"))  # 2 blocks


def test_schedules_need_enough_micro_batches():
    """Every schedule needs a micro-batch per pipeline rank; the interleaved one runs them in
    grad_accum // pp rounds of equal size, so past 2·pp it needs a count those rounds divide."""
    from crossdistill.distributed.pipeline import check_micro_batches

    for schedule in ("1F1B", "GPipe", "Interleaved1F1B"):
        with pytest.raises(UserError, match="need at least 4 micro-batches"):
            check_micro_batches(3, 4, schedule)
    for n in (4, 5, 7, 8, 10, 12):
        check_micro_batches(n, 4, "Interleaved1F1B")
    for n in (9, 11, 13):
        check_micro_batches(n, 4, "1F1B")
        nearest = f"choose train.grad_accum a multiple of pp, e.g. {n // 4 * 4} or"
        with pytest.raises(UserError, match=nearest):
            check_micro_batches(n, 4, "Interleaved1F1B")


def test_heads_must_split_over_tp():
    hf = resolve_hf_config(arch="tiny-llama")  # 4 heads, 2 key/value heads
    ParallelLayout(tp=2).check_model(hf)
    with pytest.raises(UserError, match="does not divide the model's 2 key/value heads"):
        ParallelLayout(tp=4).check_model(hf)
    with pytest.raises(UserError, match="does not divide the model's 4 attention heads"):
        ParallelLayout(tp=3).check_model(resolve_hf_config(arch="tiny-phi3"))


def test_sequence_must_split_into_two_pieces_per_cp_rank():
    ParallelLayout(cp=2).check_sequence(64, "data.seq_len")
    with pytest.raises(UserError, match=r"data.seq_len = 60 is not divisible by 2 x cp = 8"):
        ParallelLayout(cp=4).check_sequence(60, "data.seq_len")


def test_every_supported_family_has_a_plan_and_others_are_refused():
    for arch in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-phi3", "tiny-mistral"):
        assert family_plan(resolve_hf_config(arch=arch)).layer
    with pytest.raises(UserError, match="no plan for model type 'gpt2'"):
        family_plan(type("C", (), {"model_type": "gpt2"})())


def test_fused_row_order_gives_each_rank_its_slice_of_every_block():
    order = fused_row_order([4, 2, 2], tp=2)  # q: rows 0-3, k: 4-5, v: 6-7
    assert order.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert fused_row_order([4, 2, 2], tp=1).tolist() == list(range(8))
    with pytest.raises(UserError, match="does not split over tp=4"):
        fused_row_order([4, 2, 2], tp=4)


def test_vocab_range_matches_torch_chunk():
    for total, parts in ((10, 3), (512, 2), (7, 4), (50304, 8)):
        pieces = torch.arange(total).chunk(parts)
        for i in range(parts):
            start, size = vocab_range(total, parts, i)
            got = torch.arange(start, start + size)
            want = pieces[i] if i < len(pieces) else torch.arange(0)
            assert torch.equal(got, want)


def test_load_balanced_pieces_cover_the_sequence_once_and_balance_causal_work():
    length, size = 24, 3
    seen = torch.cat([cp.load_balanced_index(length, size, r) for r in range(size)])
    assert sorted(seen.tolist()) == list(range(length))
    assert torch.equal(cp.gathered_order(length, size), seen)
    # causal work of a row is its position + 1: every rank gets the same total
    work = [int((cp.load_balanced_index(length, size, r) + 1).sum()) for r in range(size)]
    assert len(set(work)) == 1
    assert cp.load_balanced_index(8, 2, 0).tolist() == [0, 1, 6, 7]


def test_next_token_shift_needs_no_exchange_across_shard_edges():
    """Labels are shifted before sharding: the label of a piece's last position is the first
    token of the next piece, whichever rank holds it."""
    ids = torch.arange(100, 116).unsqueeze(0)  # one sequence of 16 tokens
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    for rank in range(2):
        idx = cp.load_balanced_index(16, 2, rank)
        local_ids, local_labels = cp.shard_rows(ids, 2, rank), cp.shard_rows(labels, 2, rank)
        for j, pos in enumerate(idx.tolist()):
            want = ids[0, pos + 1] if pos + 1 < 16 else -100
            assert int(local_labels[0, j]) == int(want)
            assert int(local_ids[0, j]) == 100 + pos
    rows = torch.cat([cp.global_rows(2, 16, 2, r) for r in range(2)])
    assert sorted(rows.tolist()) == list(range(32))


def test_cp_mask_is_the_packed_causal_mask_of_the_models():
    """The mask each rank attends with, put back in sequence order, is exactly the
    block-diagonal causal mask the Hugging Face models build from packed position ids."""
    from transformers.masking_utils import find_packed_sequence_indices

    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 0, 0]])  # 3 docs + padding
    doc = cp.document_ids(pos)
    packed = find_packed_sequence_indices(pos)
    assert packed is None or torch.equal(doc - doc[:, :1], packed - packed[:, :1])
    length = pos.shape[1]
    full = (doc[0, :, None] == doc[0, None, :]) & torch.ones(length, length).tril().bool()
    order = cp.gathered_order(length, 2)
    for rank in range(2):
        q = cp.load_balanced_index(length, 2, rank)
        mask = cp.cp_mask(pos, 2, rank)[0, 0]  # [T/2, T] keys in gathered order
        back = torch.zeros(len(q), length, dtype=torch.bool)
        back[:, order] = mask
        assert torch.equal(back, full[q])
        assert bool(mask.any(1).all())  # no query row without a key (SDPA would give NaN)


def test_context_parallel_refuses_a_window_shorter_than_the_rows():
    """CP attends over whole documents: a sliding-window model whose window is shorter than
    its rows is refused with the numbers; a long enough window, a window turned off (Qwen3) or
    no cp pass."""
    mistral = resolve_hf_config(arch="tiny-mistral", overrides={"sliding_window": 64})
    with pytest.raises(UserError, match=r"sliding window of 64 tokens, shorter than its rows"):
        ParallelLayout(cp=2).check_window(mistral, 128, "data.seq_len")
    ParallelLayout(cp=2).check_window(mistral, 64, "data.seq_len")
    ParallelLayout(cp=1).check_window(mistral, 128, "data.seq_len")
    qwen = resolve_hf_config(arch="tiny-qwen3", overrides={"sliding_window": 64})
    assert qwen.use_sliding_window is False
    ParallelLayout(cp=2).check_window(qwen, 128, "data.seq_len")

"""`teachers.N.kd_chunks`: which aligned chunks get a KD term, checked on real aligned batches
(Llama-3 student; Llama-2 teacher, which cuts troff requests such as `.PP` as `.` + `PP` where
Llama-3 writes `.P` + `P`, and a teacher with the student's own tokenizer), from the config down
to the term the loss reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from crossdistill.config import Config, TeacherConfig, from_dict
from crossdistill.data import build_loader
from crossdistill.distributed.runtime import kd_chunk_mask, make_term
from crossdistill.errors import UserError
from crossdistill.losses.plan import kd_count
from crossdistill.models import load_tokenizer

TEXTS = [
    ".TH LS 1\n.SH NAME\nls \\- list directory contents\n.PP\nList information.\n.TP\n.B \\-a\n",
    ".RS\nDo not ignore entries starting with a dot.\n.RE\n.PP\nExit status 2.\n",
    "The quick brown fox, 1999 — naïve café.\n\n\n    indented line here\n",
    "sub add { my ($a, $b) = @_; return $a + $b; }  # 42 apples, 3.14159\n",
] * 3


@pytest.fixture(scope="module")
def batches(tmp_path_factory, tokenizer_dir):
    corpus = tmp_path_factory.mktemp("kdchunks") / "val.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    cfg = from_dict(
        Config,
        {
            "student": {"arch": "tiny-llama", "tokenizer": str(tokenizer_dir("llama3"))},
            "data": {"train": [str(corpus)], "validation": [str(corpus)], "seq_len": 64,
                     "micro_batch_size": 2},
        },
    )  # fmt: skip
    tok_s = load_tokenizer(str(tokenizer_dir("llama3")))
    toks_t = [load_tokenizer(str(tokenizer_dir("llama2"))), tok_s]
    loader = build_loader(cfg.data, tok_s, toks_t, split="validation", pin_memory=False)
    return [batch for batch, _ in loader.stream_batches()]


def _term(kd_chunks: str, tb):
    """The term of a first-piece teacher (a run resolves `target: auto` before any term)."""
    cfg = TeacherConfig(path="t", kd_chunks=kd_chunks, target="first_piece")
    slot = SimpleNamespace(cfg=cfg, projection=SimpleNamespace(boundaries=None, groups=None))
    return make_term(slot, tb, targets=None, device=torch.device("cpu"), ids_s=tb.input_ids)


def test_single_side_drops_exactly_the_chunks_of_several_tokens_on_both_sides(batches):
    dropped = kept = 0
    for b in batches:
        cross, same = b.teachers
        labels = b.student.labels.flatten()
        c = cross.chunks.numpy()
        several = (c[:, 1] - c[:, 0] > 1) & (c[:, 3] - c[:, 2] > 1)
        valid = cross.kd_valid.numpy()
        every, single = _term("all", cross), _term("single_side", cross)
        assert np.array_equal(every.chunk_mask.numpy(), valid)
        assert np.array_equal(single.chunk_mask.numpy(), valid & ~several)
        assert int(kd_count(single, labels)) == int(kd_count(every, labels)) - int(
            (valid & several).sum()
        )
        dropped += int((valid & several).sum())
        kept += int(single.chunk_mask.sum())
        # with the student's own tokenizer every chunk is one token on each side: unchanged
        assert same.same_as_student
        assert torch.equal(_term("single_side", same).chunk_mask, same.kd_valid)
    assert dropped > 0 and kept > 10 * dropped  # the text has such chunks, and few


def test_kd_chunks_is_checked_at_load():
    mask = kd_chunk_mask("all", torch.tensor([True, False]), torch.tensor([[0, 2, 0, 2]] * 2))
    assert mask.tolist() == [True, False]
    with pytest.raises(UserError, match=r"'one_side' is not one of .*'single_side'"):
        from_dict(TeacherConfig, {"path": "t", "kd_chunks": "one_side"})

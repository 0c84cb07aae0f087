"""The targets' kinds (`losses.target_kinds`): one entry per target the config accepts, fields
that agree with each other, and terms built from them that carry the right name.

- every `teachers.N.target` but `auto` has a kind, and nothing else has one; `auto` and an
  unknown name are refused with the list of targets;
- the kinds' fields are consistent (a target past the end reads ahead, a split has groups, …);
- how many rows a teacher's targets hold, and whether they read past the end, for every target
  and both kinds of teacher;
- the KD term the trainer builds for each target (`distributed.runtime.make_term`, on a toy
  pair's projection) names that target, so the kinds and the term's fields describe the same
  thing.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from crossdistill.config import TARGETS, TeacherConfig
from crossdistill.distributed.runtime import make_term
from crossdistill.errors import UserError
from crossdistill.losses import (
    LOOKAHEAD_DEPTH,
    TARGET_KINDS,
    PrefixGroups,
    TeacherTargets,
    reads_past_end,
    target_depth,
    target_kind,
)
from tests.unit.test_lookahead_prefix import first_teacher_pieces, toy_groups
from tests.unit.test_lookahead_target import Toy


def test_every_configurable_target_has_a_kind_and_nothing_else():
    assert set(TARGET_KINDS) == set(TARGETS) - {"auto"}


def test_auto_and_unknown_names_are_refused_with_the_choices():
    with pytest.raises(UserError, match="auto is resolved at load") as err:
        target_kind("auto")
    assert "lookahead_split" in str(err.value)
    with pytest.raises(UserError, match="unknown target 'lookahead_spilt'.*first_piece"):
        target_kind("lookahead_spilt")


@pytest.mark.parametrize("name", sorted(TARGET_KINDS))
def test_the_fields_agree_with_each_other(name):
    kind = target_kind(name)
    if kind.past_end or kind.longer_only or kind.mix or kind.split:
        assert kind.lookahead, "only a lookahead target follows the path to the token's end"
    if kind.longer_only or kind.mix or kind.split:
        assert kind.groups and kind.past_end
    if kind.context:
        assert not (kind.lookahead or kind.groups)
    assert sum((kind.longer_only, kind.mix, kind.split)) <= 1


@pytest.mark.parametrize("name", sorted(TARGET_KINDS))
def test_rows_per_chunk_and_past_the_end(name):
    kind = target_kind(name)
    assert target_depth(name, same_as_student=True) == 1
    assert not reads_past_end(name, same_as_student=True)
    assert target_depth(name, same_as_student=False) == (LOOKAHEAD_DEPTH if kind.lookahead else 1)
    assert reads_past_end(name, same_as_student=False) == kind.past_end


def _projection_for(toy: Toy, name: str):
    """The toy pair's projection as `train.build.build_projection_for` lays it out for `name`:
    prefix groups where the target has them, the split's groups at a share of one half."""
    proj = dataclasses.replace(toy.proj)
    kind = target_kind(name)
    if kind.split:
        share = torch.full((len(toy.teacher),), 0.5, dtype=torch.float64)
        proj.groups = PrefixGroups.split_from_first_pieces(
            first_teacher_pieces(toy), toy.proj.first_piece, toy.proj.exact, share
        )
    elif kind.groups:
        proj.groups = toy_groups(toy)
    return proj


@pytest.mark.parametrize("same_as_student", [False, True])
@pytest.mark.parametrize("name", sorted(TARGET_KINDS))
def test_the_term_built_for_a_target_names_it(name, same_as_student):
    toy = Toy(0)
    chunks = torch.tensor([[0, 1, 0, 2], [1, 2, 2, 3], [2, 4, 3, 5]])
    slot = SimpleNamespace(
        cfg=TeacherConfig(name="t", target=name), projection=_projection_for(toy, name)
    )
    tb = SimpleNamespace(
        chunks=chunks,
        input_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
        kd_valid=torch.ones(len(chunks), dtype=torch.bool),
        same_as_student=same_as_student,
    )
    depth = target_depth(name, same_as_student)
    rows = len(chunks) * depth
    targets = TeacherTargets(
        topk_ids=torch.zeros(rows, 2, dtype=torch.long),
        topk_logprobs=torch.full((rows, 2), -1.0),
        tail_logprob=torch.full((rows,), -1.0),
        next_logprobs=torch.zeros(6),
        next_valid=torch.ones(6, dtype=torch.bool),
        temperature=1.0,
        depth=depth,
    )
    term = make_term(slot, tb, targets, torch.device("cpu"), tb.input_ids)
    if not same_as_student:
        assert term.target == name
    else:  # a teacher with the student's tokenizer reads one row and needs no continuation
        assert term.lookahead is None and term.first_t is None
        assert term.target in ("first_piece", "prefix")

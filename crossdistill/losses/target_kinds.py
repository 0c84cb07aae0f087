"""What each projected target (`teachers.N.target`) reads and where it puts the teacher's mass.

One `TargetKind` per target name, in `TARGET_KINDS`: the trainer, the teacher cache, the teacher
streams and the checks at load ask `target_kind(name)` and read its fields, or ask
`target_depth` and `reads_past_end` for the teacher rows a target needs. A new target is one entry
here plus its math (`projection.py`, `lookahead.py`). The names themselves are the config's
(`config.TARGETS`); `auto` is not a kind: it is resolved to one of these at load
(`train.auto_target`). The targets are explained where their math is: `projection.py` (first
piece, context, prefix) and `lookahead.py` (the lookahead family)."""

from __future__ import annotations

from dataclasses import dataclass

from crossdistill.errors import UserError

# Teacher positions read per student token: the KD position and up to three more along the
# observed path; longer paths are rare even for a SentencePiece teacher under a byte-level BPE
# student (`benchmarks/target_bias.py`), and they split at the limit like the context target.
LOOKAHEAD_DEPTH = 4


@dataclass(frozen=True)
class TargetKind:
    """The properties of one target that the code outside its math acts on."""

    # the teacher's first token's mass that continues to the student's observed token goes to
    # that token (`projection.Continuation`)
    context: bool = False
    # reads the teacher's top-k at up to `LOOKAHEAD_DEPTH` positions along the observed path
    lookahead: bool = False
    # buckets of token groups (`PrefixGroups`): they sum the student's probabilities over its
    # whole vocabulary, so a vocabulary split over tensor-parallel ranks does not take them (the
    # fused pass does, with `group_kernels`)
    groups: bool = False
    # reads the teacher's row after each student token's end (`targets.target_rows`)
    past_end: bool = False
    # the groups and the row past the end apply only at chunks of one student token over several
    # teacher tokens
    longer_only: bool = False
    # two divergences at half weight each: without the groups and with them
    mix: bool = False
    # the groups leave out each teacher token's exact student token, which takes a share of the
    # token's mass counted on the training text (`PrefixGroups.short_logshare`)
    split: bool = False


TARGET_KINDS: dict[str, TargetKind] = {
    "first_piece": TargetKind(),
    "context": TargetKind(context=True),
    "prefix": TargetKind(groups=True),
    "lookahead": TargetKind(lookahead=True),
    "lookahead_end": TargetKind(lookahead=True, past_end=True),
    "lookahead_prefix": TargetKind(lookahead=True, groups=True),
    "lookahead_prefix_end": TargetKind(lookahead=True, groups=True, past_end=True),
    "lookahead_longer": TargetKind(lookahead=True, groups=True, past_end=True, longer_only=True),
    "lookahead_mix": TargetKind(lookahead=True, groups=True, past_end=True, mix=True),
    "lookahead_split": TargetKind(lookahead=True, groups=True, past_end=True, split=True),
}


def target_kind(name: str) -> TargetKind:
    """The kind of target `name`; a name that is not one (`auto` before it is resolved
    included) is an error that lists the targets."""
    try:
        return TARGET_KINDS[name]
    except KeyError:
        choices = ", ".join(TARGET_KINDS)
        hint = " (auto is resolved at load, by train.auto_target)" if name == "auto" else ""
        raise UserError(f"unknown target {name!r}{hint}; use one of {choices}") from None


def target_depth(target: str, same_as_student: bool) -> int:
    """Top-k rows per chunk a teacher's targets hold: `LOOKAHEAD_DEPTH` for a lookahead target
    of a teacher with its own tokenizer, else 1 (the KD position only)."""
    return LOOKAHEAD_DEPTH if target_kind(target).lookahead and not same_as_student else 1


def reads_past_end(target: str, same_as_student: bool) -> bool:
    """Whether a teacher's targets include the row after each chunk's end (`target_rows`):
    a target that reads past the end (`TargetKind.past_end`) of a teacher with its own
    tokenizer."""
    return target_kind(target).past_end and not same_as_student

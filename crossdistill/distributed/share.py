"""Teacher work shared among the ranks that read the same batch.

A student laid out with tensor or context parallelism has several ranks per data rank (its
`cp_tp` group), and all of them read the same micro-batches. A teacher that runs whole on each
of those ranks (replicated, or FSDP-sharded: anything but its own tensor or context
parallelism over them) would compute the same targets on every one of them. Here each rank
of the group computes the targets of its share of the window's micro-batches (micro-batch i
on group rank i mod size) and broadcasts them to the others, so the group does the teacher's
work once. A window that the group's size does not divide is computed whole on every rank (an
uneven split would leave ranks idle anyway, and collective teachers need every rank to call
them equally often).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from crossdistill.losses.payload import pack_targets, receive_like
from crossdistill.losses.targets import TeacherTargets


def share_window_targets(
    batches: list[list[Any]],
    shared: list[bool],
    compute: Callable[[int, int], TeacherTargets],
    group: Any,
    rank: int,
    size: int,
) -> list[list[TeacherTargets]]:
    """Every teacher's targets of every micro-batch, `[micro-batch][teacher]`, on every rank of
    `group` (`size` ranks that read the same `batches`; this one is `rank` in it).
    `batches[i][k]`: micro-batch i's batch of teacher k; `shared[k]`: teacher k runs whole on
    each rank of the group (its work is split); `compute(i, k)`: teacher k's targets of
    micro-batch i on this rank."""
    n, teachers = len(batches), len(shared)
    split = size > 1 and n % size == 0
    mine = [i for i in range(n) if not split or i % size == rank]
    out: list[list[Any]] = [[None] * teachers for _ in range(n)]
    for k in range(teachers):
        for i in mine if shared[k] else range(n):
            out[i][k] = compute(i, k)
    if not split:
        return out
    for k in (k for k in range(teachers) if shared[k]):
        like = out[mine[0]][k]  # this rank's own share gives K, the dtypes and the temperature
        for i in range(n):
            src = i % size
            if src == rank:
                dist.broadcast(pack_targets(out[i][k], "none"), group=group, group_src=src)
            else:
                out[i][k] = _broadcast_from(batches[i][k], like, group, src)
    return out


def _broadcast_from(tb: Any, like: TeacherTargets, group: Any, src: int) -> TeacherTargets:
    """Targets of teacher batch `tb` broadcast by group rank `src`, sized from this rank's own
    copy of the batch (no exchange of sizes)."""
    return receive_like(tb, like, lambda buf: dist.broadcast(buf, group=group, group_src=src))

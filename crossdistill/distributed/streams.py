"""Separate teachers: a `torchrun` job split into roles, and the targets streamed between them.

With `teachers.N.placement: separate`, the job's processes are cut into roles: the first go to
the student, then each separate teacher gets `teachers.N.ranks` of its own. Each role has its
own default process group (`init_process_group` over a prefix of the job's store), so the
student's layouts, collectives and checkpoints are those of a plain job of its size, and a
teacher's layout (`teachers.N.parallel`) spans its ranks only. One more group over the whole
job, the link, carries point-to-point traffic between roles: NCCL where every process has a
GPU of its own. Where processes share GPUs (NCCL refuses such a group), two processes on one GPU
exchange CUDA IPC handles instead (the receiver copies the sender's buffer on the GPU; probed
once at start, `train.teacher_link: host` turns it off), and any other pair stages its buffers
through host memory over gloo.

Who talks to whom. A teacher's data-parallel group j (its ranks that run one forward together)
serves the student's data ranks d with d mod dp_t = j: it reads the same global batches as they
do (its own loaders, the same config, the same order), computes each micro-batch's targets and
its group's first rank (in its last stage, for a teacher laid out as a pipeline:
`distributed/teacher_pipeline.py`) sends them to every student rank of data rank d that
computes the loss (tensor- and context-parallel ranks of one data rank each take a copy; a
pipeline-parallel student's last stage alone: the earlier stages neither wait for targets nor
receive any, `distributed/pipeline.py`). A teacher runs ahead of the student by at most
`train.teacher_prefetch` steps: before it computes step n it waits until the student has
received step n − prefetch.

Each payload (`losses.payload`) follows the batch's id (a sequence number, a checksum of the
teacher inputs the sender read, and the sizes), sent as a small host message over gloo; the
receiver compares it with its own copy of the batch before it takes the payload, so a student
never trains on another batch's targets and never receives a payload of the wrong size. A peer
that dies or stalls ends the job after `train.teacher_timeout_s` with one line naming it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from crossdistill.config import Config, Quantization
from crossdistill.distributed.layout import (
    DistEnv,
    ParallelLayout,
    init_distributed,
    job_size,
    wants_cuda,
)
from crossdistill.errors import UserError
from crossdistill.losses import TeacherTargets, target_depth
from crossdistill.losses.payload import (
    batch_id,
    pack_targets,
    payload_nbytes,
    payload_sizes,
    unpack_targets,
)

_POLL_S = 2e-4
_LINK_TIMEOUT = datetime.timedelta(hours=24)  # the streams enforce their own deadlines


def separate_ranks(cfg: Config, world_size: int) -> tuple[int, ...]:
    """The ranks of each separate teacher, in teacher order (empty when every teacher is
    colocated); refuses a split the job cannot make, naming the numbers."""
    sizes = tuple(t.ranks for t in cfg.teachers if t.placement == "separate")
    if not sizes:
        return ()
    names = [
        f"teachers.{i}.ranks = {t.ranks}"
        for i, t in enumerate(cfg.teachers)
        if t.placement == "separate"
    ]
    if world_size == 1:
        raise UserError(
            f"{', '.join(names)}: a separate teacher runs in processes of its own; start the "
            f"job with torchrun --nproc_per_node {1 + sum(sizes)} or more (the student takes "
            "the rest), or set teachers.N.placement=colocated"
        )
    if sum(sizes) >= world_size:
        raise UserError(
            f"{' + '.join(names)} take {sum(sizes)} of the job's {world_size} processes and "
            f"leave none for the student; start at least {sum(sizes) + 1} processes or lower "
            "teachers.N.ranks"
        )
    return sizes


def init_roles(device: str, separate: tuple[int, ...], ipc: bool = True) -> DistEnv:
    """`init_distributed`, for a job with separate teachers (`separate`: the ranks of each, in
    teacher order; empty: a plain job): this process's role, its role's process group and the
    job-wide link (see module doc). `ipc`: processes sharing a GPU may exchange CUDA IPC
    handles (`train.teacher_link`)."""
    if not separate:
        return init_distributed(device)
    if dist.is_available() and dist.is_initialized():
        raise UserError(
            "separate teachers split the job into roles when it starts; start the job with "
            "torchrun (no process group of the caller's)"
        )
    return _join_roles(job_size(), separate, wants_cuda(device), ipc)


def _join_roles(world: int, separate: tuple[int, ...], cuda: bool, ipc: bool) -> DistEnv:
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    sizes = (world - sum(separate), *separate)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    role = max(i for i, s in enumerate(starts) if s <= rank)
    role_rank = rank - starts[role]
    dev, staged = torch.device("cpu"), False
    if cuda:
        count = torch.cuda.device_count()
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        if local_world > count and max(sizes) > count:
            raise UserError(
                f"a role of {max(sizes)} processes needs as many GPUs, and this machine has "
                f"{count}; lower the student's or the teachers' ranks"
            )
        dev = torch.device("cuda", local % count)
        torch.cuda.set_device(dev)
        staged = local_world > count  # processes share GPUs: NCCL refuses such a group
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world))
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"crossdistill/role{role}", store),
        rank=role_rank,
        world_size=sizes[role],
        device_id=dev if cuda else None,
    )
    control = dist.ProcessGroupGloo(
        dist.PrefixStore("crossdistill/control", store), rank, world, _LINK_TIMEOUT
    )
    data: Any = control
    if cuda and not staged:
        data = dist.ProcessGroupNCCL(
            dist.PrefixStore("crossdistill/link", store),
            rank,
            world,
            dist.ProcessGroupNCCL.Options(),
        )
    peers = ipc_peers(control, rank, world, dev) if cuda and staged and ipc else frozenset()
    link = Link(control, data, dev, staged=cuda and staged, ipc=peers)
    return DistEnv(role_rank, sizes[role], local, dev, True, role, rank, sizes, link)


class Link:
    """Point-to-point transfers between the job's processes (global ranks): byte buffers on the
    `data` group (NCCL between GPUs of their own, else gloo), or as CUDA IPC handles on the
    control group to the peers in `ipc` (same GPU); small host messages (batch ids, the start
    step) on the gloo `control` group."""

    def __init__(
        self,
        control: Any,
        data: Any,
        device: torch.device,
        staged: bool,
        ipc: frozenset[int] = frozenset(),
    ):
        self.control = control
        self.data = data
        self.device = device
        self.staged = staged  # gloo between GPU processes: through host memory
        self.ipc = ipc  # global ranks on this process's GPU that open its memory (and it theirs)
        self._copies: Any = None  # the stream that copies IPC buffers (created on first use)

    def transport(self, peer: int) -> str:
        """How buffers travel between this process and `peer`, in words."""
        if peer in self.ipc:
            return "CUDA IPC (the same GPU)"
        if self.staged:
            return "gloo through host memory"
        return "gloo" if self.device.type == "cpu" else "NCCL"

    def _group(self, control: bool) -> Any:
        return self.control if control else self.data

    def _host(self, control: bool) -> bool:
        return control or self.staged or self.device.type == "cpu"

    def _work(self, work: Any, control: bool) -> Any:
        gloo = control or isinstance(self.data, dist.ProcessGroupGloo)
        return _GlooWork(work) if gloo else work

    def isend(self, buf: Tensor, dst: int, who: str, control: bool = False) -> tuple[Any, Tensor]:
        """Start sending `buf` to `dst`: (work, the buffer to keep alive until it completes)."""
        if not control and dst in self.ipc:
            # the handle, not the bytes; once the receiver opened it, PyTorch's cross-process
            # reference count keeps the memory alive until it lets go, whatever this side frees
            with _failure(who):
                return _GlooWork(self.control.send([ipc_handle(buf)], dst, 0)), buf
        if self._host(control):
            buf = buf.cpu()
        with _failure(who):
            return self._work(self._group(control).send([buf], dst, 0), control), buf

    def recv(
        self, nbytes: int, src: int, deadline: float, who: str, control: bool = False
    ) -> Tensor:
        """`nbytes` from `src`, waiting until `deadline` (time.monotonic); on the host for a
        control message, else on this process's device."""
        if not control and src in self.ipc:
            handle = self.recv(IPC_MESSAGE_BYTES, src, deadline, who, control=True)
            return self._open(handle, nbytes, who)
        host = self._host(control)
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cpu" if host else self.device)
        with _failure(who):
            work = self._work(self._group(control).recv([buf], src, 0), control)
        wait(work, deadline, who)
        return buf.to(self.device, non_blocking=True) if self.staged and not control else buf

    def _open(self, handle: Tensor, nbytes: int, who: str) -> Tensor:
        """A copy, on this process's GPU, of the buffer another process shared by `handle`."""
        if self._copies is None:
            self._copies = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._copies):
            shared = ipc_open(handle)  # the copy stream waits for the sender's writes
            if shared.numel() != nbytes:
                raise UserError(
                    f"{who}: the shared buffer holds {shared.numel()} bytes where {nbytes} were "
                    f"expected; {_HINT}"
                )
            out = shared.clone()
        # the sender may reuse its memory once `shared` is gone: the copy must have finished
        self._copies.synchronize()
        del shared
        out.record_stream(torch.cuda.current_stream(self.device))
        return out

    def abort(self) -> None:
        """Drop the link's pending transfers (a job that ends on an error must not hang)."""
        for group in {id(self.data): self.data, id(self.control): self.control}.values():
            with_abort = getattr(group, "abort", None)
            if callable(with_abort):
                with contextlib.suppress(Exception):  # best effort: the job ends anyway
                    with_abort()


# a pickled CUDA IPC handle (the tensor's shape, its memory, event and reference-counter
# handles) and its length; `ipc_handle` refuses a larger one
IPC_MESSAGE_BYTES = 1024


def ipc_handle(buf: Tensor) -> Tensor:
    """A host message another process on this GPU opens with `ipc_open` (the buffer's memory
    handle, its place in that memory and an event recorded after the current stream's writes)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    body = pickle.dumps(args)
    if len(body) + 8 > IPC_MESSAGE_BYTES:
        raise RuntimeError(f"a CUDA IPC handle of {len(body)} bytes does not fit its message")
    message = torch.zeros(IPC_MESSAGE_BYTES, dtype=torch.uint8)
    message[:8] = torch.tensor([len(body)], dtype=torch.int64).view(torch.uint8)
    message[8 : 8 + len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
    return message


def ipc_open(message: Tensor) -> Tensor:
    """The tensor of `ipc_handle`'s message, in the sender's memory (the current stream waits
    for the sender's writes); release it soon, the sender's memory stays held until then."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    size = int(message[:8].view(torch.int64)[0])
    return rebuild_cuda_tensor(*pickle.loads(message[8 : 8 + size].numpy().tobytes()))


def ipc_peers(control: Any, rank: int, world: int, device: torch.device) -> frozenset[int]:
    """The ranks on this process's GPU whose memory it can open and which can open its own,
    probed with a small buffer each (a container may forbid CUDA IPC: those pairs stay on host
    memory). Every process of the job calls this at once."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    probe = torch.full((1,), rank + 1, dtype=torch.int64, device=device)
    ident = torch.zeros(64, dtype=torch.uint8)
    ident[: len(uuid)] = torch.frombuffer(bytearray(uuid.encode()), dtype=torch.uint8)
    mine = torch.cat([ident, ipc_handle(probe)])
    every = [torch.empty_like(mine) for _ in range(world)]
    control.allgather([every], [mine]).wait()
    opened = torch.zeros(world, dtype=torch.uint8)
    for peer, message in enumerate(every):
        if peer == rank or not torch.equal(message[:64], ident):
            continue
        with contextlib.suppress(Exception):  # refused by the driver or the container
            shared = ipc_open(message[64:])
            opened[peer] = int(shared.item() == peer + 1)  # .item() waits for the copy
            del shared
    matrix = [torch.empty_like(opened) for _ in range(world)]
    control.allgather([matrix], [opened]).wait()  # also: every peer let go of `probe`
    return frozenset(p for p in range(world) if opened[p] and matrix[p][rank])


def wait(work: Any, deadline: float, who: str, gloo: bool = False) -> None:
    """Wait for `work` until `deadline`; a peer that died or stalls is one `UserError`. NCCL
    work is polled (its `wait` only orders streams); gloo work (`_GlooWork`, or any with `gloo`)
    completes inside its own `wait`, which takes the time left."""
    if isinstance(work, _GlooWork):
        work, gloo = work.work, True
    if gloo:
        left = max(deadline - time.monotonic(), 0.001)
    else:
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise UserError(f"{who}: nothing arrived before the deadline; {_HINT}")
            time.sleep(_POLL_S)
        left = None
    with _failure(who):
        if left is None:
            work.wait()  # the current stream waits for the transfer
        else:
            work.wait(datetime.timedelta(seconds=left))


@contextlib.contextmanager
def _failure(who: str):
    """A transport error (the peer's connection closed, a timeout) as one `UserError`."""
    try:
        yield
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "imed out" in first or "imeout" in first:
            raise UserError(f"{who}: nothing arrived before the deadline; {_HINT}") from None
        raise UserError(f"{who}: the transfer failed ({first[:200]}); {_HINT}") from None


class _GlooWork:
    """A gloo transfer (waited on with a timeout rather than polled)."""

    def __init__(self, work: Any):
        self.work = work


_HINT = (
    "the other side died or stalls: see its log (torchrun prints each rank's error); the wait "
    "is train.teacher_timeout_s"
)


def student_ranks_of(data_rank: int, student: ParallelLayout) -> list[int]:
    """Global ranks that take data rank `data_rank`'s targets (the student's role comes first):
    its tensor- and context-parallel ranks in the last pipeline stage, where the loss runs
    (`pp` is the mesh's outermost axis, so that stage's ranks are the role's last `world / pp`)."""
    width = student.cp * student.tp
    first = (student.pp - 1) * (student.world_size // student.pp) + data_rank * width
    return list(range(first, first + width))


def teacher_source(data_rank: int, teacher: ParallelLayout, start: int) -> int:
    """Global rank of the teacher process that sends data rank `data_rank`'s targets: the first
    of its data-parallel group's, in the last pipeline stage where the teacher is a pipeline
    (`distributed/teacher_pipeline.py`; `pp` is the outermost axis)."""
    width = teacher.cp * teacher.tp
    last_stage = (teacher.pp - 1) * (teacher.world_size // teacher.pp)
    return start + last_stage + (data_rank % teacher.dp) * width


@dataclass
class TargetStream:
    """The student's end of one separate teacher: targets of this rank's micro-batches, in
    the order the loop asks for them. `source`: the global rank that sends them; `top_k`: as
    the teacher computes it (at most its vocabulary)."""

    link: Link
    name: str
    source: int
    top_k: int
    quantization: Quantization
    temperature: float
    timeout_s: float
    target: str = "first_piece"  # the teacher's `target` (how many top-k rows per chunk)
    seq: int = 0
    wait_s: float = 0.0  # host time spent waiting for targets

    def receive(self, tb: Any) -> TeacherTargets:
        """Targets of teacher batch `tb` (this rank's next micro-batch)."""
        depth = target_depth(self.target, tb.same_as_student)
        m, n = payload_sizes(tb, depth)
        expected = batch_id(self.seq, tb.input_ids, tb.labels)
        who = f"teacher {self.name!r} (rank {self.source} of the job), batch {self.seq}"
        self.seq += 1
        start = time.monotonic()
        deadline = start + self.timeout_s
        got = self.link.recv(expected.numel() * 8, self.source, deadline, who, control=True)
        if not torch.equal(got.view(torch.int64), expected):
            raise UserError(
                f"{who}: the teacher sent the targets of another batch (id "
                f"{got.view(torch.int64).tolist()}, expected {expected.tolist()}); its processes "
                "and the student's must read the same config and data (nothing was trained on "
                "them)"
            )
        nbytes = payload_nbytes(m, self.top_k, n, self.quantization)
        buf = self.link.recv(nbytes, self.source, deadline, who)
        self.wait_s += time.monotonic() - start
        targets = unpack_targets(buf, m, self.top_k, n, self.quantization, self.temperature)
        targets.topk_ids = targets.topk_ids.long()
        targets.depth = depth
        return targets


class TargetSender:
    """A separate teacher's end: sends each micro-batch's targets to the student ranks of the
    data rank it belongs to, at most `depth` steps ahead of the student."""

    def __init__(
        self,
        link: Link,
        name: str,
        destinations: dict[int, list[int]],
        quantization: Quantization,
        depth: int,
        timeout_s: float,
    ):
        self.link = link
        self.name = name
        self.destinations = destinations  # data rank -> global student ranks
        self.quantization = quantization
        self.depth = depth
        self.timeout_s = timeout_s
        self.seq = dict.fromkeys(destinations, 0)
        self.steps: deque[list[tuple[Any, Tensor, str]]] = deque([[]])
        self.sent_bytes = 0

    def send(self, data_rank: int, tb: Any, targets: TeacherTargets) -> None:
        header = batch_id(self.seq[data_rank], tb.input_ids, tb.labels)
        buf = pack_targets(targets, self.quantization)
        for dst in self.destinations[data_rank]:
            who = f"student rank {dst} of the job, receiving teacher {self.name!r}'s targets"
            for message, control in ((header.view(torch.uint8), True), (buf, False)):
                work, kept = self.link.isend(message, dst, who, control)
                self.steps[-1].append((work, kept, who))
            self.sent_bytes += buf.numel()
        self.seq[data_rank] += 1

    def step_done(self) -> None:
        """Close this step's sends; wait while more than `depth` steps are unreceived."""
        self.steps.append([])
        while len(self.steps) > self.depth + 1:
            self._drain(self.steps.popleft())

    def flush(self) -> None:
        """Wait until the student has received everything sent."""
        while self.steps:
            self._drain(self.steps.popleft())
        self.steps.append([])

    def _drain(self, sends: list[tuple[Any, Tensor, str]]) -> None:
        deadline = time.monotonic() + self.timeout_s
        for work, _, who in sends:
            wait(work, deadline, who)


def announce_start(env: DistEnv, step: int, timeout_s: float) -> None:
    """The student's first rank tells every separate teacher's process the step it starts at
    (0, or the checkpoint's it resumed)."""
    if env.role != 0 or env.rank != 0 or env.link is None:
        return
    value = torch.tensor([step], dtype=torch.int64).view(torch.uint8)
    who = "a separate teacher's process, receiving the start step"
    teachers = range(env.role_sizes[0], sum(env.role_sizes))
    sends = [env.link.isend(value, dst, who, control=True) for dst in teachers]
    deadline = time.monotonic() + timeout_s
    for work, _ in sends:
        wait(work, deadline, who)


def await_start(env: DistEnv, timeout_s: float) -> int:
    """A separate teacher's process: the step the student starts at (see `announce_start`)."""
    who = "the student's first rank (start step)"
    buf = env.link.recv(8, 0, time.monotonic() + timeout_s, who, control=True)
    return int(buf.view(torch.int64)[0])

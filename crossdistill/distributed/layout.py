"""The parallel layout of one model over the ranks of a `torchrun` job, and process start-up.

A `ParallelLayout` holds the degrees (data-parallel replicate and shard, context, tensor),
checks them against the world size and the model, and builds ONE named `DeviceMesh` per layout:

    axes (outer -> inner): pp, dp_replicate, dp_shard, cp, tp
    flattened:             dp       = dp_replicate x dp_shard   (who reads which data)
                           fsdp     = dp_shard x cp             (who shards parameters)
                           loss     = dp_replicate x dp_shard x cp   (who holds a part of the loss)
                           cp_tp    = cp x tp                   (who runs one forward together)

`tp` is innermost so that a tensor-parallel group is a set of neighbouring ranks (one node);
`pp` (the student's pipeline, `distributed/pipeline.py`) is outermost, so each pipeline rank is
a plain layout of `world / pp` ranks and the ranks exchange only hidden states (under `cp`, each
rank its own rows of them). A pipeline rank holds `stages_per_rank` of its
`pp x stages_per_rank` stages (interleaved schedules).
The student and each teacher get their own layout over the same ranks; everything else asks the
layout (or its mesh) for ranks, sizes and process groups.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from crossdistill.config import ParallelConfig
from crossdistill.errors import UserError

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class DistEnv:
    """What `torchrun` told this process: its rank, the world size, and the device it drives.

    A job with separate teachers (`teachers.N.placement: separate`) is split into roles: the
    student's ranks, then each separate teacher's. `rank` and `world_size` are then this
    process's within its role (its default process group spans its role only, so every layout
    and collective of a role is the plain one), `role` is 0 for the student and i + 1 for the
    i-th separate teacher, `global_rank` its rank in the whole job, and `link` the job-wide
    point-to-point channel that carries targets between roles (`distributed.streams`)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # this call started the process group (and ends it)
    role: int = 0
    global_rank: int = 0
    role_sizes: tuple[int, ...] = ()  # ranks per role (student first); () without roles
    link: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0 and self.role == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def job_size(self) -> int:
        """Processes of the whole job, every role's."""
        return sum(self.role_sizes) if self.role_sizes else self.world_size

    def role_start(self, role: int) -> int:
        """The global rank of role `role`'s first process."""
        return sum(self.role_sizes[:role])


def wants_cuda(device: str) -> bool:
    """Whether `device` ("auto", "cpu", "cuda", "cuda:1") means a GPU; one asked for where none
    is visible is refused."""
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        raise UserError(
            f"train.device={device} but no CUDA device is visible; use train.device=cpu"
        )
    return cuda


def job_size() -> int:
    """The processes of this job: the caller's process group, or torchrun's `WORLD_SIZE`."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device: str = "auto") -> DistEnv:
    """Join the job `torchrun` started (env vars `RANK`, `WORLD_SIZE`, `LOCAL_RANK`): nccl on
    CUDA, gloo on CPU; the process drives GPU `LOCAL_RANK`. A process group the caller started
    is joined as it is. A plain `python` run is one process: no process group, and `device`
    as given ("auto", "cpu", "cuda", "cuda:1"). A job with separate teachers starts through
    `streams.init_roles` instead."""
    joined = torch.distributed.is_available() and torch.distributed.is_initialized()
    world = job_size()
    cuda = wants_cuda(device)
    if world == 1:
        return DistEnv(
            device=torch.device(
                "cuda" if device == "auto" and cuda else device.replace("auto", "cpu")
            )
        )
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if not joined:
        torch.distributed.init_process_group(
            backend="nccl" if cuda else "gloo", device_id=dev if cuda else None
        )
    rank = torch.distributed.get_rank()
    return DistEnv(rank, world, local, dev, owns_group=not joined, global_rank=rank)


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of one model's layout; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    label: str = "student"
    pp: int = 1
    stages_per_rank: int = 1  # pipeline stages on each pp rank (`pp_stages_per_rank`)

    @classmethod
    def from_config(
        cls, cfg: ParallelConfig, world_size: int, label: str = "student"
    ) -> ParallelLayout:
        """Resolve `dp_shard = -1` (the ranks the other degrees leave) and check the product."""
        where = f"{label}.parallel"
        for name in ("dp_replicate", "tp", "cp", "pp", "pp_stages_per_rank"):
            if getattr(cfg, name) < 1:
                raise UserError(f"{where}.{name} must be >= 1, got {getattr(cfg, name)}")
        if cfg.dp_shard < 1 and cfg.dp_shard != -1:
            raise UserError(f"{where}.dp_shard must be >= 1 or -1 (the rest), got {cfg.dp_shard}")
        pp = cfg.pp
        _check_stages_per_rank(cfg, where)
        others = pp * cfg.dp_replicate * cfg.cp * cfg.tp
        shard = cfg.dp_shard
        if shard == -1:
            if world_size % others:
                raise UserError(
                    f"{where}: pp x dp_replicate x cp x tp = {pp} x {cfg.dp_replicate} x "
                    f"{cfg.cp} x {cfg.tp} = {others} does not divide the world size "
                    f"{world_size}; the product of the degrees must equal the number of processes"
                )
            shard = world_size // others
        layout = cls(cfg.dp_replicate, shard, cfg.cp, cfg.tp, label, pp, cfg.pp_stages_per_rank)
        if layout.world_size != world_size:
            raise UserError(
                f"{where}: pp x dp_replicate x dp_shard x cp x tp = {pp} x {cfg.dp_replicate} x "
                f"{shard} x {cfg.cp} x {cfg.tp} = {layout.world_size}, but the job has "
                f"{world_size} processes; the product of the degrees must equal the world size "
                "(dp_shard=-1 takes what the others leave)"
            )
        return layout

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def stages(self) -> int:
        """Pipeline stages in all: `pp x stages_per_rank`."""
        return self.pp * self.stages_per_rank

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different micro-batches the job reads at a time."""
        return self.dp_replicate * self.dp_shard

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def check_model(self, hf_config: Any) -> None:
        """Refuse a layout the model's shapes cannot take: attention and key/value heads must
        split evenly over `tp` (each rank computes whole heads); each pipeline stage needs a
        block."""
        blocks = getattr(hf_config, "num_hidden_layers", None)
        if blocks is not None and self.stages > blocks:
            v = self.stages_per_rank
            what = "pp" if v == 1 else "pp x pp_stages_per_rank"
            value = f"{self.pp}" if v == 1 else f"{self.pp} x {v} = {self.stages}"
            raise UserError(
                f"{self.label}.parallel.{what} = {value} is larger than the model's {blocks} "
                f"blocks; each pipeline stage needs at least one block: choose {what} <= {blocks}"
            )
        heads = getattr(hf_config, "num_attention_heads", None)
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        where = f"{self.label}.parallel.tp"
        if self.tp > 1 and heads is not None and heads % self.tp:
            raise UserError(
                f"{where} = {self.tp} does not divide the model's {heads} attention heads; "
                "choose a tp that divides the number of heads"
            )
        if self.tp > 1 and kv_heads is not None and kv_heads % self.tp:
            raise UserError(
                f"{where} = {self.tp} does not divide the model's {kv_heads} key/value heads; "
                "choose a tp that divides the number of key/value heads"
            )

    def check_sequence(self, length: int, what: str) -> None:
        """Context parallelism cuts a sequence into 2 x cp equal pieces (each rank takes one
        from the head and one from the tail, which balances causal attention work)."""
        if self.cp > 1 and length % (2 * self.cp):
            raise UserError(
                f"{self.label}.parallel.cp = {self.cp}: {what} = {length} is not divisible by "
                f"2 x cp = {2 * self.cp}; context parallelism cuts every sequence into 2 x cp "
                "equal pieces"
            )

    def check_window(self, hf_config: Any, longest: int, what: str) -> None:
        """Context parallelism's attention is causal over whole documents: a model with
        sliding-window layers (Mistral, Gemma-3's local layers) whose window is shorter than
        its rows would attend past the window."""
        from crossdistill.models.attention import sliding_window

        window = sliding_window(hf_config)
        if self.cp > 1 and window is not None and window < longest:
            raise UserError(
                f"{self.label}.parallel.cp = {self.cp}: the model's attention has a sliding "
                f"window of {window} tokens, shorter than its rows ({what} = {longest}), and "
                "context parallelism does not apply sliding windows; lay it out without cp, or "
                f"keep its rows within {window} tokens"
            )

    def build_mesh(self, device_type: str) -> NamedMesh | None:
        """One named `DeviceMesh` with axes `AXES`, plus the flattened `dp`, `fsdp`, `loss` and
        `cp_tp` axes; None for a single process."""
        if self.world_size == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        root = init_device_mesh(device_type, self.shape, mesh_dim_names=AXES)
        # `_flatten` makes a combined axis with its own process group (torch keeps it private;
        # torchtitan relies on it too); the flattened meshes are kept, not sliced again.
        flat = {
            "dp": root["dp_replicate", "dp_shard"]._flatten("dp"),
            "fsdp": root["dp_shard", "cp"]._flatten("fsdp"),
            "loss": root["dp_replicate", "dp_shard", "cp"]._flatten("loss"),
            "cp_tp": root["cp", "tp"]._flatten("cp_tp"),
        }
        return NamedMesh(root, flat)

    def describe(self) -> str:
        stages = f"pp={self.pp} " if self.pp > 1 else ""
        if self.stages_per_rank > 1:
            stages += f"pp_stages_per_rank={self.stages_per_rank} "
        return (
            f"{self.label}: {stages}dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} "
            f"cp={self.cp} tp={self.tp}"
        )


def _check_stages_per_rank(cfg: ParallelConfig, where: str) -> None:
    """Stages per rank and the schedule agree: the interleaved schedule runs several stages on
    each rank, 1F1B and GPipe one; several need several pipeline ranks to interleave over."""
    v, schedule = cfg.pp_stages_per_rank, cfg.pp_schedule
    if schedule == "Interleaved1F1B" and v < 2:
        raise UserError(
            f"{where}.pp_schedule = Interleaved1F1B runs several stages on each pipeline rank, "
            f"but pp_stages_per_rank = {v}; set pp_stages_per_rank >= 2 (2 is the usual), or "
            "use pp_schedule 1F1B"
        )
    if schedule != "Interleaved1F1B" and v > 1:
        raise UserError(
            f"{where}.pp_stages_per_rank = {v} with pp_schedule = {schedule}, which runs one "
            "stage per rank; set pp_schedule to Interleaved1F1B, or pp_stages_per_rank to 1"
        )
    if v > 1 and cfg.pp < 2:
        raise UserError(
            f"{where}.pp_stages_per_rank = {v} with pp = {cfg.pp}: stages are interleaved over "
            "the ranks of a pipeline; set pp >= 2, or pp_stages_per_rank to 1"
        )


class NamedMesh:
    """A layout's root mesh and its flattened axes: `mesh[name]` for one axis, or a tuple of
    names for a sub-mesh of the root (e.g. `("dp_replicate", "fsdp")` for HSDP)."""

    def __init__(self, root: Any, flat: dict[str, Any]):
        self.root = root
        self.flat = flat

    def __getitem__(self, key: str | tuple[str, ...]) -> Any:
        if isinstance(key, str) and key in self.flat:
            return self.flat[key]
        return self.root[key]

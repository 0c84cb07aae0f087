"""Layouts of a run: resolved and checked from the config before anything heavy is loaded, then
the meshes and the models built from them. One process is the one-rank case: its layouts are
all degrees 1, it has no mesh, and its models are built by the same steps."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from crossdistill.config import TEACHER_LENGTH_FACTOR, Config, ModelConfig, ParallelConfig
from crossdistill.distributed.layout import DistEnv, ParallelLayout
from crossdistill.distributed.loading import build_parallel_model
from crossdistill.distributed.parallelize import fsdp_mesh
from crossdistill.distributed.pipeline import StudentPipeline, check_micro_batches
from crossdistill.distributed.runtime import Placed, Placement, TeacherPadding, mesh_for
from crossdistill.distributed.teacher_pipeline import TeacherStages, check_teacher_stages
from crossdistill.distributed.tp_plans import fused_params
from crossdistill.errors import UserError
from crossdistill.models.loading import weight_bytes


def parallel_config(model: ModelConfig) -> ParallelConfig:
    """The model's `parallel` section (defaults when the config has none)."""
    value = getattr(model, "parallel", None)
    return value if isinstance(value, ParallelConfig) else ParallelConfig()


@dataclass
class RunLayouts:
    student: ParallelLayout
    teachers: list[ParallelLayout]
    separate: list[bool]  # per teacher: on ranks of its own (teachers.N.placement)

    def teacher_of(self, role: int) -> int:
        """The teacher index of role `role` (role i + 1: the i-th separate teacher)."""
        return [k for k, sep in enumerate(self.separate) if sep][role - 1]

    def role_of(self, k: int) -> int:
        """The role of separate teacher `k`."""
        return sum(self.separate[: k + 1])


# a frozen teacher whose weights take at most this share of a GPU is replicated by default
REPLICATE_TEACHER_SHARE = 0.25


def plan_layouts(
    cfg: Config,
    world_size: int,
    hf_s: Any,
    hf_t: list[Any],
    device_bytes: int | None = None,
) -> RunLayouts:
    """Every model's layout, checked against the job's processes (`world_size`: all of them,
    every role's), the model's heads and the sequence lengths: a layout that cannot work is
    refused here, naming the rule it breaks. The student and colocated teachers span the
    processes separate teachers leave; a separate teacher spans its `ranks`. `device_bytes`:
    one GPU's memory, which decides the default data parallelism of a teacher
    (`teacher_parallel`); None keeps FSDP."""
    separate = [t.placement == "separate" for t in cfg.teachers]
    own = sum(t.ranks for t, s in zip(cfg.teachers, separate) if s)
    student_ranks = world_size - own
    student = ParallelLayout.from_config(parallel_config(cfg.student), student_ranks, "student")
    student.check_model(hf_s)
    student.check_sequence(cfg.data.seq_len, "data.seq_len")
    student.check_window(hf_s, cfg.data.seq_len, "data.seq_len")
    if student.pp > 1:
        check_micro_batches(
            cfg.train.grad_accum, student.pp, parallel_config(cfg.student).pp_schedule
        )
    teachers = []
    for i, (tcfg, hf) in enumerate(zip(cfg.teachers, hf_t)):
        ranks = tcfg.ranks if separate[i] else student_ranks
        check_teacher_stages(i, parallel_config(tcfg), separate[i], ranks)
        pcfg = teacher_parallel(parallel_config(tcfg), ranks, hf, tcfg.dtype, device_bytes)
        layout = ParallelLayout.from_config(pcfg, ranks, f"teachers.{i}")
        if not parallel_config(tcfg).reshard_after_forward:
            raise UserError(
                f"teachers.{i}.parallel.reshard_after_forward = false keeps blocks gathered for "
                "a backward, which a frozen teacher does not run; leave it at true"
            )
        layout.check_model(hf)
        # teacher rows are padded to a multiple of data.pad_multiple
        layout.check_sequence(cfg.data.pad_multiple, "data.pad_multiple")
        longest = cfg.data.seq_len * TEACHER_LENGTH_FACTOR
        layout.check_window(hf, longest, f"data.seq_len x {TEACHER_LENGTH_FACTOR}")
        if tcfg.offload and student_ranks > 1:
            raise UserError(
                f"teachers.{i}.offload parks a whole teacher on the CPU, which a job of several "
                "processes does not do; shard the teacher instead (teachers.N.parallel)"
            )
        if separate[i] and student.dp % layout.dp:
            raise UserError(
                f"teachers.{i}: its {layout.dp} data-parallel groups must divide the student's "
                f"{student.dp} data ranks (each group serves whole data ranks); choose "
                f"teachers.{i}.parallel so that dp_replicate x dp_shard divides {student.dp}"
            )
        teachers.append(layout)
    return RunLayouts(student, teachers, separate)


def teacher_parallel(
    pcfg: ParallelConfig, ranks: int, hf: Any, dtype: str, device_bytes: int | None
) -> ParallelConfig:
    """A teacher's parallel settings with the default data parallelism (`dp_shard: -1`,
    `dp_replicate: 1`) decided: a frozen model needs no gradient sync, so a teacher whose
    weights take at most `REPLICATE_TEACHER_SHARE` of a GPU gets a copy on every data rank (no
    parameter gathers in its forwards; measured against sharding in benchmarks/README.md, "Two
    GPUs"); a larger one, or any on the CPU, is sharded. Degrees the config sets are kept."""
    others = pcfg.tp * pcfg.cp * pcfg.pp
    default = pcfg.dp_shard == -1 and pcfg.dp_replicate == 1
    if not default or device_bytes is None or ranks % others or ranks == others:
        return pcfg
    if weight_bytes(hf, dtype) > REPLICATE_TEACHER_SHARE * device_bytes:
        return pcfg
    return replace(pcfg, dp_replicate=ranks // others, dp_shard=1)


def build_placement(
    env: DistEnv, layouts: RunLayouts, teacher_padding: TeacherPadding = "auto"
) -> Placement:
    """Meshes for every layout this process takes part in (shared between equal layouts; none
    for one rank) and the step's placement. The student's processes hold the student and the
    colocated teachers; a separate teacher's processes hold that teacher alone."""
    kind = env.device.type
    if env.role == 0:
        student = Placed(layouts.student, mesh_for(layouts.student, kind))
        teachers = [
            None if sep else Placed(t, mesh_for(t, kind))
            for t, sep in zip(layouts.teachers, layouts.separate)
        ]
        return Placement(env, student, teachers, teacher_padding)
    k = layouts.teacher_of(env.role)
    teachers: list[Placed | None] = [None] * len(layouts.teachers)
    teachers[k] = Placed(layouts.teachers[k], mesh_for(layouts.teachers[k], kind))
    return Placement(env, None, teachers, teacher_padding)


def teacher_model(cfg: Config, k: int, placed: Placed, device: torch.device) -> nn.Module:
    """Teacher `k` in its layout, frozen; in pipeline stages (a separate teacher's `pp` > 1),
    this rank's stage, which `teacher_stages` runs (`distributed/teacher_pipeline.py`)."""
    t = cfg.teachers[k]
    model = build_parallel_model(
        t,
        placed.layout,
        placed.mesh,
        device,
        trainable=False,
        seed=cfg.train.seed + 1,
        compile_blocks=bool(getattr(t, "compile", False)),
        stage=placed.rank("pp"),
    )
    if placed.layout.pp > 1:
        model.teacher_stages = TeacherStages(
            model, placed.mesh, device, cfg.train.teacher_timeout_s
        )
    return model


def parallel_models(
    cfg: Config,
    placement: Placement,
    reshard_after_forward: bool | None = None,
    param_dtype: torch.dtype | None = None,
) -> tuple[nn.Module, list[nn.Module | None], dict[str, torch.Tensor]]:
    """The student and every teacher (None for one read from a cache or running on ranks of its
    own), each in its layout; plus the student's fused-row orders
    (needed to export and checkpoint it under tensor parallelism). `reshard_after_forward`
    (default: `student.parallel.reshard_after_forward`) and `param_dtype` are for the student's
    FSDP (see `parallelize_model`); on CUDA the step
    computes under bf16 autocast, so by default FSDP gathers the student's parameters in bf16
    (half the traffic; gradients are reduced in float32 into the float32 master weights; the
    measured gain is in benchmarks/README.md, "Scale-out")."""
    s, dev = cfg.student, placement.device
    if param_dtype is None and dev.type == "cuda":
        param_dtype = torch.bfloat16
    if reshard_after_forward is None:
        reshard_after_forward = parallel_config(s).reshard_after_forward
    student = build_parallel_model(
        s,
        placement.student.layout,
        placement.student.mesh,
        dev,
        trainable=True,
        seed=cfg.train.seed,
        activation_checkpointing=s.activation_checkpointing,
        checkpoint_blocks=s.activation_checkpointing_blocks,
        checkpoint_scope=s.activation_checkpointing_scope,
        compile_blocks=bool(getattr(s, "compile", False)),
        reshard_after_forward=reshard_after_forward,
        param_dtype=param_dtype,
        stage=placement.student.rank("pp"),
    )
    teachers = [
        None if placed is None or t.cache is not None else teacher_model(cfg, k, placed, dev)
        for k, (t, placed) in enumerate(zip(cfg.teachers, placement.teachers))
    ]
    layout = placement.student.layout
    if layout.pp > 1:
        placement.pipeline = student_pipeline(cfg, student, placement, param_dtype)
    fused = fused_params(student, student.config, layout.tp)
    return student, teachers, fused


def student_pipeline(
    cfg: Config, student: nn.Module, placement: Placement, param_dtype: torch.dtype | None
) -> StudentPipeline:
    """The schedule of the student's pipeline stages on this rank. Hidden states pass between
    stages in the dtype the blocks compute in: FSDP's gather dtype where FSDP shards the
    student, else its weights' dtype."""
    placed = placement.student
    sharded = fsdp_mesh(placed.layout, placed.mesh, trainable=True) is not None
    weights = next(student.parameters()).dtype
    return StudentPipeline(
        student,
        placed.mesh,
        placement.device,
        parallel_config(cfg.student).pp_schedule,
        rows=cfg.data.micro_batch_size,
        length=cfg.data.seq_len,
        dtype=param_dtype if sharded and param_dtype is not None else weights,
        tied=bool(getattr(student.config, "tie_word_embeddings", False)),
    )

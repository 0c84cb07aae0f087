"""Layouts of a run: resolved and checked from the config before anything heavy is loaded, then
the meshes and the models built from them. One process is the one-rank case: its layouts are
all degrees 1, it has no mesh, and its models are built by the same steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from crossdistill.config import Config, ModelConfig, ParallelConfig
from crossdistill.distributed.layout import DistEnv, ParallelLayout
from crossdistill.distributed.loading import build_parallel_model
from crossdistill.distributed.runtime import Placed, Placement, TeacherPadding, mesh_for
from crossdistill.distributed.tp_plans import fused_params
from crossdistill.errors import UserError


def parallel_config(model: ModelConfig) -> ParallelConfig:
    """The model's `parallel` section (defaults when the config has none)."""
    value = getattr(model, "parallel", None)
    return value if isinstance(value, ParallelConfig) else ParallelConfig()


@dataclass
class RunLayouts:
    student: ParallelLayout
    teachers: list[ParallelLayout]


def plan_layouts(cfg: Config, world_size: int, hf_s: Any, hf_t: list[Any]) -> RunLayouts:
    """Every model's layout, checked against the world size, the model's heads and the
    sequence lengths: a layout that cannot work is refused here, naming the rule it breaks."""
    student = ParallelLayout.from_config(parallel_config(cfg.student), world_size, "student")
    student.check_model(hf_s)
    student.check_sequence(cfg.data.seq_len, "data.seq_len")
    teachers = []
    for i, (tcfg, hf) in enumerate(zip(cfg.teachers, hf_t)):
        layout = ParallelLayout.from_config(parallel_config(tcfg), world_size, f"teachers.{i}")
        layout.check_model(hf)
        # teacher rows are padded to a multiple of data.pad_multiple
        layout.check_sequence(cfg.data.pad_multiple, "data.pad_multiple")
        if tcfg.offload and world_size > 1:
            raise UserError(
                f"teachers.{i}.offload parks a whole teacher on the CPU, which a job of several "
                "processes does not do; shard the teacher instead (teachers.N.parallel)"
            )
        teachers.append(layout)
    return RunLayouts(student, teachers)


def build_placement(
    env: DistEnv, layouts: RunLayouts, teacher_padding: TeacherPadding = "auto"
) -> Placement:
    """Meshes for every layout (shared between equal layouts; none for one rank) and the
    step's placement."""
    kind = env.device.type
    student = Placed(layouts.student, mesh_for(layouts.student, kind))
    teachers = [Placed(t, mesh_for(t, kind)) for t in layouts.teachers]
    return Placement(env, student, teachers, teacher_padding)


def parallel_models(
    cfg: Config,
    placement: Placement,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
) -> tuple[nn.Module, list[nn.Module | None], dict[str, torch.Tensor]]:
    """The student and every teacher (None for one read from a cache), each in its layout; plus the student's fused-row orders
    (needed to export and checkpoint it under tensor parallelism). `reshard_after_forward`
    and `param_dtype` are for the student's FSDP (see `parallelize_model`); on CUDA the step
    computes under bf16 autocast, so by default FSDP gathers the student's parameters in bf16
    (half the traffic; gradients are reduced in float32 into the float32 master weights; the
    measured gain is in benchmarks/README.md, "Scale-out")."""
    s, dev = cfg.student, placement.device
    if param_dtype is None and dev.type == "cuda":
        param_dtype = torch.bfloat16
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
    )
    teachers = [
        None  # read from its cache: no model
        if t.cache is not None
        else build_parallel_model(
            t,
            placed.layout,
            placed.mesh,
            dev,
            trainable=False,
            seed=cfg.train.seed + 1,
            compile_blocks=bool(getattr(t, "compile", False)),
        )
        for t, placed in zip(cfg.teachers, placement.teachers)
    ]
    fused = fused_params(student, student.config, placement.student.layout.tp)
    return student, teachers, fused

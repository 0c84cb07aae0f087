"""Scale-out with `torchrun`: one layout object per model, and functions that apply it. One
process is the one-rank layout: the same code, with no mesh.

- `layout.py`: `ParallelLayout` (pp x dp_replicate x dp_shard x cp x tp, checked against the
  world size, the model's heads and the sequence length) builds one named mesh;
  `init_distributed`.
- `parallelize.py`: `apply_tp`, `apply_cp`, `apply_fsdp`, `apply_activation_checkpointing`,
  `apply_compile`, and `parallelize_model`, which calls them in order; TP plans per model family
  in `tp_plans.py`; context-parallel attention in `cp.py`.
- `loading.py`: meta init -> parallelize -> each rank reads only its shards from safetensors.
- `runtime.py`: the training step's placement across ranks (teacher inputs gathered across
  layouts, vocab-parallel lm_head, sequence shards, reductions); `grads.py`: gradient clipping
  over mixed shardings; `setup.py`: the layouts of a run, its placement and its models.
- `stages.py`: a model's blocks split by cost into pipeline stages, and the model cut down to
  a rank's stages at load.
- `pipeline.py`: the student's stages over the mesh's `pp` axis, one or several (interleaved)
  per rank, run by a `torch.distributed.pipelining` schedule.
- `share.py`: a teacher that runs whole on each of a tensor- or context-parallel student's
  ranks computes each micro-batch of the window on one of them and broadcasts its targets.
- `streams.py`: separate teachers: the job split into roles (each its own process group), the
  job-wide link between them, and the targets streamed from a teacher's ranks to the student's.
- `teacher_pipeline.py`: a separate teacher's blocks in forward-only pipeline stages over its
  ranks (`teachers.N.parallel.pp`); its last stage computes the targets the stream sends.

Imports `errors`, `config`, `models` and `losses`; never `data` or `train`."""

from crossdistill.distributed.grads import clip_grad_norm_
from crossdistill.distributed.layout import DistEnv, ParallelLayout, init_distributed
from crossdistill.distributed.loading import build_parallel_model
from crossdistill.distributed.parallelize import (
    apply_activation_checkpointing,
    apply_compile,
    apply_cp,
    apply_fsdp,
    apply_tp,
    parallelize_model,
)

__all__ = [
    "DistEnv",
    "ParallelLayout",
    "apply_activation_checkpointing",
    "apply_compile",
    "apply_cp",
    "apply_fsdp",
    "apply_tp",
    "build_parallel_model",
    "clip_grad_norm_",
    "init_distributed",
    "parallelize_model",
]

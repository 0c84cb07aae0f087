"""Helpers for the multi-process tests: free ports, gloo worker processes, and the tiny
cross-tokenizer scenario on which every layout is compared with one process.

The scenario: a tiny Llama student (Llama-2 tokenizer) and two teachers with other tokenizers,
a tiny Qwen3 (GPT-2 tokenizer, forward KL on top-k targets) and a tiny Phi-3 (Mistral
tokenizer, chunk-likelihood; its fused qkv / gate_up projections exercise the fused TP plans).
Real tokenizers and the real data pipeline cut the micro-batches once, in the parent process;
the workers read them from a file, so every layout sees the same global batches.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from crossdistill.config import Config, ParallelConfig, from_dict

TEXTS = [
    "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n",
    "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. " * 3,
    "import os\nfor root, dirs, files in os.walk('.'):\n    print(root, len(files))\n",
    "Numbers 12345 and 3.14159, café naïve résumé, 数学 and 🙂 emoji.\r\nCRLF line.\n",
] * 10
WINDOW = 2  # micro-batches per step (global): one per data-parallel rank under dp2
STEPS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Any,
    args: tuple,
    errors: str,
    group: bool,
    environ: dict[str, str],
) -> None:
    # a worker forks from the server started with the first spawn: it takes the environment of
    # this spawn's caller (a test may have set a variable since), not the server's; only what
    # the modules of PRELOAD read when imported comes from the environment of that first spawn
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    # the server's descriptors are those of the first spawn's caller (under pytest, the capture
    # of the test that was running then): the worker writes to files, which `spawn` passes on
    for fd, stream in ((1, "out"), (2, "err")):
        with open(Path(errors, f"rank{rank}.{stream}"), "wb") as f:
            os.dup2(f.fileno(), fd)
    torch.set_num_threads(1)
    if group:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    except BaseException:
        Path(errors, f"rank{rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if group:
            dist.destroy_process_group()


# what every worker imports, loaded once by the fork server so that a worker starts in a fork
# instead of a fresh interpreter importing torch and transformers: transformers loads its
# modelling code and the scenario's model classes lazily, on a worker's first model
PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.phi3.modeling_phi3",
    "crossdistill.train.loop",
    __name__,
]


def spawn(fn: Any, world: int, *args: Any, errors: Path, group: bool = True) -> None:
    """Run `fn(rank, *args)` in `world` gloo processes (a fresh free port); a worker's
    traceback is re-raised here. `group=False`: the workers start with torchrun's environment
    but no process group (as `crossdistill train` under torchrun does). The workers fork from a
    server that has only imported `PRELOAD` (no CUDA context, no process group, no step run), so
    each starts as a fresh process would, with the caller's environment. What the workers
    print goes to the caller's stdout and stderr once they have ended, rank by rank (as the
    caller's descriptors are then: pytest's `capfd` reads it)."""
    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(PRELOAD)
    errors.mkdir(parents=True, exist_ok=True)
    try:
        mp.start_processes(
            _entry,
            args=(world, free_port(), fn, args, str(errors), group, dict(os.environ)),
            nprocs=world,
            start_method="forkserver",
        )
    except Exception as e:
        found = sorted(errors.glob("rank*.txt"))
        detail = "\n".join(p.read_text() for p in found)
        raise AssertionError(f"worker failed:\n{detail or e}") from None
    finally:
        _pass_on_output(errors, world)


def _pass_on_output(errors: Path, world: int) -> None:
    """Write each worker's stdout and stderr files to this process's stdout and stderr."""
    sys.stdout.flush()
    sys.stderr.flush()
    for rank in range(world):
        for fd, stream in ((1, "out"), (2, "err")):
            path = errors / f"rank{rank}.{stream}"
            if path.exists():
                data = memoryview(path.read_bytes())
                while data:
                    data = data[os.write(fd, data) :]
                path.unlink()


def scenario_config(tokenizers: dict[str, str], data: Path, out: Path) -> Config:
    def model(arch: str, tok: str, vocab: int) -> dict:
        return {
            "arch": arch,
            "tokenizer": tokenizers[tok],
            "dtype": "float32",
            "overrides": {"vocab_size": vocab},
        }

    raw = {
        "student": model("tiny-llama", "llama2", 32000),
        "teachers": [
            # named, not `auto`: on this text the pair is between near and far (90%), where
            # `auto` takes lookahead_prefix_end on one process and `lookahead` under tensor
            # parallelism; the layouts' lookahead targets: test_lookahead_layouts.py
            {
                "name": "qwen",
                **model("tiny-qwen3", "gpt2", 50304),
                "top_k": 16,
                "target": "first_piece",
            },
            {
                "name": "phi",
                **model("tiny-phi3", "mistral", 32768),
                "loss": "chunk_likelihood",
                "weight": 0.5,
                "target": "first_piece",  # what `auto` takes for a loss that is not projected
            },
        ],
        "data": {
            "train": [str(data / "train.jsonl")],
            "validation": [str(data / "val.jsonl")],
            "seq_len": 64,
            "micro_batch_size": 2,
            "num_workers": 0,
            "pad_multiple": 16,
        },
        "optim": {"lr": 1e-3, "warmup_steps": 1, "grad_clip": 1.0},
        "train": {"device": "cpu", "loss_chunk_size": 48, "seed": 0, "kd_ratio": 0.5},
        "run": {"out_dir": str(out), "tensorboard": False, "progress": False},
    }
    return from_dict(Config, raw)


def trainer_config(root: Path, tokenizer_dir: Any, steps: int, eval_every: int) -> Config:
    """`scenario_config` for `train()` runs under `root`: its projections built, `steps` steps
    of 2 micro-batches, validation every `eval_every` steps, checkpoints every 2."""
    from crossdistill.alignment.projection import build_projection
    from crossdistill.models import load_tokenizer

    toks = {n: str(tokenizer_dir(n)) for n in ("llama2", "gpt2", "mistral")}
    cfg = scenario_config(toks, write_corpus(root / "data"), root / "run")
    tok_s = load_tokenizer(cfg.student.tokenizer)
    for t in cfg.teachers:
        t.projection = str(root / f"{t.name}.projection.safetensors")
        build_projection(load_tokenizer(t.tokenizer), tok_s).save(t.projection)
    cfg.train.steps, cfg.train.grad_accum = steps, 2
    cfg.train.eval_every, cfg.train.eval_batches, cfg.train.log_every = eval_every, 2, 1
    cfg.train.checkpoint_every = 2
    return cfg


def probe_config(root: Path, tokenizer_dir: Any) -> Config:
    """`trainer_config` for a run read for its first KD value (`first_kd`): one step of 2
    micro-batches and a validation of one batch, so each target's training and validation
    paths run once."""
    cfg = trainer_config(root, tokenizer_dir, 1, eval_every=1)
    cfg.train.eval_batches = 1
    return cfg


def first_kd(cfg: Config) -> float:
    """Train `cfg` in this process; check every logged loss is finite and return teacher 0's
    first logged KD value (> 0)."""
    import json
    import math

    from crossdistill.train.loop import train

    train(cfg)
    rows = [json.loads(x) for x in (Path(cfg.run.out_dir) / "metrics.jsonl").open()]
    train_rows = [r for r in rows if "loss" in r]
    assert train_rows and all(math.isfinite(r["loss"]) for r in train_rows)
    name = f"kd/{cfg.teachers[0].name}"
    kd = next(r[name] for r in train_rows if name in r)
    assert kd > 0
    return kd


def write_corpus(folder: Path) -> Path:
    import json

    folder.mkdir(parents=True, exist_ok=True)
    for name, texts in (("train.jsonl", TEXTS), ("val.jsonl", TEXTS[:12])):
        with open(folder / name, "w") as f:
            for i, t in enumerate(texts):
                f.write(json.dumps({"text": f"{i}: {t}"}) + "\n")
    return folder


@dataclass
class Scenario:
    """What every process needs besides the config: the global micro-batches and the
    vocabulary projections (built once, seconds each)."""

    batches: list
    projections: dict[str, Any]


def prepare(cfg: Config, count: int, path: Path) -> Scenario:
    """Cut `count` micro-batches with the real data pipeline and save the scenario to `path`."""
    from crossdistill.data import build_loader
    from crossdistill.models import load_tokenizer
    from crossdistill.train.build import build_projection_for
    from crossdistill.train.validate import validate_config

    res_s, res_t = validate_config(cfg)
    tok_s = load_tokenizer(cfg.student.tokenizer)
    toks_t = [load_tokenizer(t.tokenizer) for t in cfg.teachers]
    loader = iter(build_loader(cfg.data, tok_s, toks_t, split="train"))
    batches = [_owned(next(loader)) for _ in range(count)]
    rows_s = res_s.hf_config.vocab_size
    projections = {}
    for t, tok, r in zip(cfg.teachers, toks_t, res_t):
        cpu = torch.device("cpu")
        projections[t.name] = build_projection_for(
            t, tok, tok_s, r.hf_config.vocab_size, rows_s, cpu, cfg.data
        )
    scenario = Scenario(batches, projections)
    torch.save(scenario, path)
    return scenario


def _owned(obj: Any) -> Any:
    """A batch whose tensors own their memory (loader tensors may view numpy buffers, which
    `torch.save` refuses to store twice under different types)."""
    import dataclasses

    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, list):
        return [_owned(x) for x in obj]
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(
            obj, **{f.name: _owned(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        )
    return obj


@dataclass
class Layouts:
    """A student layout and one per teacher."""

    name: str
    student: ParallelConfig
    teachers: list[ParallelConfig]
    activation_checkpointing: bool = False  # the student's


def with_layouts(cfg: Config, layouts: Layouts) -> Config:
    cfg.student.parallel = layouts.student
    cfg.student.activation_checkpointing = layouts.activation_checkpointing
    for t, p in zip(cfg.teachers, layouts.teachers):
        t.parallel = p
    return cfg


def run_steps(
    cfg: Config, sc: Scenario, steps: int = STEPS, window: int = WINDOW, extra: tuple = ()
) -> list[tuple[float, ...]]:
    """(loss, grad norm, *the metrics named in `extra`) of `steps` optimizer steps on `batches`
    (`window` per step), in the layouts of `cfg` (one process: the one-rank layouts, through
    the same code)."""
    from crossdistill.distributed.layout import init_distributed
    from crossdistill.distributed.runtime import TeacherSlot
    from crossdistill.distributed.setup import build_placement, parallel_models, plan_layouts
    from crossdistill.models import Teacher
    from crossdistill.train.optim import build_optimizer
    from crossdistill.train.step import StepSettings, train_step
    from crossdistill.train.validate import validate_config

    env = init_distributed("cpu")
    res_s, res_t = validate_config(cfg)
    layouts = plan_layouts(cfg, env.world_size, res_s.hf_config, [r.hf_config for r in res_t])
    placement = build_placement(env, layouts)  # one process: the one-rank layouts
    student, models_t, _ = parallel_models(cfg, placement)
    data_rank, data_size = placement.data_rank, placement.data_size
    slots = [
        TeacherSlot(Teacher(model, t.name), t, sc.projections[t.name])
        for t, model in zip(cfg.teachers, models_t)
    ]
    settings = StepSettings(
        kd_ratio=cfg.train.kd_ratio,
        teacher_mode="weighted",
        loss_chunk_size=cfg.train.loss_chunk_size,
        autocast=False,
        device=env.device,
    )
    optimizer = build_optimizer(student, cfg.optim)
    out = []
    for step in range(steps):
        batches = sc.batches[step * window : (step + 1) * window]
        mine = [mb for j, mb in enumerate(batches) if j % data_size == data_rank]
        metrics = train_step(student, slots, mine, settings, placement)
        norm = placement.clip_grads(student, cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append((float(metrics["loss"]), float(norm), *(float(metrics[k]) for k in extra)))
    return out


def layouts_worker(
    rank: int, cfg: Config, scenario_file: str, cases: list[Layouts], out: str, extra: tuple = ()
):
    """Every case in turn in the same process group; rank 0 writes {case: [(loss, norm,
    *extra)]} (`run_steps`)."""
    sc = torch.load(scenario_file, weights_only=False)
    results = {}
    for case in cases:
        results[case.name] = run_steps(with_layouts(cfg, case), sc, extra=extra)
    if rank == 0:
        torch.save(results, out)

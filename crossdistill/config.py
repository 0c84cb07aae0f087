"""Typed configuration: dataclasses that own their fields and defaults.

A run is described by one `Config` tree, read from YAML and then amended by
`a.b.c=value` overrides from the command line (list items by index:
`teachers.0.loss=jsd`). Unknown keys, wrong types and missing required fields
fail at load time with one `UserError` naming the key, the expected type and
the nearest valid key. `to_dict` gives the resolved tree that is saved as
`config.json` beside every run.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from crossdistill.errors import UserError

# Positions a teacher's sequence may need beyond the student's: tokenizers cut the same text into
# different numbers of tokens (byte-level BPEs differ by up to ~2x on code and CJK).
TEACHER_LENGTH_FACTOR = 2

# The choices of the settings below, defined once (the modules that act on them import these).
DistributionLoss = Literal["forward_kl", "reverse_kl", "jsd", "skew_kl", "tvd"]
LossName = Literal[
    "forward_kl", "reverse_kl", "jsd", "skew_kl", "tvd", "gold", "hkl", "uld", "chunk_likelihood"
]
DISTRIBUTION_LOSSES: tuple[str, ...] = get_args(DistributionLoss)
LOSSES: tuple[str, ...] = get_args(LossName)
Target = Literal[
    "auto",
    "first_piece",
    "context",
    "prefix",
    "lookahead",
    "lookahead_end",
    "lookahead_prefix",
    "lookahead_prefix_end",
    "lookahead_longer",
    "lookahead_mix",
    "lookahead_split",
]
TARGETS: tuple[str, ...] = get_args(Target)
Dtype = Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "float64"]
# auto (= varlen: flash varlen over packed documents on CUDA, masked SDPA elsewhere), or a
# transformers implementation name
Attention = Literal["auto", "varlen", "sdpa", "eager", "flex_attention", "flash_attention_2"]
ATTENTION_CHOICES: tuple[str, ...] = get_args(Attention)
# what activation checkpointing recomputes
CheckpointScope = Literal["block", "mlp", "selective"]
CHECKPOINT_SCOPES: tuple[str, ...] = get_args(CheckpointScope)
# the chunks that get a KD term (`TeacherConfig.kd_chunks`)
KDChunks = Literal["all", "single_side"]
# which continuations the step past a student token's end moves (`TeacherConfig.past_end`)
PastEnd = Literal["all", "canonical"]
# the lookahead targets at a chunk of several tokens on both sides (`TeacherConfig.many_chunks`)
ManyChunks = Literal["first_piece", "path"]
# where the lookahead targets send an alternative past the first teacher token
# (`TeacherConfig.deep_alternatives`)
DeepAlternatives = Literal["join", "longest"]
# the share unseen teacher tokens are drawn toward by `lookahead_split` (`TeacherConfig.split_prior`)
SplitPrior = Literal["boundaries", "tokens"]
# what `lookahead_split`'s share of an alternative reads besides the alternative itself
# (`TeacherConfig.split_context`)
SplitContext = Literal["none", "wide", "previous"]
# what a KD position's target does with the next bytes the student's last token rules out
# (`TeacherConfig.boundary`)
Boundary = Literal["ignore", "condition"]
# the CE weight of a student token that no teacher gives a KD target (`TrainConfig.ce_without_kd`)
CEWithoutKD = Literal["ratio", "full"]
# how teacher targets are stored (a cache) or sent (a separate teacher): "int8" top-k log-probs
# in steps of 1/8 nat, or "none" (float32, exact)
Quantization = Literal["int8", "none"]
# where a teacher runs under torchrun: on the student's ranks, or on ranks of its own
TeacherPlacement = Literal["colocated", "separate"]
# Pipeline schedules of the student's stages (`distributed/pipeline.py`): 1F1B and GPipe run one
# stage per rank; Interleaved1F1B runs `pp_stages_per_rank` stages on each rank
PipelineSchedule = Literal["1F1B", "GPipe", "Interleaved1F1B"]
MISSING_REQUIRED = "???"


@dataclass
class ParallelConfig:
    """How one model is laid out over the ranks of a `torchrun` job (each model has its own).
    The product of the degrees must equal the world size; `dp_shard = -1` takes what is left."""

    dp_replicate: int = 1  # plain data parallel (DDP-like replicas)
    dp_shard: int = -1  # FSDP2 sharding degree; -1: world / (dp_replicate * tp * cp)
    tp: int = 1  # tensor parallel
    cp: int = 1  # context (sequence) parallel
    # pipeline ranks, each holding pp_stages_per_rank stages of the student's blocks (combines
    # with dp_replicate, dp_shard, tp and cp), or one stage of a separate teacher's (forward
    # only; with dp_replicate and dp_shard)
    pp: int = 1
    # every schedule needs train.grad_accum >= pp micro-batches per data rank; Interleaved1F1B
    # also needs them to split into grad_accum // pp equal rounds (a multiple of pp does)
    pp_schedule: PipelineSchedule = "1F1B"
    # stages per rank ("virtual stages"): 1 for 1F1B and GPipe, >= 2 for Interleaved1F1B, whose
    # rank r holds stages r, r + pp, r + 2·pp, ... of pp x v (v = pp_stages_per_rank); the
    # pipeline's idle share of a step of m micro-batches, (pp - 1) / (m + pp - 1) under 1F1B,
    # becomes (pp - 1) / (v·m + pp - 1), for v times the sends between ranks
    pp_stages_per_rank: int = 1
    # FSDP (the student): free each block's gathered parameters after its forward (least
    # memory), or keep them until its backward (one all-gather per block and micro-batch fewer)
    reshard_after_forward: bool = True


@dataclass
class ModelConfig:
    """Where a model comes from. Exactly one of `path` (a Hugging Face checkpoint folder) or
    `arch` (a `config.json` file or folder, or a built-in tiny preset name: random init)."""

    path: str | None = None
    arch: str | None = None
    tokenizer: str | None = None  # folder, HF id or tiktoken file; defaults to `path`
    dtype: Dtype = "bfloat16"
    attn_implementation: Attention = "auto"  # see `Attention` above
    # HF config fields to change, e.g. {num_hidden_layers: 4}
    overrides: dict[str, Any] = field(default_factory=dict)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compile: bool = False  # torch.compile each transformer block


@dataclass
class StudentConfig(ModelConfig):
    dtype: Dtype = "float32"  # master weights; compute runs under autocast on GPU
    activation_checkpointing: bool = False
    # with activation_checkpointing: recompute only the first N blocks (0 = every block); a
    # few blocks buy back memory at a fraction of the full recomputation's cost
    activation_checkpointing_blocks: int = 0
    # what is recomputed: "block" (the whole block: the most memory back), "mlp" (only its
    # MLP, matmuls included) or "selective" (only the MLP's elementwise work: its weights' casts
    # to the autocast dtype and the gated activation; its matmul outputs are kept)
    activation_checkpointing_scope: CheckpointScope = "block"


@dataclass
class TeacherConfig(ModelConfig):
    name: str = "teacher"
    weight: float = 1.0
    loss: LossName = "forward_kl"
    temperature: float = 1.0
    top_k: int = 64
    beta: float = 0.5  # jsd mixing weight
    alpha: float = 0.1  # skew_kl skew
    projection: str | None = None  # prebuilt projection file; built on the fly when absent
    # the projected losses' target at a chunk of one student token over several teacher tokens:
    # "auto" chooses at load from how the pair aligns on the training text (train/auto_target.py:
    # first_piece for near pairs, lookahead_split for every other pair);
    # "first_piece" gives the teacher's first token's mass to its first student piece;
    # "context" gives the part that continues to the student's observed token to that token;
    # "prefix" compares the teacher's token with the group of student tokens whose bytes start
    # with it (each student token in the group of its first teacher piece);
    # "lookahead" also reads the teacher's top-k at its later positions inside the student
    # token, giving each alternative continuation to the student token that spells it;
    # "lookahead_end" also reads the position after the student token's end: the teacher's
    # continuations that the student spells with a longer token get that token's share;
    # "lookahead_prefix" is "lookahead" with the teacher's other tokens at the KD position
    # compared, as "prefix" does, with the groups of student tokens that start with them;
    # "lookahead_prefix_end" is "lookahead_prefix" that also reads past the end, as
    # "lookahead_end" does;
    # "lookahead_longer" is "lookahead_prefix_end" at the chunks of one student token over
    # several teacher tokens and "lookahead" at the others (kept to compare with; it did not
    # beat "lookahead_prefix_end");
    # "lookahead_mix" is half "lookahead_end" and half "lookahead_prefix_end": both divergences
    # from one teacher pass, each at half the teacher's weight;
    # "lookahead_split" is "lookahead_prefix_end" with each of the teacher's other tokens split
    # between the student token spelling it and the longer ones that start with it, by how
    # often the training text has each (counted at load on a sample of it)
    target: Target = "auto"
    # the chunks that get a KD term: "all", or "single_side": none at a chunk of several tokens
    # on both sides, where the student's first token ends inside a teacher token and no
    # target gives the teacher's probability of it (`benchmarks/bpb_by_class.py` splits a
    # run's held-out bits by chunk kind); with one tokenizer every chunk is one token each
    kd_chunks: KDChunks = "all"
    # the targets that read past the student token's end (`lookahead_end`, `lookahead_prefix_end`,
    # `lookahead_split`, ...) move the mass of the teacher's continuation x of the observed token
    # to the student's longer token that spells both: "all" for every such x; "canonical" only
    # where the teacher's tokenizer writes x after its last token t as a token of its own (it has
    # no token for t then x): mass a teacher gives a split its tokenizer never writes stays with
    # the observed token (benchmarks/README.md, "The step past the end on a split the teacher
    # never writes": on Perl's near pair at the cpu scale it changed the students by under 0.03%,
    # so "all" stays). With identical tokenizers "canonical" moves nothing
    past_end: PastEnd = "all"
    # the lookahead targets at a chunk of several tokens on both sides, where the student's first
    # token ends inside a teacher token: "path" gives the student's first token the teacher's
    # mass of the text it covers: the teacher's first token's where the student's is shorter,
    # else the mass that reaches the teacher token crossing its end along the observed path
    # (found from byte lengths); "first_piece", as before 2026-12-06, gives the KD position the
    # first piece's buckets, where the teacher's first token names a student token the text
    # does not have there (the comparison: benchmarks/README.md, "The chunks of several tokens
    # on both sides along the path")
    many_chunks: ManyChunks = "path"
    # the lookahead targets at a teacher position d ≥ 1 inside a student token, whose prefix so
    # far the student spells as token a: the teacher's alternative x ≠ the text's token goes to
    # the student token spelling a then x ("join"), else to a itself; "longest" gives it to the
    # longest student token spelling a then a prefix of x (a where there is none), the token
    # longest-match tokenisation would write first there. The student's BPE does not split by
    # longest match, and "longest" moved the target away from a same-tokenizer teacher
    # (benchmarks/README.md, "A lookahead alternative past the first teacher token to the
    # student's longest token"), so "join" stays
    deep_alternatives: DeepAlternatives = "join"
    # `lookahead_split` draws each teacher token's counted share toward a share over all tokens
    # (`train.short_share`): "boundaries", the share over every boundary counted; "tokens", the
    # mean of the seen tokens' shares, each token once, so that a few frequent tokens that split
    # unlike the rest (digits, where the student writes up to three as one token) do not set the
    # share of every rare token (benchmarks/README.md, "The step past the end on a split the
    # teacher never writes, and the split's prior": there it changed the students by under
    # 0.01%, so "boundaries" stays)
    split_prior: SplitPrior = "boundaries"
    # `lookahead_split`'s share of an alternative teacher token x for its exact student token:
    # "none", one share per x, counted on the sample `target: auto` reads; "wide", one share per
    # x counted on the larger sample `boundary` reads; "previous", that, and one share per pair
    # of x and the student's token before the KD position (pairs the sample holds a few times
    # drawn toward x's own share), since the student's last token says much about whether the
    # text stops after x (`train.short_share`). "wide" is "previous" without the pairs, to
    # measure the two apart. Both move the target toward a same-tokenizer teacher's, but the
    # students were level with "none"'s (benchmarks/README.md, "What the student's previous
    # token says about the split"), so "none", which reads less text at load, stays
    split_context: SplitContext = "none"
    # a cross teacher's top-k at a KD position: "condition" drops the continuations whose first
    # byte the student's last token rules out there (Llama-3's `;\n` is never followed by a line
    # end, where Mistral's `<0x0A>` often is) and divides the rest by what is left, the teacher's
    # distribution given what the student's token boundary says (`losses.boundaries`; the ruled
    # out bytes are counted at load on a sample of the training text); "ignore" reads the top-k
    # as it is, as runs did before 2026-12-06. On the far pair it closed more of the gap on
    # every corpus compared, and on the near pair it changed nothing beyond the seeds' spread
    # (benchmarks/README.md, "What the student's token boundary rules out"). With identical
    # tokenizers nothing is dropped
    boundary: Boundary = "condition"
    offload: bool = False  # keep on CPU between steps (small GPUs)
    # a teacher cache folder (`crossdistill cache build`): targets read from it, no model runs
    cache: str | None = None
    # under torchrun: "colocated" runs the teacher on the student's ranks between its steps;
    # "separate" runs it on `ranks` processes of its own (the last ones of the job, in teacher
    # order; `parallel` lays it out over them), ahead of the student by
    # train.teacher_prefetch steps, its targets sent to the student ranks that use them
    placement: TeacherPlacement = "colocated"
    ranks: int = 1
    # how a separate teacher's targets travel: "none" (float32 log-probs, exact; about
    # 8 x top_k bytes per student token) or "int8" (1/8-nat steps, as in a teacher cache)
    payload: Quantization = "none"


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=list)
    validation: list[str] = field(default_factory=list)
    format: Literal["auto", "text", "jsonl", "parquet", "arrow", "hf_disk"] = "auto"
    text_field: str = "text"
    messages_field: str | None = None
    loss_on: Literal["assistant", "all"] = "assistant"
    seq_len: int = 2048
    micro_batch_size: int = 4
    num_workers: int = 1
    val_fraction: float = 0.01
    pad_multiple: int = 64
    bad_input: Literal["skip", "error"] = "skip"
    seed: int = 0


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    grad_clip: float = 1.0


@dataclass
class TrainConfig:
    steps: int = 1000
    grad_accum: int = 1
    kd_ratio: float = 0.5
    # the KD weight rises linearly from kd_ratio/N at the first step to kd_ratio at step N
    # (CE takes the rest): a student from scratch learns from its labels before a teacher pulls
    # it; that moves a run's early path both ways (benchmarks/README.md, "A warm-up of the KD
    # weight"), so it is off by default; 0: kd_ratio from the start
    kd_warmup_steps: int = 0
    # the CE weight of a token that no teacher gives a KD target (past the first student token
    # of a cross teacher's chunk, a chunk that kd_chunks leaves out, the end of a window):
    # "ratio" = 1 − kd_ratio, as on every other token; "full" = 1, the KD share that no teacher
    # uses there goes to CE. A same-tokenizer teacher covers every token: no change there.
    # "ratio" stays the default until "full" is measured on text where such tokens are rare
    # (benchmarks/README.md, "The chunks of several tokens on both sides along the path")
    ce_without_kd: CEWithoutKD = "ratio"
    teacher_mode: Literal["weighted", "dynamic", "best"] = "weighted"
    eval_every: int = 200
    eval_batches: int = 20
    # tasks run on the student at each validation and at the end (one process), as
    # `crossdistill eval --task` takes them: ["bpb=held_out.jsonl", "choice=mmlu.jsonl", ...]
    eval_tasks: list[str] = field(default_factory=list)
    checkpoint_every: int = 500
    keep_last: int = 2
    # write checkpoints from a background thread (the loop waits only for the copy of the
    # state into host memory)
    checkpoint_in_background: bool = True
    # a cross teacher's body on its non-pad tokens: "auto" where flash varlen attention covers
    # every layer, "drop" always, "keep" never (the padded rows, for comparisons)
    teacher_padding: Literal["auto", "drop", "keep"] = "auto"
    log_every: int = 10
    max_consecutive_skips: int = 5
    device: str = "auto"
    seed: int = 0
    loss_chunk_size: int = 1024
    # separate teachers (teachers.N.placement): how many steps of targets they compute ahead
    # of the student, and how long a student waits for targets before it ends the job
    teacher_prefetch: int = 2
    teacher_timeout_s: float = 600.0
    # how targets travel between processes that share a GPU: "auto" = CUDA IPC (the student
    # copies the teacher's buffer on the GPU) where both processes can open each other's
    # memory, else through host memory; "host" = always through host memory (a comparison, or
    # a container that forbids CUDA IPC). Processes with GPUs of their own always use NCCL.
    teacher_link: Literal["auto", "host"] = "auto"
    # the loss and the teachers' targets: "auto" = the fused Triton kernels on CUDA, "pytorch"
    # = the plain PyTorch code everywhere (a comparison, or a GPU without Triton support)
    loss_kernels: Literal["auto", "pytorch"] = "auto"


@dataclass
class RunConfig:
    out_dir: str = "runs/default"
    tensorboard: bool = True
    progress: bool = True


@dataclass
class Config:
    student: StudentConfig = field(default_factory=StudentConfig)
    teachers: list[TeacherConfig] = field(default_factory=list)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)


T = TypeVar("T")


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    schema: type[T] = Config,  # type: ignore[assignment]
) -> T:
    """Read a YAML file (or nothing), apply `a.b=v` overrides, and build the typed tree."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"config file not found: {p}")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise UserError(f"{p} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise UserError(f"{p} must hold a mapping at the top level, got {type(raw).__name__}")
    for item in overrides or []:
        _apply_override(raw, item)
    return from_dict(schema, raw)


def apply_overrides(cfg: T, overrides: list[str]) -> T:
    """`cfg` with `a.b=v` overrides applied, checked as a loaded config is."""
    if not overrides:
        return cfg
    raw = to_dict(cfg)
    for item in overrides:
        _apply_override(raw, item)
    return from_dict(type(cfg), raw)


def from_dict(schema: type[T], raw: Any, where: str = "") -> T:
    """Build dataclass `schema` from a plain mapping, checking every key and type."""
    return _convert(schema, raw, where)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain JSON-able data."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")


def _apply_override(raw: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise UserError(f"override {item!r} must look like key.sub=value")
    key, value_text = item.split("=", 1)
    try:
        value = yaml.safe_load(value_text) if value_text != "" else ""
    except yaml.YAMLError:
        value = value_text
    parts = key.strip().split(".")
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            node = _list_slot(node, part, key)
            continue
        if part not in node or node[part] is None:
            node[part] = [] if nxt.isdigit() else {}
        node = node[part]
    last = parts[-1]
    if isinstance(node, list):
        idx = int(last) if last.isdigit() else -1
        if not 0 <= idx <= len(node):
            raise UserError(f"override {key}: index {last} out of range (list has {len(node)})")
        if idx == len(node):
            node.append(value)
        else:
            node[idx] = value
    else:
        node[last] = value


def _list_slot(node: list, part: str, key: str) -> Any:
    if not part.isdigit() or int(part) > len(node):
        raise UserError(f"override {key}: {part!r} is not a valid index (list has {len(node)})")
    if int(part) == len(node):
        node.append({})
    return node[int(part)]


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = get_origin(tp)
    label = where or "<root>"
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _convert_dataclass(tp, value, where)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except UserError as e:
                errors.append(str(e))
        raise UserError(f"{label}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            near = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise UserError(f"{label}: {value!r} is not one of {list(choices)}{hint}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            if origin is list and isinstance(value, str):
                value = [value]  # a single path where a list of paths is expected
            else:
                raise UserError(f"{label}: expected a list ({_type_name(tp)}), got {value!r}")
        args = get_args(tp)
        if origin is tuple:
            if len(args) != len(value):
                raise UserError(
                    f"{label}: expected {len(args)} items ({_type_name(tp)}), got {value!r}"
                )
            return tuple(
                _convert(a, v, f"{where}.{i}") for i, (a, v) in enumerate(zip(args, value))
            )
        return [_convert(args[0], v, f"{where}.{i}") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{label}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads "3e-4" as a string
        except ValueError:
            pass
    if (
        tp in (int, str, bool)
        and isinstance(value, tp)
        and not (tp is int and isinstance(value, bool))
    ):
        return value
    raise UserError(f"{label}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _convert_dataclass(tp: type, value: Any, where: str) -> Any:
    label = where or "<root>"
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise UserError(f"{label}: expected a mapping for {tp.__name__}, got {value!r}")
    hints = typing.get_type_hints(tp)
    fields = {f.name: f for f in dataclasses.fields(tp)}
    for key in value:
        if key not in fields:
            near = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
            hint = f"; did you mean {_join(where, near[0])!r}?" if near else ""
            raise UserError(
                f"unknown config key {_join(where, key)!r}{hint} (valid keys here: {', '.join(fields)})"
            )
    kwargs = {}
    for name, f in fields.items():
        key = _join(where, name)
        if name in value:
            kwargs[name] = _convert(hints[name], value[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"missing required config key {key!r} ({_type_name(hints[name])})")
    for name in kwargs:
        if kwargs[name] == MISSING_REQUIRED:
            raise UserError(f"config key {_join(where, name)!r} must be set")
    return tp(**kwargs)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else str(key)

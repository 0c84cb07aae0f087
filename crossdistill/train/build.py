"""Build what a run needs from its config, in the order that fails fast: config checks and
tokenizers (seconds) before projections, projections before models (minutes), models before
the loaders' first batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from crossdistill.config import Config, DataConfig, TeacherConfig
from crossdistill.distributed.layout import DistEnv, init_distributed
from crossdistill.distributed.runtime import Placement, TeacherSlot
from crossdistill.errors import UserError
from crossdistill.losses import (
    ByteLengths,
    Extensions,
    Joins,
    PrefixGroups,
    VocabProjection,
    target_kind,
)
from crossdistill.models import Teacher, load_tokenizer, tokenizer_fingerprint
from crossdistill.train.auto_target import resolve_targets
from crossdistill.train.optim import build_optimizer, build_scheduler
from crossdistill.train.teacher_cache import check_coverage, open_cache
from crossdistill.train.validate import check_vocab, validate_config


@dataclass
class Components:
    device: torch.device
    student: nn.Module
    tok_s: Any
    toks_t: list[Any]
    slots: list[TeacherSlot]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_loader: Any
    val_loader: Any
    teacher_bpb: dict[str, float]
    env: DistEnv = field(default_factory=DistEnv)
    placement: Placement | None = None  # how the step is laid out over the job's ranks
    fused: dict[str, torch.Tensor] = field(default_factory=dict)  # TP row orders (see tp_plans)
    notes: list[str] = field(default_factory=list)  # what was chosen at load, for the run's log


def build_projection_for(
    tcfg: TeacherConfig,
    tok_t,
    tok_s,
    rows_t: int,
    rows_s: int,
    device: torch.device,
    data: DataConfig | None = None,
    notes: list[str] | None = None,
) -> VocabProjection:
    """The teacher-to-student map over the models' embedding rows (`rows_t`, `rows_s`, which
    may exceed the tokenizers' sizes: padded vocabularies). Identity for a teacher with the
    student's tokenizer; otherwise a saved projection (refused if built for other tokenizers)
    or one built now (seconds). Rows a tokenizer never produces map to the tail. `data`: the
    training text, which `lookahead_split` counts its shares on; what it counted is added to
    `notes`, the run's log lines."""
    if tokenizer_fingerprint(tok_t) == tokenizer_fingerprint(tok_s):
        first = torch.arange(len(tok_s))
        exact = torch.ones(len(tok_s), dtype=torch.bool)
        out = _padded(first, exact, rows_t, rows_s, device)
        if tcfg.loss == "hkl":
            out.matched = torch.where(out.exact, out.first_piece, -1)
        return out
    from crossdistill.alignment.projection import Projection, build_projection, relaxed_matches

    if tcfg.projection:
        proj = Projection.load(tcfg.projection, tok_t=tok_t, tok_s=tok_s)
    else:
        proj = build_projection(tok_t, tok_s)
    if proj.mode == "first_piece":
        out = _padded(proj.first_piece, proj.exact, rows_t, rows_s, device)
    else:
        exact = torch.zeros(rows_t, dtype=torch.bool)
        exact[: proj.vocab_size_t] = proj.exact
        out = VocabProjection.from_sparse(
            proj.rows.to(device),
            proj.cols.to(device),
            proj.weights.to(device),
            rows_t,
            rows_s,
            exact=exact.to(device),
        )
    kind = target_kind(tcfg.target)
    if kind.groups:  # each student token's first teacher piece: the other way
        first_t = _padded_ids(build_projection(tok_s, tok_t).first_piece, rows_s, rows_t)
        if kind.split:
            share, pairs, counted = _short_share(tcfg, tok_s, tok_t, data, out, first_t)
            if notes is not None:
                notes.extend(counted)
            out.groups = PrefixGroups.split_from_first_pieces(
                first_t.to(device), out.first_piece, out.exact, share.to(device)
            )
            if pairs is not None:
                out.groups = out.groups.with_pairs(pairs[0].to(device), pairs[1].to(device))
        else:
            out.groups = PrefixGroups.from_first_pieces(first_t.to(device), out.first_piece)
    if tcfg.loss == "hkl":
        matched = torch.from_numpy(relaxed_matches(tok_t, tok_s, proj))
        out.matched = _padded_ids(matched, rows_t, rows_s).to(device)
    if kind.lookahead:
        from crossdistill.alignment.projection import build_joins

        rows = torch.from_numpy(build_joins(tok_t, tok_s)).to(device)
        out.joins = Joins.from_rows(rows, rows_t, rows_s)
    if kind.past_end and tcfg.past_end == "canonical":
        from crossdistill.alignment.projection import own_joins

        rows = torch.from_numpy(own_joins(tok_t)).to(device)
        out.teacher_joins = Joins.from_rows(rows, rows_t, rows_t)
    if kind.lookahead and tcfg.deep_alternatives == "longest":
        from crossdistill.alignment.projection import build_extensions

        rows, prefixes = build_extensions(tok_t, tok_s)
        out.extensions = Extensions.from_rows(
            torch.from_numpy(rows).to(device), torch.from_numpy(prefixes).to(device), rows_t, rows_s
        )
    if kind.lookahead and tcfg.many_chunks == "path":
        out.byte_lengths = ByteLengths(
            _byte_lengths(tok_t, rows_t).to(device), _byte_lengths(tok_s, rows_s).to(device)
        )
    if tcfg.boundary == "condition":
        out.boundaries, counted = _boundaries(tcfg, tok_s, tok_t, data, rows_s, rows_t)
        out.boundaries = out.boundaries.to(device)
        if notes is not None:
            notes.append(counted)
    return out


def _boundaries(tcfg: TeacherConfig, tok_s, tok_t, data: DataConfig | None, rows_s, rows_t):
    """`boundary: condition`'s table (`train.boundaries`), counted on a sample of the training
    text, and a line saying what the count blocked."""
    from crossdistill.train.boundaries import SAMPLE_BYTES, SAMPLE_ROWS, build_boundaries

    what = f"teacher {tcfg.name!r}: boundary: condition counts what the student's tokens rule out"
    texts = _training_sample(data, what, SAMPLE_BYTES, rows_per_file=SAMPLE_ROWS)
    table, line = build_boundaries(tok_s, tok_t, texts, rows_s, rows_t)
    return table, f"teacher {tcfg.name!r}: {line}"


def _byte_lengths(tok, rows: int) -> torch.Tensor:
    """`[rows]` the text bytes each id of `tok` covers, 0 past its vocabulary."""
    from crossdistill.alignment.token_bytes import TokenBytes

    lengths = torch.from_numpy(TokenBytes.from_tokenizer(tok).lengths.astype("int64"))
    full = torch.zeros(rows, dtype=torch.long)
    n = min(rows, lengths.shape[0])
    full[:n] = lengths[:n]
    return full


def _short_share(
    tcfg: TeacherConfig,
    tok_s,
    tok_t,
    data: DataConfig | None,
    proj: VocabProjection,
    first_t: torch.Tensor,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, list[str]]:
    """`lookahead_split`'s share `[rows_t]` of each teacher token's mass for its exact student
    token (`train.short_share`), the pair table of `split_context: previous` (sorted keys and
    shares; None under the other values) and lines saying what the count saw. Under
    `split_context: none` the shares are counted on the sample `target: auto` reads, under the
    other values on the larger one `boundary: condition` reads."""
    from crossdistill.train.short_share import (
        boundary_events,
        counts_of,
        describe_counts,
        pair_shares,
        short_shares,
    )

    spelled = torch.where(proj.exact, proj.first_piece, -1).cpu().numpy()
    if tcfg.split_context == "none":
        from crossdistill.train.auto_target import SAMPLE_BYTES

        texts = _training_sample(data, "target lookahead_split counts its shares", SAMPLE_BYTES)
    else:
        from crossdistill.train.boundaries import SAMPLE_BYTES, SAMPLE_ROWS

        what = f"teacher {tcfg.name!r}: split_context: {tcfg.split_context} counts the split"
        texts = _training_sample(data, what, SAMPLE_BYTES, rows_per_file=SAMPLE_ROWS)
    events = boundary_events(tok_s, tok_t, texts, spelled, first_t.numpy())
    short, longer = counts_of(events, spelled.shape[0])
    sampled = sum(len(t.encode()) for t in texts)
    share = short_shares(short, longer, tcfg.split_prior)
    lines = [describe_counts(tcfg.name, short, longer, sampled)]
    if tcfg.split_context != "previous":
        return torch.from_numpy(share), None, lines
    keys, pair = pair_shares(events, share)
    lines.append(
        f"teacher {tcfg.name!r}: lookahead_split shares counted per previous student token on "
        f"{len(events):,} chunks: {len(keys):,} pairs"
    )
    return torch.from_numpy(share), (torch.from_numpy(keys), torch.from_numpy(pair)), lines


def _training_sample(data: DataConfig | None, what: str, num_bytes: int, **read) -> list[str]:
    """`data.build.sample_texts(data, num_bytes, **read)` of the training text, for a setting
    that counts on it (`what` says which, for the error when the projection is built without
    the data settings)."""
    from crossdistill.data.build import sample_texts

    if data is None:
        raise UserError(
            f"{what} on the training text: build the projection with the run's data settings "
            "(build_projection_for(..., data=cfg.data))"
        )
    return sample_texts(data, num_bytes, **read)


def _padded_ids(first: torch.Tensor, rows: int, limit: int) -> torch.Tensor:
    """`first [V]` ids over `rows` embedding rows: −1 past the tokenizer and at ids >= `limit`
    (rows of the other model that do not exist)."""
    full = torch.full((rows,), -1, dtype=torch.long)
    n = min(rows, first.shape[0])
    full[:n] = first[:n].long()
    full[full >= limit] = -1
    return full


def _padded(
    first: torch.Tensor, exact: torch.Tensor, rows_t: int, rows_s: int, device
) -> VocabProjection:
    full = _padded_ids(first, rows_t, rows_s)
    n = min(rows_t, first.shape[0])
    ex = torch.zeros(rows_t, dtype=torch.bool)
    ex[:n] = exact[:n].bool()
    return VocabProjection.from_first_piece(
        full.to(device), rows_s, exact=(ex & (full >= 0)).to(device)
    )


@dataclass
class RunPlan:
    """What every process of a run settles first, whatever its role: the checked config's
    models, every layout, tokenizers, this process's placement, the teacher caches, and the
    teachers' settings with every `target: auto` chosen (`teachers`; `notes` say why)."""

    resolved_s: Any
    resolved_t: list[Any]
    layouts: Any
    tok_s: Any
    toks_t: list[Any]
    placement: Placement
    caches: list[Any]
    teachers: list[TeacherConfig]
    notes: list[str]

    def loaders(self, cfg: Config, data_rank: int, data_size: int) -> tuple[Any, Any]:
        """Train and validation loaders of data rank `data_rank` of `data_size`."""
        return build_loaders(cfg, self.tok_s, self.toks_t, data_rank, data_size, self.caches)


def plan_run(cfg: Config, env: DistEnv) -> RunPlan:
    """Config checks, layouts (refused before anything loads), tokenizers, meshes, caches."""
    from crossdistill.distributed.setup import build_placement, plan_layouts

    resolved_s, resolved_t = validate_config(cfg)
    layouts = plan_layouts(
        cfg,
        env.job_size,
        resolved_s.hf_config,
        [r.hf_config for r in resolved_t],
        device_bytes=_device_memory(env.device),
    )
    tok_s = load_tokenizer(resolved_s.tokenizer_spec)
    toks_t = [load_tokenizer(r.tokenizer_spec) for r in resolved_t]
    check_vocab(resolved_s, tok_s)
    for r, tok in zip(resolved_t, toks_t):
        check_vocab(r, tok)
    placement = build_placement(env, layouts, cfg.train.teacher_padding)
    teachers, notes = resolve_targets(cfg, tok_s, toks_t)
    caches = [
        None if t.cache is None else open_cache(t, i, cfg, tok)
        for i, (t, tok) in enumerate(zip(teachers, toks_t))
    ]
    check_coverage(cfg, caches)
    return RunPlan(
        resolved_s, resolved_t, layouts, tok_s, toks_t, placement, caches, teachers, notes
    )


def _device_memory(device: torch.device) -> int | None:
    """One GPU's memory (None off CUDA): it decides whether a teacher is replicated."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def build_components(cfg: Config, env: DistEnv | None = None) -> Components:
    """Tokenizers, projections, models, optimizer and loaders for `cfg`, every model in its
    layout over the job's ranks (`env`; default: this process's, as `init_distributed` finds
    it: one rank outside `torchrun`), loaded shard by shard."""
    from crossdistill.distributed.setup import parallel_models

    env = env or init_distributed(cfg.train.device)
    run = plan_run(cfg, env)
    device, placement, tok_s, toks_t = env.device, run.placement, run.tok_s, run.toks_t
    rows_s = run.resolved_s.hf_config.vocab_size
    projections = [
        build_projection_for(
            t, tok, tok_s, r.hf_config.vocab_size, rows_s, device, cfg.data, run.notes
        )
        for t, tok, r in zip(run.teachers, toks_t, run.resolved_t)
    ]
    train_loader, val_loader = run.loaders(cfg, placement.data_rank, placement.data_size)
    student, models_t, fused = parallel_models(cfg, placement)
    streams = target_streams(run, cfg, env, placement.data_rank)
    slots = [
        TeacherSlot(
            None if model is None else Teacher(model, t.name, offload=t.offload), t, proj, stream
        )
        for t, model, proj, stream in zip(run.teachers, models_t, projections, streams)
    ]
    optimizer = build_optimizer(student, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)
    return Components(
        device,
        student,
        tok_s,
        toks_t,
        slots,
        optimizer,
        scheduler,
        train_loader,
        val_loader,
        {},
        env,
        placement,
        fused,
        run.notes,
    )


def target_streams(run: RunPlan, cfg: Config, env: DistEnv, data_rank: int) -> list[Any]:
    """Per teacher, the student's end of its target stream (None for a colocated teacher)."""
    from crossdistill.distributed.streams import TargetStream, teacher_source

    layouts, resolved_t = run.layouts, run.resolved_t
    out: list[Any] = []
    for k, t in enumerate(run.teachers):
        if not layouts.separate[k]:
            out.append(None)
            continue
        start = env.role_start(layouts.role_of(k))
        source = teacher_source(data_rank, layouts.teachers[k], start)
        top_k = min(t.top_k, resolved_t[k].hf_config.vocab_size)  # as the teacher computes it
        timeout = cfg.train.teacher_timeout_s
        out.append(
            TargetStream(
                env.link, t.name, source, top_k, t.payload, t.temperature, timeout, t.target
            )
        )
    return out


def build_loaders(
    cfg: Config, tok_s, toks_t, rank: int, world_size: int, caches: list | None = None
) -> tuple[Any, Any]:
    """Train and validation loaders of this data-parallel rank (`caches`: per teacher, where
    it reads its targets from a cache)."""
    from crossdistill.data import build_loader

    kwargs = {"rank": rank, "world_size": world_size, "caches": caches}
    train_loader = build_loader(cfg.data, tok_s, toks_t, split="train", **kwargs)
    val_loader = build_loader(cfg.data, tok_s, toks_t, split="validation", **kwargs)
    return train_loader, val_loader

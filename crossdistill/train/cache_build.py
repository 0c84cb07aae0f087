"""Building a teacher cache (`crossdistill cache build`; the format itself:
`data.teacher_cache`; the command and the checks a run does before reading a cache:
`train.teacher_cache`).

A build runs each teacher of a config over the documents of its data section (train and
validation files, each distinct document once) and writes, per document, everything every loss
needs for any student tokenizer. Under `torchrun` the documents are dealt out over the ranks
(each runs the whole teacher on its share and writes its own shards); rank 0 writes the
manifest at the end. Documents are tokenized exactly as the trainer tokenizes them
(`data.units`: start tokens, text, document end); a document longer than `context` teacher
tokens is run in overlapping windows, each position's targets taken from a window that gives it
at least `context // 4` tokens of context (the trainer's live teacher sees only the packed
row's part of such a document, so cached targets of long documents have more context).

Resumable: shards are complete or absent (`ShardWriter`); a rerun skips the documents the
shards hold and writes the rest. The build's settings are recorded in `build.json` when it
starts, and a rerun with other settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crossdistill import __version__
from crossdistill.config import Config, TeacherConfig
from crossdistill.data.documents import BadInputPolicy, check_document, text_pieces
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.sources import Bad, open_source
from crossdistill.data.teacher_cache import (
    FORMAT,
    MANIFEST,
    SHARD_SUFFIX,
    SHARDS,
    DocTargets,
    Quantization,
    ShardWriter,
    document_key,
    encode_record,
    read_footer,
    read_manifest,
    shard_summary,
)
from crossdistill.data.units import chat_unit, text_unit
from crossdistill.distributed.layout import DistEnv, init_distributed
from crossdistill.errors import UserError
from crossdistill.losses import teacher_targets
from crossdistill.models import Teacher, build_causal_lm, load_tokenizer
from crossdistill.models.forward import final_hidden, packed_row
from crossdistill.models.loading import checkpoint_files, parse_dtype

LN2 = float(np.log(2.0))
BUILD = "build.json"


@dataclass(frozen=True)
class BuildOptions:
    """How a build runs. context: teacher tokens per forward window; batch_tokens: tokens per
    forward; shard_bytes: a shard is closed once it holds this much."""

    quantization: Quantization = "int8"
    context: int = 4096
    batch_tokens: int = 0  # 0: 16384 on a GPU, 2048 on a CPU (its attention mask is N²)
    shard_bytes: int = 256 << 20
    progress: bool = True


# ---------------------------------------------------------------- fingerprints


def weights_fingerprint(path: str | Path) -> str:
    """A sha256 over a checkpoint folder's `config.json` and, per weight file, its name, size
    and first and last MiB: another checkpoint (or a retrained one) gets another value, in
    milliseconds."""
    folder = Path(path)
    h = hashlib.sha256()
    config = folder / "config.json"
    if config.is_file():
        h.update(config.read_bytes())
    for f in checkpoint_files(folder):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def data_settings(cfg: Config) -> dict[str, Any]:
    """What decides how a document becomes teacher tokens."""
    chat = cfg.data.messages_field is not None
    return {
        "kind": "chat" if chat else "text",
        "field": cfg.data.messages_field if chat else cfg.data.text_field,
        "format": cfg.data.format,
        "loss_on": cfg.data.loss_on,
    }


# ---------------------------------------------------------------- documents


def corpus_files(cfg: Config) -> list[str]:
    return list(dict.fromkeys([*cfg.data.train, *cfg.data.validation]))


def iter_documents(cfg: Config, policy: BadInputPolicy):
    """`(key, document)` for each distinct good document of the data section, in file and row
    order."""
    settings = data_settings(cfg)
    seen: set[str] = set()
    for path in corpus_files(cfg):
        source = open_source(path, cfg.data.format, settings["field"])
        for lo in range(0, source.num_rows, 256):
            hi = min(lo + 256, source.num_rows)
            for row, value in zip(range(lo, hi), source.read(lo, hi)):
                if value is None:
                    continue
                doc = check_document(value, settings["kind"], settings["field"])
                if isinstance(doc, Bad):
                    policy(source.where(row), doc.reason)
                    continue
                key = document_key(doc)
                if key not in seen:
                    seen.add(key)
                    yield key, doc, source.where(row)


def teacher_tokens(
    doc: Any, side: TokenizerSide, loss_on: str
) -> tuple[np.ndarray, np.ndarray] | Bad:
    """A document's teacher tokens and the text bytes each covers, as the trainer makes them."""
    if isinstance(doc, str):
        pieces = text_pieces(doc)
        units = [
            text_unit(p, [side], first=i == 0, last=i == len(pieces) - 1)
            for i, p in enumerate(pieces)
        ]
    else:
        units = [chat_unit(doc, [side], loss_on)]
    for u in units:
        if isinstance(u, Bad):
            return u
    return (
        np.concatenate([u.ids_s for u in units]),
        np.concatenate([u.text_bytes_s for u in units]),
    )


def windows(n: int, context: int) -> list[tuple[int, int, int, int]]:
    """`(start, end, keep_from, keep_to)` forward windows over n tokens: positions
    `[keep_from, keep_to)` take their targets from window `[start, end)`; together the kept
    ranges cover `[0, n)` once, and every kept position but the first window's has at least
    `context // 4` tokens before it in its window."""
    if n <= context:
        return [(0, n, 0, n)]
    overlap = context // 4
    out, keep = [], 0
    while keep < n:
        start = max(0, keep - overlap)
        end = min(n, start + context)
        keep_to = n if end == n else end - 1  # the window's last position has no next token in it
        out.append((start, end, keep, keep_to))
        keep = keep_to
    return out


# ---------------------------------------------------------------- build


class _Job:
    """Documents waiting for one forward."""

    def __init__(self) -> None:
        self.docs: list[tuple[str, np.ndarray, np.ndarray]] = []
        self.tokens = 0


def build_cache(
    cfg: Config, folders: dict[int, Path], options: BuildOptions, env: DistEnv | None = None
) -> list[dict[str, Any]]:
    """Build teacher i's cache into `folders[i]` for each i given; returns each manifest."""
    env = env or init_distributed(cfg.train.device)
    out = []
    for i, folder in folders.items():
        out.append(_build_one(cfg, i, Path(folder), options, env))
    return out


def _build_one(
    cfg: Config, i: int, folder: Path, options: BuildOptions, env: DistEnv
) -> dict[str, Any]:
    t = cfg.teachers[i]
    if t.path is None:
        raise UserError(f"teachers.{i}: a cache is built from a checkpoint; set teachers.{i}.path")
    model = build_causal_lm(
        path=t.path,
        device=env.device,
        dtype=parse_dtype(t.dtype),
        overrides=t.overrides,
        attn_implementation=t.attn_implementation,
    )
    if t.compile:
        from crossdistill.distributed.parallelize import apply_compile

        apply_compile(model)
    teacher = Teacher(model, t.name)
    return build_teacher_cache(teacher, t, weights_fingerprint(t.path), cfg, folder, options, env)


def build_teacher_cache(
    teacher: Teacher,
    t: TeacherConfig,
    fingerprint: str,
    cfg: Config,
    folder: Path,
    options: BuildOptions,
    env: DistEnv,
) -> dict[str, Any]:
    """Run a loaded teacher over `cfg`'s data section into `folder` (see module doc); returns
    the manifest, with this process's build time and tokens under `build_seconds` and
    `build_tokens` (not stored)."""
    tok = load_tokenizer(t.tokenizer or t.path)
    side = TokenizerSide(tok)
    settings = {
        "format": FORMAT,
        "teacher": {"name": t.name, "path": str(t.path or t.arch), "fingerprint": fingerprint},
        "tokenizer": {"fingerprint": side.fingerprint, "name": side.name},
        "top_k": int(t.top_k),
        "temperature": float(t.temperature),
        "quantization": options.quantization,
        "dtype": t.dtype,
        "context": options.context,
        "data": data_settings(cfg),
    }
    done = _prepare(folder, settings, env, tok)
    top_k = min(int(t.top_k), teacher.lm_head_weight.shape[0])
    if top_k != t.top_k:
        raise UserError(f"teachers of {t.name}: top_k = {t.top_k} exceeds the vocabulary")
    writer = _Writer(folder, env.rank, options, settings)
    policy = BadInputPolicy(cfg.data.bad_input)
    mine = (
        (key, doc, where)
        for n, (key, doc, where) in enumerate(iter_documents(cfg, policy))
        if n % env.world_size == env.rank and key not in done
    )
    rows = sum(
        open_source(p, cfg.data.format, data_settings(cfg)["field"]).num_rows
        for p in corpus_files(cfg)
    )
    total = max(0, -(-rows // env.world_size) - len(done) // env.world_size)
    bar = _progress(total, t.name, options.progress and env.is_main)
    batch_tokens = options.batch_tokens or (16384 if env.device.type == "cuda" else 2048)
    started, tokens = time.perf_counter(), 0
    job = _Job()
    try:
        for key, doc, where in mine:
            made = teacher_tokens(doc, side, cfg.data.loss_on)
            if isinstance(made, Bad):
                policy(where, made.reason)
                continue
            job.docs.append((key, *made))
            job.tokens += made[0].size
            if job.tokens >= batch_tokens:
                tokens += _run(teacher, job, top_k, t.temperature, options, cfg, writer)
                bar.update(len(job.docs))
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - started):,.0f}")
                job = _Job()
        if job.docs:
            tokens += _run(teacher, job, top_k, t.temperature, options, cfg, writer)
            bar.update(len(job.docs))
        writer.finish()
    except BaseException:
        writer.abort()
        raise
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    if env.distributed:
        torch.distributed.barrier()
    if env.is_main:
        teacher.model.config.save_pretrained(folder)
        _write_manifest(folder, settings, cfg, policy.num_skipped)
    if env.distributed:
        torch.distributed.barrier()
    return {**read_manifest(folder), "build_seconds": seconds, "build_tokens": tokens}


def _prepare(folder: Path, settings: dict[str, Any], env: DistEnv, tok: Any) -> set[str]:
    """Create or check the folder; the keys its complete shards hold (rank 0 writes the
    tokenizer, config and `build.json`; every rank removes its own stale temporary files)."""
    shards = folder / SHARDS
    build = folder / BUILD
    if build.is_file():
        before = json.loads(build.read_text())
        diff = [k for k in settings if before.get(k) != settings[k]]
        if diff:
            raise UserError(
                f"{folder} holds a cache build with other settings ({', '.join(diff)} differ); "
                "give another folder, or delete this one to start over"
            )
    elif folder.exists() and any(folder.iterdir()):
        raise UserError(f"{folder} exists and is not a teacher cache; give an empty or new folder")
    if env.distributed:
        torch.distributed.barrier()  # every rank has looked before rank 0 writes
    if env.is_main:
        shards.mkdir(parents=True, exist_ok=True)
        (folder / MANIFEST).unlink(missing_ok=True)  # a resumed build writes it again at the end
        tok.save_pretrained(folder)
        build.write_text(json.dumps(settings, indent=1))
    if env.distributed:
        torch.distributed.barrier()
    for stale in shards.glob(f".r{env.rank:03d}-*.tmp"):
        stale.unlink()
    done: set[str] = set()
    for path in sorted(shards.glob(f"*{SHARD_SUFFIX}")):
        done.update(r[0] for r in read_footer(path)["records"])
    return done


@torch.no_grad()
def _run(
    teacher: Teacher,
    job: _Job,
    top_k: int,
    temperature: float,
    options: BuildOptions,
    cfg: Config,
    writer: _Writer,
) -> int:
    """One forward over the job's documents (windows packed into one row); hands each
    document's targets to the writer. Returns the tokens done."""
    pieces = []  # (doc index, window)
    for d, (_, ids, _) in enumerate(job.docs):
        pieces += [(d, w) for w in windows(ids.size, options.context)]
    device = teacher.device
    parts = [job.docs[d][1][s:e] for d, (s, e, _, _) in pieces]
    x, p, segments = packed_row(parts, device)
    starts = np.cumsum([0] + [len(part) for part in parts])[:-1]
    nxt = np.full(x.shape[1], -1, dtype=np.int64)  # the next token within each window
    for part, a in zip(parts, starts):
        nxt[a : a + len(part) - 1] = part[1:]
    autocast = device.type == "cuda" and teacher.dtype == torch.float32
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = final_hidden(teacher.model, x, p, segments).flatten(0, 1)
    out = teacher_targets(
        hidden,
        teacher.lm_head_weight,
        torch.arange(x.shape[1], device=device),
        torch.from_numpy(nxt).to(device),
        top_k=top_k,
        temperature=temperature,
        chunk_size=cfg.train.loss_chunk_size,
    )
    host = {
        "top_ids": out.topk_ids.cpu().numpy(),
        "top_lp": out.topk_logprobs.float().cpu().numpy(),
        "tail": out.tail_logprob.float().cpu().numpy(),
        "next": out.next_logprobs.float().cpu().numpy(),
    }
    rows: dict[int, list[np.ndarray]] = {}
    for (d, (s, _, keep_from, keep_to)), a in zip(pieces, starts):
        rows.setdefault(d, []).append(np.arange(a + keep_from - s, a + keep_to - s))
    for d, (key, doc_ids, text_bytes) in enumerate(job.docs):
        take = np.concatenate(rows[d])
        writer.put(
            key,
            DocTargets(
                doc_ids,
                text_bytes,
                host["next"][take],
                host["top_ids"][take],
                host["top_lp"][take],
                host["tail"][take],
            ),
        )
    return int(x.shape[1])


class _Writer:
    """Encodes and writes records on a thread of its own (compression overlaps the next
    forward); shards are closed at `shard_bytes`."""

    def __init__(self, folder: Path, rank: int, options: BuildOptions, settings: dict[str, Any]):
        self.folder = folder / SHARDS
        self.rank = rank
        self.options = options
        self.quantization = options.quantization
        taken = [int(p.stem.rsplit("-", 1)[-1]) for p in self.folder.glob(f"r{rank:03d}-*")]
        self.next_number = max(taken, default=-1) + 1
        self.shard: ShardWriter | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=64)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def put(self, key: str, targets: DocTargets) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put((key, targets))

    def finish(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error

    def abort(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        if self.shard is not None:
            self.shard.abort()

    def _loop(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                if self.error is None:
                    self._write(*item)
            if self.shard is not None and self.error is None:
                self.shard.close()
                self.shard = None
        except BaseException as e:  # re-raised on the main thread
            self.error = e
            if self.shard is not None:
                self.shard.abort()
                self.shard = None
            while self.queue.get() is not None:  # let the main thread finish putting
                pass

    def _write(self, key: str, t: DocTargets) -> None:
        if self.shard is None:
            name = f"r{self.rank:03d}-{self.next_number:06d}{SHARD_SUFFIX}"
            self.next_number += 1
            self.shard = ShardWriter(self.folder / name)
        blob, raw = encode_record(t, self.quantization)
        nll = float(-t.next_logprobs[:-1].astype(np.float64).sum())
        self.shard.add(key, blob, raw, t.num_tokens, nll, int(t.text_bytes[1:].sum()))
        if self.shard.num_bytes >= self.options.shard_bytes:
            self.shard.close()
            self.shard = None


def _write_manifest(
    folder: Path, settings: dict[str, Any], cfg: Config, skipped: int
) -> dict[str, Any]:
    shards = [
        shard_summary(p, read_footer(p)) for p in sorted((folder / SHARDS).glob(f"*{SHARD_SUFFIX}"))
    ]
    nll = sum(s["nll"] for s in shards)
    nbytes = sum(s["text_bytes"] for s in shards)
    manifest = {
        **settings,
        "code_version": __version__,
        "corpus": [_file_info(p) for p in corpus_files(cfg)],
        "docs": sum(s["docs"] for s in shards),
        "tokens": sum(s["tokens"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "skipped_documents": skipped,
        "teacher_bpb": nll / LN2 / max(nbytes, 1),
        "shards": shards,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)
    return manifest


def _file_info(path: str) -> dict[str, Any]:
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file())
    h = hashlib.sha256()
    size = 0
    for f in files:
        size += f.stat().st_size
        h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{f.stat().st_size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
    return {"path": str(path), "bytes": size, "fingerprint": h.hexdigest()[:16]}


def _progress(total: int, name: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=total, desc=f"cache {name}", unit="doc", disable=not enabled, dynamic_ncols=True
    )

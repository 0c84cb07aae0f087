"""`crossdistill cache build` and `inspect`, and the checks a run does before it trains from a
cache (the format itself: `data.teacher_cache`).

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

import argparse
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
    CachedTeacher,
    CacheReader,
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
from crossdistill.models import Teacher, build_causal_lm, load_tokenizer, tokenizer_fingerprint
from crossdistill.models.forward import final_hidden
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


def _data_settings(cfg: Config) -> dict[str, Any]:
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
    settings = _data_settings(cfg)
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
        "data": _data_settings(cfg),
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
        open_source(p, cfg.data.format, _data_settings(cfg)["field"]).num_rows
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
    ids = np.concatenate([job.docs[d][1][s:e] for d, (s, e, _, _) in pieces])
    pos = np.concatenate([np.arange(e - s) for _, (s, e, _, _) in pieces])
    lengths = np.asarray([e - s for _, (s, e, _, _) in pieces])
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    nxt = np.full(ids.size, -1, dtype=np.int64)
    for (_, (s, e, _, _)), a in zip(pieces, cu[:-1]):
        nxt[a : a + e - s - 1] = ids[a + 1 : a + e - s]
    x = torch.from_numpy(ids).view(1, -1).to(device)
    p = torch.from_numpy(pos).view(1, -1).to(device)
    segments = (torch.from_numpy(cu).to(device), int(lengths.max()))
    autocast = device.type == "cuda" and teacher.dtype == torch.float32
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = final_hidden(teacher.model, x, p, segments).flatten(0, 1)
    out = teacher_targets(
        hidden,
        teacher.lm_head_weight,
        torch.arange(ids.size, device=device),
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
    for (d, (s, _, keep_from, keep_to)), a in zip(pieces, cu[:-1]):
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
    return int(ids.size)


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


# ---------------------------------------------------------------- training from a cache


def open_cache(t: TeacherConfig, i: int, cfg: Config, tok: Any) -> CachedTeacher:
    """Teacher i's cache, checked against the run before anything loads: the teacher (when
    `path` is also given), tokenizer, top_k, temperature and data settings."""
    reader = CacheReader(t.cache)
    m = reader.manifest
    where = f"teachers.{i}.cache = {t.cache}"
    checks = [
        (
            m["tokenizer"]["fingerprint"] == tokenizer_fingerprint(tok),
            f"was built with another tokenizer ({m['tokenizer']['name']}) than teachers.{i}'s",
        ),
        (
            t.top_k <= m["top_k"],
            f"holds top_k = {m['top_k']}, fewer than teachers.{i}.top_k = {t.top_k}: lower "
            f"top_k or rebuild the cache",
        ),
        (
            abs(float(m["temperature"]) - t.temperature) < 1e-12,
            f"was built at temperature {m['temperature']}, teachers.{i}.temperature is "
            f"{t.temperature}: set it to {m['temperature']} or rebuild the cache",
        ),
        (
            m["data"]["kind"] == _data_settings(cfg)["kind"]
            and m["data"]["field"] == _data_settings(cfg)["field"],
            f"was built over data read as {m['data']['kind']} field {m['data']['field']!r}, this "
            f"run reads {_data_settings(cfg)['kind']} field {_data_settings(cfg)['field']!r}",
        ),
    ]
    if t.path is not None:
        checks.append(
            (
                m["teacher"]["fingerprint"] == weights_fingerprint(t.path),
                f"was built from another teacher ({m['teacher']['path']}) than teachers.{i}.path "
                f"= {t.path}: rebuild it, or drop teachers.{i}.path",
            )
        )
    for ok, message in checks:
        if not ok:
            raise UserError(f"{where} {message}")
    return CachedTeacher(reader, int(t.top_k), t.name)


def check_coverage(cfg: Config, caches: list[CachedTeacher | None]) -> None:
    """Under `data.bad_input = error`, refuse before training a corpus document some cache
    lacks (one pass over the corpus, hashing each document); under `skip` the loader skips
    such documents and counts them."""
    readers = [c for c in caches if c is not None]
    if not readers or cfg.data.bad_input != "error":
        return
    for key, _, where in iter_documents(cfg, BadInputPolicy("error")):
        for c in readers:
            if key not in c.reader:
                raise UserError(
                    f"{where}: not in teacher {c.name}'s cache {c.reader.folder}; rebuild the "
                    "cache over this data section, or set data.bad_input=skip to leave out the "
                    "documents it lacks (counted)"
                )


# ---------------------------------------------------------------- inspect


def inspect_cache(
    folder: str | Path, verify: bool = True, cfg: Config | None = None
) -> dict[str, Any]:
    """What `crossdistill cache inspect` prints: the manifest's settings and totals, bytes per
    token, the teacher's bits per byte on the cached text, (with `verify`) every shard's
    checksum, and (with a training config `cfg`) the share of its documents the cache holds."""
    folder = Path(folder)
    m = read_manifest(folder)
    coverage = {}
    if cfg is not None:
        index = CacheReader(folder).index
        total = held = 0
        for key, _, _ in iter_documents(cfg, BadInputPolicy("skip")):
            total += 1
            held += key in index
        coverage = {"config_documents": total, "coverage": held / max(total, 1)}
    damaged = []
    if verify:
        from crossdistill.data.teacher_cache import _file_crc

        for s in m["shards"]:
            path = folder / SHARDS / s["file"]
            if not path.is_file() or _file_crc(path) != s["crc"]:
                damaged.append(s["file"])
    return {
        "folder": str(folder),
        "teacher": m["teacher"],
        "tokenizer": m["tokenizer"]["name"],
        "top_k": m["top_k"],
        "temperature": m["temperature"],
        "quantization": m["quantization"],
        "context": m["context"],
        "data": m["data"],
        "corpus": m["corpus"],
        "documents": m["docs"],
        "skipped_documents": m["skipped_documents"],
        "tokens": m["tokens"],
        "bytes": m["bytes"],
        "bytes_per_token": m["bytes"] / max(m["tokens"], 1),
        "teacher_bpb": m["teacher_bpb"],
        "shards": len(m["shards"]),
        "damaged_shards": damaged,
        "code_version": m["code_version"],
        "created": m["created"],
        **coverage,
    }


def add_cache_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "cache",
        help="run teachers once over a corpus and store their targets (teacher cache)",
        description=(
            "build: run each teacher of a training config over its data section once and write\n"
            "its targets; train from them with teachers.N.cache=DIR. inspect: what a cache holds."
        ),
        epilog=(
            "examples:\n"
            "  crossdistill cache build cfg.yaml --out caches/          # caches/<teacher name>/\n"
            "  torchrun --nproc-per-node 8 -m crossdistill cache build cfg.yaml --out caches/\n"
            "  crossdistill cache inspect caches/qwen3-4b\n"
            "  crossdistill train cfg.yaml teachers.0.cache=caches/qwen3-4b\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    b = sub.add_parser("build", help="build caches from a training config")
    b.add_argument("config", help="YAML config (its teachers and data sections are used)")
    b.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    b.add_argument("--out", required=True, help="folder; each teacher goes to OUT/<name>")
    b.add_argument("--teacher", action="append", help="only this teacher (by name; repeatable)")
    b.add_argument("--quantization", choices=["int8", "none"], default="int8")
    b.add_argument("--context", type=int, default=4096, help="teacher tokens per window")
    b.add_argument(
        "--batch-tokens",
        type=int,
        default=0,
        help="tokens per forward (default: 16384 on a GPU, 2048 on a CPU)",
    )
    b.set_defaults(func=_run_build)
    i = sub.add_parser("inspect", help="print what a cache holds")
    i.add_argument("folder")
    i.add_argument("--json", action="store_true")
    i.add_argument("--no-verify", action="store_true", help="skip the shard checksums")
    i.add_argument(
        "--config", help="a training config: report the share of its documents the cache holds"
    )
    i.add_argument("overrides", nargs="*", help="key.sub=value overrides of --config")
    i.set_defaults(func=_run_inspect)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _run_build(args: argparse.Namespace) -> int:
    from crossdistill.config import load_config

    cfg = load_config(args.config, args.overrides)
    names = [t.name for t in cfg.teachers]
    wanted = args.teacher or names
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise UserError(f"no teacher named {', '.join(unknown)} in {args.config} (it has {names})")
    if args.context < 16 or args.batch_tokens < 0:
        raise UserError("--context must be >= 16 and --batch-tokens >= 0")
    folders = {i: Path(args.out) / t.name for i, t in enumerate(cfg.teachers) if t.name in wanted}
    options = BuildOptions(args.quantization, args.context, args.batch_tokens)
    for m in build_cache(cfg, folders, options):
        if m:
            print(
                f"{m['teacher']['name']}: {m['docs']:,} documents, {m['tokens']:,} tokens, "
                f"{m['bytes'] / max(m['tokens'], 1):.1f} bytes/token, teacher "
                f"{m['teacher_bpb']:.4f} bits/byte"
            )
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from crossdistill.config import load_config

    cfg = load_config(args.config, args.overrides) if args.config else None
    info = inspect_cache(args.folder, verify=not args.no_verify, cfg=cfg)
    if args.json:
        print(json.dumps(info, indent=1))
    else:
        for key, value in info.items():
            print(f"{key:20s} {value}")
    return 1 if info["damaged_shards"] else 0

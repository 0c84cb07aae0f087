"""`crossdistill cache build` and `inspect`, and the checks a run does before it trains from a
cache: the teacher, tokenizer, top_k, temperature and data fields against the manifest
(`open_cache`), and under `data.bad_input: error` every corpus document against the index
(`check_coverage`). The build itself: `train.cache_build`; the format: `data.teacher_cache`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from crossdistill.config import Config, TeacherConfig
from crossdistill.data.documents import BadInputPolicy
from crossdistill.data.teacher_cache import (
    SHARDS,
    CachedTeacher,
    CacheReader,
    file_crc,
    read_manifest,
)
from crossdistill.errors import UserError
from crossdistill.losses import reads_past_end, target_depth
from crossdistill.models import tokenizer_fingerprint
from crossdistill.train.cache_build import (
    BuildOptions,
    build_cache,
    data_settings,
    iter_documents,
    weights_fingerprint,
)

# ---------------------------------------------------------------- training from a cache


def open_cache(t: TeacherConfig, i: int, cfg: Config, tok: Any) -> CachedTeacher:
    """Teacher i's cache, checked against the run before anything loads: the teacher (when
    `path` is also given), tokenizer, top_k, temperature and data settings. `t.target` is the
    resolved one (not `auto`): it sets the rows per chunk the loader reads."""
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
            m["data"]["kind"] == data_settings(cfg)["kind"]
            and m["data"]["field"] == data_settings(cfg)["field"],
            f"was built over data read as {m['data']['kind']} field {m['data']['field']!r}, this "
            f"run reads {data_settings(cfg)['kind']} field {data_settings(cfg)['field']!r}",
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
    return CachedTeacher(  # the rows a cross-tokenizer teacher's target reads
        reader,
        int(t.top_k),
        t.name,
        depth=target_depth(t.target, same_as_student=False),
        past_end=reads_past_end(t.target, same_as_student=False),
    )


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
        for s in m["shards"]:
            path = folder / SHARDS / s["file"]
            if not path.is_file() or file_crc(path) != s["crc"]:
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

"""Where a teacher-cache build spends its time, against the teacher's bare forward.

One random-init teacher of a preset's shape over this machine's Python sources, packed as the
build packs them (`--batch-tokens` per forward). Times, per token: the bare forward (body and
lm_head logits), the forward plus the targets at every row (top-k, tail, next-token log-prob),
the same plus the copy to the host, and the whole build (`build_teacher_cache`: tokenizing,
forward, targets, copy, encoding and writing on its thread). Prints one JSON line.

    python benchmarks/cache_build_split.py --teacher phi-4-mini --tokenizer $TOK/phi-4-mini/hf
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from crossdistill.bench.step_cache import bare_forward, corpus_rows, timed_rate
from crossdistill.config import Config, DataConfig, TeacherConfig, TrainConfig
from crossdistill.distributed.layout import DistEnv
from crossdistill.losses import teacher_targets
from crossdistill.models import Teacher, build_causal_lm
from crossdistill.models.forward import final_hidden, packed_row
from crossdistill.train.cache_build import BuildOptions, build_teacher_cache
from crossdistill.train.demo_assets import stdlib_corpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default="phi-4-mini")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--corpus-bytes", type=int, default=3_000_000)
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--compile", action="store_true", help="compile the teacher's blocks")
    args = p.parse_args()
    device = torch.device("cuda")
    work = Path(tempfile.mkdtemp(prefix="cache-split-"))
    train, _ = stdlib_corpus(max_files=3000, train_bytes=args.corpus_bytes, val_bytes=1)
    corpus = work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in train))
    tcfg = TeacherConfig(name="t", arch=args.teacher, tokenizer=args.tokenizer, top_k=args.top_k)
    cfg = Config(
        teachers=[tcfg],
        data=DataConfig(train=[str(corpus)], validation=[]),
        train=TrainConfig(loss_chunk_size=4096, device="cuda"),
    )
    model = build_causal_lm(arch=args.teacher, device=device, dtype=torch.bfloat16, seed=0)
    if args.compile:
        from crossdistill.distributed.parallelize import apply_compile

        apply_compile(model)
    teacher = Teacher(model, "t")
    t0 = time.perf_counter()
    rows = corpus_rows(cfg, tcfg, args.batch_tokens, max_tokens=1 << 62)
    tokenize_s = time.perf_counter() - t0
    weight = teacher.lm_head_weight

    @torch.no_grad()
    def targets(parts, to_host=False):
        ids, pos, seg = packed_row(parts, device)
        h = final_hidden(model, ids, pos, seg).flatten(0, 1)
        n = ids.numel()
        nxt = torch.cat([ids.view(-1)[1:], ids.new_full((1,), -1)])
        out = teacher_targets(h, weight, torch.arange(n, device=device), nxt, args.top_k, 1.0, 4096)
        if to_host:
            _ = [t.cpu() for t in out.tensors().values()]
        return n

    def timed(fn) -> float:
        return timed_rate(fn, rows, device)

    result = {
        "device": torch.cuda.get_device_name(),
        "teacher": args.teacher,
        "batch_tokens": args.batch_tokens,
        "compile": args.compile,
        "tokens": int(sum(len(x) for r in rows for x in r)),
        "tokenize_tokens_per_s": sum(x.size for r in rows for x in r) / tokenize_s,
        "bare_forward_tokens_per_s": timed(lambda r: bare_forward(teacher, r, 4096)),
        "forward_targets_tokens_per_s": timed(targets),
        "forward_targets_host_tokens_per_s": timed(lambda r: targets(r, True)),
    }
    m = build_teacher_cache(
        teacher, tcfg, "random-init", cfg, work / "cache", BuildOptions(progress=False),
        DistEnv(device=device),
    )  # fmt: skip
    result["build_tokens_per_s"] = m["build_tokens"] / m["build_seconds"]
    result["build_fraction_of_bare"] = (
        result["build_tokens_per_s"] / result["bare_forward_tokens_per_s"]
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()

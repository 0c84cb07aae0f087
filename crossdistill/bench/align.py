"""`crossdistill bench align`: alignment speed against the DP fallback, the JSONL pipeline's
cost over tokenization alone, projection build time and memory, and the table over every
ordered pair of the real tokenizers on a mixed corpus."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECTIONS = ("speed", "jsonl", "projection", "pairs")
NAMES = ["qwen2.5", "qwen3", "llama3", "llama2", "mistral", "gpt2", "phi-4", "phi-4-mini"]
# (student, teacher) pairs timed on 4k-token documents, for at least this much CPU time each.
SPEED_PAIRS = [("llama3", "qwen3"), ("llama3", "phi-4-mini"), ("llama2", "qwen3")]
SPEED_SECONDS = 1.0
# (teacher, student) projections whose build is timed.
PROJECTION_PAIRS = [("qwen3", "llama3"), ("phi-4-mini", "llama3")]

EXAMPLES = """examples:
  crossdistill bench align                       # all sections, markdown tables
  crossdistill bench align --sections speed --json
  CROSSDISTILL_TOKENIZERS=/data/tokenizers crossdistill bench align --sections pairs

Tokenizers are read from <dir>/<name>/hf for the eight names qwen2.5, qwen3, llama3, llama2,
mistral, gpt2, phi-4, phi-4-mini; <dir> is --tokenizers, else $CROSSDISTILL_TOKENIZERS, else
../shared/tokenizers beside the repository.
"""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "align",
        help="alignment, JSONL pipeline, projection build and 8x8 tokenizer-pair table",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tokenizers", type=Path, help="folder holding <name>/hf tokenizers")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    p.add_argument("--docs", type=int, default=16, help="4k-token documents per timed pair")
    p.add_argument("--pair-texts", type=int, default=350, help="mixed-corpus texts per pair")
    p.set_defaults(func=run)


def tokenizers_dir(given: Path | None) -> Path:
    from crossdistill.errors import UserError

    root = given or Path(
        os.environ.get(
            "CROSSDISTILL_TOKENIZERS",
            Path(__file__).resolve().parents[2].parent / "shared" / "tokenizers",
        )
    )
    if not (root / "llama3" / "hf").is_dir():
        raise UserError(
            f"no tokenizers at {root}: give --tokenizers DIR (or set CROSSDISTILL_TOKENIZERS) "
            "holding <name>/hf folders for " + ", ".join(NAMES)
        )
    return root


def run(args: argparse.Namespace) -> int:
    from crossdistill.errors import UserError

    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise UserError(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    root = tokenizers_dir(args.tokenizers)
    report: dict = {"machine": machine()}
    runners = {
        "speed": lambda: bench_speed(root, args.docs),
        "jsonl": lambda: bench_jsonl(root),
        "projection": lambda: bench_projection(root),
        "pairs": lambda: bench_pairs(root, args.pair_texts),
    }
    for name in sections:
        report[name] = runners[name]()
        if not args.json:
            print(render(name, report[name]), flush=True)
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import tokenizers

    from crossdistill.data.aligned import available_cores

    return {
        "cpu": cpu,
        "cores": available_cores(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "tokenizers": tokenizers.__version__,
    }


def _load(root: Path, name: str):
    from crossdistill.alignment import TokenBytes
    from crossdistill.models import load_tokenizer

    tok = load_tokenizer(str(root / name / "hf"))
    return tok, TokenBytes.from_tokenizer(tok)


def _documents(tok_s, tok_t, text: str, num_docs: int, length: int = 4096):
    """Cut `text` into `num_docs` pieces of `length` student tokens; tokenize each both ways."""
    enc = tok_s.backend_tokenizer.encode(text, add_special_tokens=False)
    offsets = enc.offsets
    docs = []
    for k in range(0, len(offsets) - length, length):
        piece = text[offsets[k][0] : offsets[k + length][0]]
        docs.append((tok_s(piece)["input_ids"], tok_t(piece)["input_ids"]))
        if len(docs) == num_docs:
            break
    return docs


def _one_core():
    """Pin to one core while timing single-core throughput; returns the old affinity."""
    try:
        old = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(old)})
        return old
    except (AttributeError, OSError):
        return None


def bench_speed(root: Path, num_docs: int) -> list[dict]:
    import numpy as np

    from crossdistill.alignment.sample_text import stdlib_sources

    text = "".join(stdlib_sources(limit_bytes=3_000_000))
    rows = []
    for student, teacher in SPEED_PAIRS:
        tok_s, bytes_s = _load(root, student)
        tok_t, bytes_t = _load(root, teacher)
        docs = [(np.asarray(a), np.asarray(b)) for a, b in _documents(tok_s, tok_t, text, num_docs)]
        old = _one_core()
        try:
            timed = _time_alignment(docs, bytes_s, bytes_t, min_seconds=SPEED_SECONDS)
        finally:
            if old is not None:
                os.sched_setaffinity(0, old)
        tokens_s = sum(len(a) for a, _ in docs)
        tokens_t = sum(len(b) for _, b in docs)
        best, best_cpu, best_batch = timed["best"], timed["best_cpu"], timed["best_batch"]
        rows.append(
            {
                "student": student,
                "teacher": teacher,
                "docs": len(docs),
                "passes": timed["passes"],
                "student_tokens": tokens_s,
                "teacher_tokens": tokens_t,
                "ms_per_doc": 1e3 * best / len(docs),
                "student_tokens_per_s": tokens_s / best,
                "all_tokens_per_s": (tokens_s + tokens_t) / best,
                "cpu_ms_per_doc": 1e3 * best_cpu / len(docs),
                "student_tokens_per_cpu_s": tokens_s / best_cpu,
                "batch_cpu_ms_per_doc": 1e3 * best_batch / len(docs),
                "batch_student_tokens_per_cpu_s": tokens_s / best_batch,
                "dp_ms_per_doc": 1e3 * timed["dp"] / len(docs),
                "speedup_vs_dp": timed["dp"] / best,
                "speedup_vs_dp_cpu": timed["dp_cpu"] / best_cpu,
                "identical_to_dp": timed["identical_to_dp"],
                "batch_identical": timed["batch_identical"],
                "fallback_positions": timed["fallback_positions"],
            }
        )
    return rows


def _time_alignment(docs, bytes_s, bytes_t, passes: int = 7, min_seconds: float = 0.0) -> dict:
    """Best pass over the documents, as wall time and as this thread's CPU time (the machine
    may be shared: CPU time is what one core spends), `align` text by text and `align_batch`
    on all of them, interleaved; at least `passes` passes and `min_seconds` of CPU time (load
    from other tenants comes and goes over seconds). Then the DP once."""
    import numpy as np

    from crossdistill.alignment import align, align_batch, align_dp

    fast = [align(a, b, bytes_s, bytes_t) for a, b in docs]  # warm-up, and the result
    batch_s, batch_t = [a for a, _ in docs], [b for _, b in docs]
    out = {"best": float("inf"), "best_cpu": float("inf"), "best_batch": float("inf")}
    done, spent = 0, 0.0
    while done < passes or spent < min_seconds:
        start, start_cpu = time.perf_counter(), time.thread_time()
        pass_start = start_cpu
        for a, b in docs:
            align(a, b, bytes_s, bytes_t)
        out["best"] = min(out["best"], time.perf_counter() - start)
        out["best_cpu"] = min(out["best_cpu"], time.thread_time() - start_cpu)
        # The same documents as one batch, the way a collator calls it.
        start_cpu = time.thread_time()
        batched = align_batch(batch_s, batch_t, bytes_s, bytes_t)
        out["best_batch"] = min(out["best_batch"], time.thread_time() - start_cpu)
        done, spent = done + 1, spent + time.thread_time() - pass_start
    out["passes"] = done
    start, start_cpu = time.perf_counter(), time.thread_time()
    slow = [align_dp(a, b, bytes_s, bytes_t) for a, b in docs]
    out["dp"], out["dp_cpu"] = time.perf_counter() - start, time.thread_time() - start_cpu
    out["identical_to_dp"] = all(np.array_equal(x.chunks, y.chunks) for x, y in zip(fast, slow))
    out["batch_identical"] = all(np.array_equal(x.chunks, y.chunks) for x, y in zip(fast, batched))
    out["fallback_positions"] = sum(x.num_fallback for x in fast)
    return out


def bench_jsonl(root: Path, student: str = "llama3", teacher: str = "qwen3") -> dict:
    """Tokenize only, tokenize + align, and the full command (JSON written), on one file of
    standard-library sources (a line per module, split into 16k-character pieces)."""
    from crossdistill.alignment.sample_text import stdlib_sources
    from crossdistill.data.aligned import Pipeline, process_file

    pipeline = Pipeline.load(str(root / student / "hf"), str(root / teacher / "hf"))
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "stdlib.jsonl"
        num_chars = 0
        with open(source, "w", encoding="utf-8") as f:
            for module in stdlib_sources(limit_bytes=6_000_000):
                for k in range(0, len(module), 16_000):
                    f.write(json.dumps({"text": module[k : k + 16_000]}) + "\n")
                    num_chars += len(module[k : k + 16_000])
        seconds: dict[str, float] = {}
        cpu: dict[str, float] = {}
        for _ in range(2):  # interleaved, best of two, so that load changes hit all stages
            for stage in ("tokenize", "align", "full"):
                out = Path(tmp) / "out.jsonl" if stage == "full" else None
                result = process_file(pipeline, source, out, stage=stage)
                seconds[stage] = min(seconds.get(stage, float("inf")), result["seconds"])
                if stage == "full":
                    cpu = result["cpu_seconds"]
        lines = result["lines"]
    return {
        "student": student,
        "teacher": teacher,
        "texts": lines,
        "characters": num_chars,
        "workers": result["workers"],
        "seconds": seconds,
        "cpu_seconds": cpu,
        "align_overhead_wall": seconds["align"] / seconds["tokenize"] - 1.0,
        "full_overhead_wall": seconds["full"] / seconds["tokenize"] - 1.0,
        "align_overhead_cpu": cpu["align"] / cpu["tokenize"],
    }


_BUILD_SCRIPT = """
import json, resource, sys, time
start = time.perf_counter()
from crossdistill.models import load_tokenizer
from crossdistill.alignment.projection import build_projection
tok_t, tok_s = load_tokenizer(sys.argv[1]), load_tokenizer(sys.argv[2])
loaded = time.perf_counter()
projection = build_projection(tok_t, tok_s)
built = time.perf_counter()
projection.save(sys.argv[3])
stats = projection.stats()
stats.update(load_s=loaded - start, build_s=built - loaded, total_s=time.perf_counter() - start,
             peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
print(json.dumps(stats))
"""


def bench_projection(root: Path) -> list[dict]:
    """Each build in a fresh process, so that its peak memory is its own."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for teacher, student in PROJECTION_PAIRS:
            out = Path(tmp) / f"{teacher}_to_{student}.safetensors"
            args = [str(root / teacher / "hf"), str(root / student / "hf"), str(out)]
            proc = subprocess.run(
                [sys.executable, "-c", _BUILD_SCRIPT, *args],
                capture_output=True,
                text=True,
                check=True,
            )
            stats = json.loads(proc.stdout.strip().splitlines()[-1])
            stats.update(teacher=teacher, student=student, file_mb=out.stat().st_size / 2**20)
            rows.append(stats)
    return rows


def bench_pairs(root: Path, num_texts: int) -> list[dict]:
    import numpy as np

    from crossdistill.alignment import align
    from crossdistill.alignment.projection import exact_match_mask
    from crossdistill.alignment.sample_text import mixed_corpus

    texts = [text for _, text in mixed_corpus(num_texts)]
    loaded = {name: _load(root, name) for name in NAMES}
    ids = {
        name: [e.ids for e in tok.backend_tokenizer.encode_batch_fast(texts)]
        for name, (tok, _) in loaded.items()
    }
    rows = []
    for student in NAMES:
        for teacher in NAMES:
            bytes_s, bytes_t = loaded[student][1], loaded[teacher][1]
            chunks, fallback, inexact = [], 0, 0
            for a, b in zip(ids[student], ids[teacher]):
                result = align(a, b, bytes_s, bytes_t)
                chunks.append(result.chunks)
                fallback += result.num_fallback
                inexact += int((~result.exact).sum())
            every = np.concatenate(chunks)
            len_s, len_t = every[:, 1] - every[:, 0], every[:, 3] - every[:, 2]
            text_t = bytes_t.lengths > 0
            exact = exact_match_mask(bytes_t, bytes_s)
            rows.append(
                {
                    "student": student,
                    "teacher": teacher,
                    "chunks": int(every.shape[0]),
                    "one_to_one": float(((len_s == 1) & (len_t == 1)).mean()),
                    "mean_tokens_s": float(len_s.mean()),
                    "mean_tokens_t": float(len_t.mean()),
                    "fallback_positions": fallback,
                    "inexact_chunks": inexact,
                    "projection_exact": float(exact[text_t].mean()),
                }
            )
    return rows


def render(section: str, data) -> str:
    """A markdown table for one section."""
    if section == "speed":
        head = (
            "| student | teacher | docs | ms/doc | student tok/s | student+teacher tok/s "
            "| CPU ms/doc | student tok/CPU-s | batch: CPU ms/doc | batch: student tok/CPU-s "
            "| DP ms/doc | speed-up vs DP (wall / CPU) | same chunks as DP / batch |"
        )
        lines = [
            f"| {r['student']} | {r['teacher']} | {r['docs']} | {r['ms_per_doc']:.3f} | "
            f"{r['student_tokens_per_s'] / 1e6:.1f} M | {r['all_tokens_per_s'] / 1e6:.1f} M | "
            f"{r['cpu_ms_per_doc']:.3f} | {r['student_tokens_per_cpu_s'] / 1e6:.1f} M | "
            f"{r['batch_cpu_ms_per_doc']:.3f} | "
            f"{r['batch_student_tokens_per_cpu_s'] / 1e6:.1f} M | "
            f"{r['dp_ms_per_doc']:.1f} | {r['speedup_vs_dp']:.0f}x / {r['speedup_vs_dp_cpu']:.0f}x "
            f"| {r['identical_to_dp']} / {r['batch_identical']} |"
            for r in data
        ]
        passes = min((r.get("passes", 7) for r in data), default=7)
        title = (
            "### Alignment of 4k-token documents, one core "
            f"(best of {passes}+ passes, interleaved, over {SPEED_SECONDS:g} s per pair)"
        )
        return "\n".join([title, head, _rule(head), *lines, ""])
    if section == "jsonl":
        s, c = data["seconds"], data["cpu_seconds"]
        return (
            f"### `crossdistill align` on JSONL ({data['texts']} texts, {data['characters']:,} "
            f"characters, {data['workers']} workers, {data['student']} / {data['teacher']})\n"
            "| | tokenize only | tokenize + align | full (JSON written) |\n|---|---|---|---|\n"
            f"| wall s | {s['tokenize']:.2f} | {s['align']:.2f} | {s['full']:.2f} |\n"
            f"| CPU s, summed over workers (full run) | {c['tokenize']:.2f} | "
            f"+{c['align']:.2f} align | +{c['json']:.2f} JSON |\n\n"
            f"Alignment adds {data['align_overhead_cpu']:.1%} to the tokenizers' CPU time "
            f"(wall: {data['align_overhead_wall']:+.1%}; with JSON written "
            f"{data['full_overhead_wall']:+.1%}).\n"
        )
    if section == "projection":
        head = "| teacher -> student | shape | load s | build s | total s | peak RSS GB | exact share | file MB |"
        lines = [
            f"| {r['teacher']} -> {r['student']} | {r['vocab_t']} x {r['vocab_s']} | "
            f"{r['load_s']:.1f} | {r['build_s']:.1f} | {r['total_s']:.1f} | "
            f"{r['peak_rss_gb']:.2f} | {r['exact_share']:.1%} | {r['file_mb']:.1f} |"
            for r in data
        ]
        return "\n".join(
            ["### Projection build (fresh process each)", head, _rule(head), *lines, ""]
        )
    head = "| student | teacher | chunks | 1:1 share | tokens/chunk s | tokens/chunk t | fallback positions | inexact chunks | projection exact (t->s) |"
    lines = [
        f"| {r['student']} | {r['teacher']} | {r['chunks']} | {r['one_to_one']:.1%} | "
        f"{r['mean_tokens_s']:.2f} | {r['mean_tokens_t']:.2f} | {r['fallback_positions']} | "
        f"{r['inexact_chunks']} | {r['projection_exact']:.1%} |"
        for r in data
    ]
    return "\n".join(["### Every ordered pair, mixed corpus", head, _rule(head), *lines, ""])


def _rule(head: str) -> str:
    return "|" + "---|" * (head.count("|") - 1)

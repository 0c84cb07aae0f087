"""`crossdistill audit STUDENT_TOKENIZER TEACHER_TOKENIZER`: how well a tokenizer pair aligns on
the user's text, and what to expect from distilling across it, before any GPU hour is spent.

The text is encoded exactly as training encodes a document (start tokens, text, document end)
and aligned into chunks (`alignment.align_batch`). Reported:

- `one_to_one_share`: chunks of one token on each side; `mean_chunk_tokens_{student,teacher}`;
- `chunk_start_share`: student positions that start a chunk (the positions that get a
  teacher's next-token target); `fallback_share`: token positions aligned by the quadratic
  fallback (texts whose bytes differ between the tokenizers), `inexact_chunk_share`: chunks
  that agree only up to normalisation;
- `first_piece`: at each KD position, whether the first-piece projection of the teacher's
  observed token is the student's observed token (`right`), or the student's token spans
  several of the teacher's (`student_longer`), and so on (`benchmarks/target_bias.py`
  tabulates it for the eight shipped tokenizers);
- the teacher probability the projection cannot place (no student piece: it joins the tail) or
  places only approximately: from a short teacher forward with `--teacher-model`, otherwise
  counted over the teacher's tokens of the text;
- per class of text that breaks pairs in practice (digits, whitespace runs and indentation,
  non-Latin scripts, special tokens): its share of the chunks and how it aligns;
- a recommendation (loss, top_k, target, kd_ratio) backed by the quality benchmark's numbers,
  and warnings when the pair is unlikely to help.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from crossdistill.data.cli import add_text_field_arg
from crossdistill.errors import UserError
from crossdistill.train.auto_target import (
    FAR_PAIR_RIGHT,
    NEAR_PAIR_RIGHT,
    choose_target,
    first_piece_kinds,
    near_a_bound,
)

CLASSES = ("digits", "whitespace", "non_latin", "special")
FIRST_PIECE_KINDS = ("right", "student_longer", "student_shorter", "other")


# ---------------------------------------------------------------- text


def read_texts(paths: list[str], limit: int, field: str = "text") -> list[str]:
    """The first documents of the corpus files until `limit` UTF-8 bytes (the demo's corpus,
    this machine's Python standard library, when no file is given). Rows that are not text are
    skipped, and counted on stderr."""
    if not paths:
        from crossdistill.train.demo_assets import stdlib_corpus

        texts, _ = stdlib_corpus(max_files=100_000, seed=0, train_bytes=limit, val_bytes=1)
        return first_bytes(texts, limit)
    from crossdistill.data.documents import TextDocuments

    documents = TextDocuments(paths, field)
    texts, size = [], 0
    for text in documents:
        texts.append(text)
        size += len(text.encode())
        if size >= limit:
            break
    if (note := documents.note()) is not None:
        print(f"[audit] {note}", file=sys.stderr)
    return texts


def first_bytes(texts: list[str], num_bytes: int, within: bool = False) -> list[str]:
    """The first whole texts of `texts` until at least `num_bytes` UTF-8 bytes are taken; with
    `within`, only as many as fit in `num_bytes` (at least one)."""
    out, size = [], 0
    for text in texts:
        n = len(text.encode())
        if (out and size + n > num_bytes) if within else size >= num_bytes:
            break
        out.append(text)
        size += n
    return out


# ---------------------------------------------------------------- per-token classes


def token_classes(token_bytes) -> np.ndarray:
    """`[V, len(CLASSES)]` bool: what each token id of a vocabulary holds."""
    pieces = token_bytes.pieces()
    out = np.zeros((len(pieces), len(CLASSES)), dtype=bool)
    for i, piece in enumerate(pieces):
        if not piece:
            out[i, 3] = True
            continue
        text = piece.decode("utf-8", errors="replace")
        out[i, 0] = any(c.isdigit() for c in text)
        out[i, 1] = sum(c in " \t\n\r" for c in text) >= 2
        out[i, 2] = any(ord(c) > 0x24F for c in text)  # beyond Latin Extended-B (or partial)
    out[token_bytes.special[: len(pieces)], 3] = True
    return out


# ---------------------------------------------------------------- audit


def audit_pair(
    student: str,
    teacher: str,
    texts: list[str],
    teacher_model: str | None = None,
    model_tokens: int = 2048,
) -> dict[str, Any]:
    """The audit of one pair on `texts` (see module doc)."""
    from crossdistill.alignment import align_batch
    from crossdistill.alignment.projection import build_projection
    from crossdistill.data.aligned import Pipeline
    from crossdistill.models import load_tokenizer

    pipe = Pipeline.load(student, teacher, fast=False)
    tok_s, tok_t = load_tokenizer(student), load_tokenizer(teacher)
    projection = build_projection(tok_t, tok_s)
    first, exact = projection.first_piece.numpy(), projection.exact.numpy()
    ids_s, ids_t = pipe.encode(texts)
    alignments = align_batch(ids_s, ids_t, pipe.bytes_s, pipe.bytes_t)
    classes_s = token_classes(pipe.bytes_s)
    n_s = sum(len(x) for x in ids_s)
    n_t = sum(len(x) for x in ids_t)
    chunks = np.concatenate([a.chunks for a in alignments])
    exact_chunks = np.concatenate([a.exact for a in alignments])
    len_s, len_t = chunks[:, 1] - chunks[:, 0], chunks[:, 3] - chunks[:, 2]
    one = (len_s == 1) & (len_t == 1)
    kinds = dict.fromkeys(FIRST_PIECE_KINDS, 0)
    chunk_class = []
    for a, s, t in zip(alignments, ids_s, ids_t):
        s, t = np.asarray(s), np.asarray(t)
        c = a.chunks
        per_token = classes_s[s]
        chunk_class.append(np.maximum.reduceat(per_token, c[:, 0], axis=0) if len(c) else
                           np.zeros((0, len(CLASSES)), bool))  # fmt: skip
        for k, v in first_piece_kinds(s, t, c, first).items():
            kinds[k] += int(v.sum())
    chunk_class = np.concatenate(chunk_class)
    kd = max(sum(kinds.values()), 1)
    all_t = np.concatenate([np.asarray(t) for t in ids_t])
    report: dict[str, Any] = {
        "student": student,
        "teacher": teacher,
        "documents": len(texts),
        "bytes": sum(len(t.encode()) for t in texts),
        "student_tokens": n_s,
        "teacher_tokens": n_t,
        "teacher_tokens_per_student_token": n_t / max(n_s, 1),
        "chunks": int(len(chunks)),
        "one_to_one_share": float(one.mean()) if len(chunks) else 0.0,
        "mean_chunk_tokens_student": float(len_s.mean()) if len(chunks) else 0.0,
        "mean_chunk_tokens_teacher": float(len_t.mean()) if len(chunks) else 0.0,
        "chunk_start_share": len(chunks) / max(n_s, 1),
        "fallback_share": sum(a.num_fallback for a in alignments) / max(n_s + n_t, 1),
        "inexact_chunk_share": float((~exact_chunks).mean()) if len(chunks) else 0.0,
        "first_piece": {k: v / kd for k, v in kinds.items()},
        "kd_positions": sum(kinds.values()),
        "projection": {
            "teacher_tokens_unplaced_share": float((first[all_t] < 0).mean()),
            "teacher_tokens_inexact_share": float((~exact[all_t]).mean()),
            **projection.stats(),
        },
        "classes": {
            name: _class_stats(chunk_class[:, i], one, len_s, len_t)
            for i, name in enumerate(CLASSES)
        },
        "chat_templates": {
            "student": getattr(tok_s, "chat_template", None) is not None,
            "teacher": getattr(tok_t, "chat_template", None) is not None,
        },
        "histogram": {
            "student": np.bincount(np.minimum(len_s, 16), minlength=17).tolist(),
            "teacher": np.bincount(np.minimum(len_t, 16), minlength=17).tolist(),
        },
    }
    if teacher_model:
        report["teacher_mass"] = teacher_mass(teacher_model, ids_t, first, exact, model_tokens)
    report["recommendation"], report["warnings"] = recommend(report)
    return report


def _class_stats(member: np.ndarray, one: np.ndarray, len_s, len_t) -> dict[str, float]:
    n = int(member.sum())
    return {
        "chunk_share": n / max(member.size, 1),
        "one_to_one_share": float(one[member].mean()) if n else 0.0,
        "mean_chunk_tokens_student": float(len_s[member].mean()) if n else 0.0,
        "mean_chunk_tokens_teacher": float(len_t[member].mean()) if n else 0.0,
    }


def teacher_mass(
    path: str, ids_t: list[list[int]], first: np.ndarray, exact: np.ndarray, tokens: int
) -> dict[str, float]:
    """A short forward of the teacher checkpoint at `path` over the text's first `tokens`
    teacher tokens: the mean probability it puts on ids the projection cannot place (no
    student piece) and on ids it places only approximately (not an exact match)."""
    import torch

    from crossdistill.models import build_causal_lm
    from crossdistill.models.loading import checkpoint_files

    checkpoint_files(path)  # a folder without weights is one line, before anything loads
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_causal_lm(path=path, device=device, dtype=torch.float32).eval()
    rows = model.get_output_embeddings().weight.shape[0]
    unplaced = torch.zeros(rows, dtype=torch.bool)
    inexact = torch.ones(rows, dtype=torch.bool)
    n = min(rows, first.size)
    unplaced[:n] = torch.from_numpy(first[:n] < 0)
    unplaced[first.size :] = True  # embedding rows no token uses
    inexact[:n] = torch.from_numpy(~exact[:n])
    total = placed_not = approx = 0.0
    with torch.no_grad():
        for doc in ids_t:
            for lo in range(0, len(doc) - 1, 512):
                window = torch.tensor(doc[lo : lo + 512], device=device).view(1, -1)
                probs = torch.softmax(model(window).logits[0].float(), dim=-1).cpu()
                placed_not += float(probs[:, unplaced].sum())
                approx += float(probs[:, inexact].sum())
                total += probs.shape[0]
                if total >= tokens:
                    break
            if total >= tokens:
                break
    return {
        "positions": int(total),
        "unplaced_mass": placed_not / max(total, 1),
        "inexact_mass": approx / max(total, 1),
    }


def recommend(report: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Settings for this pair and warnings, from the audit's numbers and what the quality
    benchmark measured on pairs like it."""
    right = report["first_piece"]["right"]
    warnings = []
    far = right <= FAR_PAIR_RIGHT
    rec = {
        "loss": "forward_kl",
        "top_k": 64,
        # what `target: auto` takes for a student without tensor parallelism
        "target": choose_target(right, "forward_kl", tensor_parallel=False)[0],
        "kd_ratio": 0.5,
    }
    if hint := near_a_bound(right):
        warnings.append(f"the first-piece target is right at {right:.1%}: {hint}")
    if right >= NEAR_PAIR_RIGHT:
        rec["why"] = (
            f"near pair: the first-piece target is right at {right:.1%} of KD positions (Qwen3 "
            "and Phi-4-mini for a Llama-3 student: 98-99%); there cross-tokenizer KD did what "
            "same-tokenizer KD does (Qwen3 -> Llama-3, bench quality, H200, forward KL, top-64, "
            "KD 0.5: -2.3% bits per byte against CE only, better on 5 of 5 seeds, 117% of the "
            "same-tokenizer gain)"
        )
    elif far:
        rec["why"] = (
            f"far pair: the first-piece target is right at only {right:.1%} of KD positions "
            "(Llama-2 and Mistral for a Llama-3 student: 68-81%); `target: lookahead_split` "
            "follows the teacher along the student's token, gives each continuation to the "
            "student token that spells it, moves the teacher's continuations past the token's "
            "end to the longer student tokens that spell them, and splits each of the teacher's "
            "other tokens between the student token that spells it and the longer ones that "
            "start with it, at a share counted on your text (Llama-2 -> Llama-3, bench quality, "
            "H200, KD 0.5, students on 1 MB, 10 seeds a run: 78-90% of the same-tokenizer "
            "gain in five runs on three corpora, better than CE only on every seed, against "
            "55-88% for `target: lookahead_prefix_end`, which lost to CE only on one seed; "
            "lower than it on 27 of 40 paired seeds, -0.6% on average); `target: auto` (the "
            "default) chooses it for this pair, at 1.00 of `lookahead_prefix_end`'s step "
            "throughput, live or from a teacher cache; `auto` takes `lookahead` for a "
            "tensor-parallel student"
        )
        warnings.append(
            "far pair: pairs like this (Llama-2 and Mistral -> Llama-3) gained less than a "
            "same-tokenizer teacher at the gpu scale of bench quality (lookahead_split target, "
            "students on 1 MB: -6.0% and -6.5% bits per byte against -7.3% and -7.7% for "
            "same-tokenizer KD on the standard library, -6.4% against -7.0% on C headers, "
            "-4.6% against -5.4% on the Python docs and verse; first piece +1.8% on all the "
            "text; at KD weight 0.9 the first piece lost 6 to 17%, while lookahead_split at 0.7 "
            "gained 1.1% more than at 0.5 on the standard library, every seed); check the target "
            "and the weight on your corpus with `crossdistill bench quality --target "
            "lookahead_prefix_end --target lookahead_split` and `--kd-ratio 0.5 --kd-ratio 0.7`"
        )
    else:
        rec["why"] = (
            f"between near and far: the first-piece target is right at {right:.1%} of KD "
            "positions (near pairs 97-99%, far pairs 68-81%); where one student token spans "
            "several teacher tokens (digits, mostly) the first piece taught the student worse "
            "than CE only on every seed (Qwen3 -> Llama-3 on Perl, 90%, bench quality, H200, 5 "
            "seeds), and the lookahead targets better; `target: lookahead_split` (what "
            "`target: auto`, the default, chooses for every pair under 95%, live or from a "
            "teacher cache, and `lookahead` for a tensor-parallel student) was level with "
            "`lookahead_prefix_end` on the pairs between (the demo's pair, 24 seeds; Qwen3 on "
            "Perl at the cpu scale, 10 seeds) and closed 88% of the gap on every seed where "
            "`lookahead_prefix_end` made every seed worse than CE only (Mistral -> Llama-3 on "
            "Java sources at the cpu scale, 85.3%); check with `crossdistill bench quality "
            "--target first_piece --target lookahead_split` on your corpus"
        )
    unplaced = report.get("teacher_mass", {}).get(
        "unplaced_mass", report["projection"]["teacher_tokens_unplaced_share"]
    )
    if unplaced > 0.05:
        warnings.append(
            f"{unplaced:.1%} of the teacher's probability has no student piece to go to (it "
            "joins the tail): this pair is unlikely to help"
        )
    if report["fallback_share"] > 0.01:
        warnings.append(
            f"{report['fallback_share']:.1%} of the tokens need the alignment's byte-diff "
            "fallback (the tokenizers decode this text to different bytes: normalisation or "
            "unknown tokens); chunks there are approximate"
        )
    if report["one_to_one_share"] < 0.3:
        warnings.append(
            f"only {report['one_to_one_share']:.0%} of the chunks are one token on each side: "
            "most KD positions compare multi-token spans"
        )
    return rec, warnings


# ---------------------------------------------------------------- command


def add_audit_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "audit",
        help="how well a student/teacher tokenizer pair aligns on your text, and what to expect",
        description=__doc__,
        epilog=(
            "examples:\n"
            "  crossdistill audit $TOK/llama3/hf $TOK/qwen3/hf --corpus data.jsonl\n"
            "  crossdistill audit $TOK/llama3/hf $TOK/llama2/hf --teacher-model /ckpt/llama-2 "
            "--json --plot audit.png\n"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("student_tokenizer")
    p.add_argument("teacher_tokenizer")
    p.add_argument(
        "--corpus", action="append", default=[], help="a corpus file (repeatable; default: "
        "this machine's Python standard library, the demo's corpus)"
    )  # fmt: skip
    add_text_field_arg(p, "field")
    p.add_argument("--bytes", type=int, default=2_000_000, help="text to read (UTF-8 bytes)")
    p.add_argument("--teacher-model", help="a teacher checkpoint folder: measure its mass")
    p.add_argument("--model-tokens", type=int, default=2048, help="teacher tokens to run")
    p.add_argument("--plot", help="write a PNG of the chunk-length histogram here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.bytes < 1 or args.model_tokens < 1:
        raise UserError("--bytes and --model-tokens must be at least 1")
    texts = read_texts(args.corpus, args.bytes, args.field)
    report = audit_pair(
        args.student_tokenizer, args.teacher_tokenizer, texts, args.teacher_model,
        args.model_tokens,
    )  # fmt: skip
    report["corpus"] = args.corpus or ["python standard library"]
    if args.plot:
        plot_histogram(report, Path(args.plot))
    if args.json:
        print(json.dumps(report))
        return 0
    print_report(report)
    return 0


def plot_histogram(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'crossdistill[logging]'") from None
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(17)
    for k, (side, offset) in enumerate((("student", -0.2), ("teacher", 0.2))):
        counts = np.asarray(report["histogram"][side], dtype=float)
        ax.bar(x + offset, counts / max(counts.sum(), 1), width=0.4, label=side, color=f"C{k}")
    ax.set_xticks(x, [str(i) for i in range(16)] + ["16+"])
    ax.set_xlabel("tokens per chunk")
    ax.set_ylabel("share of chunks")
    ax.set_title(f"one-to-one {report['one_to_one_share']:.1%}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_report(r: dict[str, Any]) -> None:
    print(f"student {r['student']}\nteacher {r['teacher']}")
    print(f"text: {r['documents']} documents, {r['bytes']:,} bytes")
    print(
        f"tokens: student {r['student_tokens']:,}, teacher {r['teacher_tokens']:,} "
        f"({r['teacher_tokens_per_student_token']:.2f} per student token)"
    )
    print(f"one-to-one chunks      {r['one_to_one_share']:.1%}")
    print(
        f"tokens per chunk       student {r['mean_chunk_tokens_student']:.2f}, teacher "
        f"{r['mean_chunk_tokens_teacher']:.2f}"
    )
    print(f"chunk starts           {r['chunk_start_share']:.1%} of student positions")
    print(f"diff fallback          {r['fallback_share']:.2%} of token positions")
    fp = r["first_piece"]
    print(
        "first-piece target     "
        + ", ".join(f"{k.replace('_', ' ')} {fp[k]:.1%}" for k in FIRST_PIECE_KINDS)
    )
    pr = r["projection"]
    print(
        f"projection             unplaced {pr['teacher_tokens_unplaced_share']:.2%}, approximate "
        f"{pr['teacher_tokens_inexact_share']:.1%} of the teacher's tokens of this text"
    )
    if "teacher_mass" in r:
        m = r["teacher_mass"]
        print(
            f"teacher probability    unplaced {m['unplaced_mass']:.2%}, approximate "
            f"{m['inexact_mass']:.1%} (over {m['positions']} positions)"
        )
    print("by class               chunks   one-to-one   tokens per chunk (student / teacher)")
    for name, c in r["classes"].items():
        print(
            f"  {name:20s} {c['chunk_share']:6.1%}   {c['one_to_one_share']:8.1%}   "
            f"{c['mean_chunk_tokens_student']:.2f} / {c['mean_chunk_tokens_teacher']:.2f}"
        )
    rec = r["recommendation"]
    print(
        f"recommendation         loss {rec['loss']}, top_k {rec['top_k']}, target "
        f"{rec['target']} (what the default, auto, takes here), kd_ratio {rec['kd_ratio']}\n"
        f"  ({rec['why']})"
    )
    for w in r["warnings"]:
        print(f"warning: {w}")
    if not math.isfinite(r["one_to_one_share"]):
        raise UserError("the audit found no text to align")

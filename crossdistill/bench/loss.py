"""`crossdistill bench loss`: the chunked student loss against a naive full-logits version.

One run times, on the same inputs, forward + backward of CE + forward-KL KD with top-k teacher
targets three ways: ours (`student_loss`, chunked), a naive float32 full-logits PyTorch version
of the same loss (autograd through `log_softmax`), and the three bare lm_head-sized matmuls
(`[N,H]×[H,V]`, `[N,V]×[V,H]`, `[V,N]×[N,H]`) that any implementation must run. Peak memory is
reported beyond inputs, weights and their gradients (CUDA: the allocator's peak; CPU: the
process's peak resident set, reset through `/proc/self/clear_refs`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

EXAMPLES = """examples:
  crossdistill bench loss --device cpu --json
  crossdistill bench loss --device cuda           # N=8192, H=4096, V=128256, bf16
  crossdistill bench loss --n 512 --vocab 32000 --chunk-size 256
"""

CPU_DEFAULTS = {"n": 2048, "hidden": 512, "dtype": "float32", "chunk_size": 1024}
CUDA_DEFAULTS = {"n": 8192, "hidden": 4096, "dtype": "bfloat16", "chunk_size": 2048}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "loss",
        help="chunked student loss vs a naive full-logits version and the bare matmuls",
        description=__doc__,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--n", type=int, help="tokens (rows); default 2048 on cpu, 8192 on cuda")
    p.add_argument("--hidden", type=int, help="hidden size; default 512 on cpu, 4096 on cuda")
    p.add_argument("--vocab", type=int, default=128256, help="student vocabulary (Llama-3)")
    p.add_argument("--top-k", type=int, default=64)
    p.add_argument("--chunk-size", type=int, help="rows per chunk; default 1024 cpu, 2048 cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: fp32 cpu, bf16 cuda")
    p.add_argument("--kd-ratio", type=float, default=0.5)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fused",
        choices=["auto", "on", "off"],
        default="auto",
        help="vocabulary-wide passes in Triton kernels (auto: on CUDA when Triton is there)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from crossdistill.errors import UserError

    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(_table(result))
    return 0


def _inputs(args, torch):
    from crossdistill.losses import KDTerm, VocabProjection, kd_positions, teacher_targets

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    n, h, v = args.n, args.hidden, args.vocab
    hidden = torch.randn(n, h, generator=g).to(dev, dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dev, dtype).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g).to(dev)
    labels[-1] = -100
    # one sequence, identical tokenizers: 1:1 chunks, KD at every position but the first token
    idx = torch.arange(n, device=dev)
    chunks = torch.stack([idx, idx + 1, idx, idx + 1], 1)
    # a small random teacher produces genuine top-k targets over the same vocabulary
    h_t = torch.randn(n, 64, generator=g).to(dev, dtype)
    w_t = (torch.randn(v, 64, generator=g) / 4).to(dev, dtype)
    start = _now(torch, dev)
    targets = teacher_targets(
        h_t, w_t, kd_positions(chunks)[1], labels, args.top_k, 1.0, args.chunk_size
    )
    targets_ms = (_now(torch, dev) - start) * 1e3
    term = KDTerm(
        targets,
        VocabProjection.identity(v, device=dev),
        chunks,
        denominator=torch.tensor(float(n - 1), device=dev),
        loss="forward_kl",
    )
    return hidden, weight, labels, term, targets_ms


def naive_loss(hidden, weight, labels, term, kd_ratio, torch):
    """The same loss, written plainly: full float32 logits, log-softmax, autograd, the tail as
    `1 − Σ p` (identity projection, so the teacher's top-k ids are student ids)."""
    z = (hidden @ weight.t()).float()  # [N, V]
    logp = torch.log_softmax(z, dim=-1)
    valid = labels >= 0
    ce = -torch.where(valid, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0).sum()
    ce = ce / valid.sum()
    rows = term.chunks[:, 0] - 1  # the KD row of each chunk; row c predicts chunk c + 1 here
    ok = rows >= 0
    n, k = z.shape[0], term.targets.topk_ids.shape[1]
    ids = torch.zeros(n + 1, k, dtype=torch.long, device=z.device)  # row n: chunks without KD
    ids[torch.where(ok, rows, n)] = term.targets.topk_ids.long()
    lp_ids = logp.gather(1, ids[:n])[rows.clamp(min=0)]  # [M, K]
    lp_tail = torch.log((1 - lp_ids.exp().sum(1)).clamp(min=1e-30))
    lq, lq_tail = term.targets.topk_logprobs, term.targets.tail_logprob
    kl = (lq.exp() * (lq - lp_ids)).sum(1) + lq_tail.exp() * (lq_tail - lp_tail)
    kd = torch.where(ok, kl, 0.0).sum() / term.denominator
    return (1 - kd_ratio) * ce + kd_ratio * kd


def _now(torch, dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


class _Peak:
    """Peak memory of a block beyond what was allocated when it started."""

    def __init__(self, torch, dev):
        self.torch, self.dev = torch, dev

    def __enter__(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
            self.base = self.torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets the peak resident set (VmHWM) to the current one
            self.base = _proc_status("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()
            self.bytes = self.torch.cuda.max_memory_allocated() - self.base
        else:
            self.bytes = _proc_status("VmHWM") - self.base
        return False


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def _time(fn, reset, args, torch, dev) -> tuple[float, int]:
    """Median milliseconds over `repeats` after `warmup`, and the peak extra bytes of the first
    timed run (measured from a state with no gradients allocated)."""
    for _ in range(args.warmup):
        reset()
        fn()
    times, peak = [], 0
    for i in range(args.repeats):
        reset()
        start = _now(torch, dev)
        with _Peak(torch, dev) as mem:
            fn()
        times.append(_now(torch, dev) - start)
        if i == 0:
            peak = mem.bytes
    times.sort()
    return times[len(times) // 2] * 1e3, peak


def measure(args) -> dict:
    import torch

    from crossdistill.losses import student_loss
    from crossdistill.losses.kernels import available as fused_available

    dev = torch.device(args.device)
    hidden, weight, labels, term, targets_ms = _inputs(args, torch)
    grad_bytes = hidden.nbytes + weight.nbytes  # the gradients every variant must produce

    def reset():
        hidden.grad = weight.grad = None

    fused = {"auto": None, "on": True, "off": False}[args.fused]

    def ours():
        denominator = (labels >= 0).sum()
        loss = student_loss(
            hidden,
            weight,
            labels,
            [term],
            args.kd_ratio,
            denominator,
            args.chunk_size,
            fused=fused,
            unit_upstream=True,  # as the training step calls it
        )[0]
        loss.backward()
        return loss

    def naive():
        loss = naive_loss(hidden, weight, labels, term, args.kd_ratio, torch)
        loss.backward()
        return loss

    def matmuls():
        with torch.no_grad():
            z = hidden @ weight.t()  # [N, V]
            return z @ weight, z.t() @ hidden

    def result(fn):
        reset()
        loss = fn().detach()
        return loss.double().cpu(), hidden.grad.double().cpu(), weight.grad.double().cpu()

    ours_ms, ours_peak = _time(ours, reset, args, torch, dev)
    naive_ms, naive_peak = _time(naive, reset, args, torch, dev)
    matmul_ms, _ = _time(matmuls, reset, args, torch, dev)
    errs = [_rel(a, b) for a, b in zip(result(ours), result(naive))]
    reset()
    ours_extra, naive_extra = max(ours_peak - grad_bytes, 0), max(naive_peak - grad_bytes, 0)
    return {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else _cpu_name(),
        "date": time.strftime("%Y-%m-%d"),
        "command": "crossdistill bench loss " + " ".join(sys.argv[3:]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "n": args.n,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "top_k": args.top_k,
        "chunk_size": args.chunk_size,
        "fused": dev.type == "cuda" and fused_available() if fused is None else fused,
        "ours_ms": round(ours_ms, 2),
        "naive_ms": round(naive_ms, 2),
        "matmul_ms": round(matmul_ms, 2),
        "time_ratio": round(ours_ms / naive_ms, 4),
        "matmul_ratio": round(ours_ms / matmul_ms, 4),
        "ours_peak_extra_bytes": ours_extra,
        "naive_peak_extra_bytes": naive_extra,
        "peak_mem_ratio": round(ours_extra / max(naive_extra, 1), 4),
        "max_rel_err": max(errs),
        "rel_err_loss": errs[0],
        "rel_err_grad_hidden": errs[1],
        "rel_err_grad_weight": errs[2],
        "teacher_targets_ms": round(targets_ms, 2),
    }


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def _table(r: dict) -> str:
    gib = 2**30
    ours, naive = r["ours_peak_extra_bytes"] / gib, r["naive_peak_extra_bytes"] / gib
    lines = [
        f"{r['device']}, torch {r['torch']}, {r['threads']} threads, {r['dtype']}: N={r['n']} "
        f"H={r['hidden']} V={r['vocab']} top-k={r['top_k']} chunk={r['chunk_size']} "
        f"fused={r['fused']}",
        f"{'variant':<22}{'ms':>10}{'peak extra GiB':>16}",
        f"{'chunked (ours)':<22}{r['ours_ms']:>10.1f}{ours:>16.3f}",
        f"{'naive full logits':<22}{r['naive_ms']:>10.1f}{naive:>16.3f}",
        f"{'3 bare matmuls':<22}{r['matmul_ms']:>10.1f}{'':>16}",
        f"time ours/naive {r['time_ratio']:.3f}, ours/matmuls {r['matmul_ratio']:.3f}, "
        f"peak ours/naive {r['peak_mem_ratio']:.3f}, max rel err {r['max_rel_err']:.2e}",
    ]
    return "\n".join(lines)

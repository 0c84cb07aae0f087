"""`crossdistill bench quality`: does distillation across tokenizers teach as much as distillation
from a teacher with the student's own tokenizer? A controlled experiment on a corpus.

1. The corpus is cut into pieces and split once into training and held-out text, each piece of
   the stretch read held out by its hash (`quality_corpus.split_pieces`): the held-out text is a
   sample of the text trained on, and the split does not depend on the seed, so every run is
   scored on the same bytes.
2. Teachers, one per `--teacher-tokenizer` plus one on the student's tokenizer (the
   same-tokenizer reference): the same architecture, the same steps, the same bytes of text per
   step (each teacher's sequence length is scaled by its tokenizer's bytes per token on this
   corpus), CE only, from scratch. They differ only in the tokenizer. Cached by a hash of their
   config, the corpus and the tokenizer, so a rerun of the student cells does not retrain them.
   `--teacher-seeds N` trains each N times, from seeds 0 to N-1.
3. Students of one architecture, steps and data order, for every seed: CE only, same-tokenizer
   KD, and cross-tokenizer KD for every teacher tokenizer, `--loss` and `--target`; each KD
   student under each teacher seed and each `--kd-ratio` (a cross cell's gap closed is then
   against the same-tokenizer students of its own weight). With `--teacher-cache` (the gpu
   scale's default) each teacher is first run once over the students' and the held-out text
   into a cache (OUT/caches), and its KD students read their targets from it instead of
   running it.
4. Held-out bits per byte (mean ± standard deviation over seeds) and the gap closed,
   (CE only − cross KD) / (CE only − same-tokenizer KD), per seed, then mean ± std, and from
   the means with a bootstrap interval. With several teacher seeds these run over every
   (teacher seed, seed) pair, and the interval resamples the teacher seeds too: a teacher
   trained again moves a small gain's gap closed by more than the students' seeds do.

The comparison is refused, with a one-line reason, when it cannot say anything: fewer than two
seeds, teachers further apart than `--max-teacher-spread`, a teacher less than
`--min-teacher-gain` better than the CE-only student, or same-tokenizer KD not better than CE only
on every seed (the gap would be undefined, or a ratio of noise). A same-tokenizer gain under
`--min-same-gain` (5%) is reported with a warning: the comparison stands, near the noise. Every
finished cell is appended to OUT/cells.jsonl and OUT/summary.json is rewritten, so a long run can
be followed while it goes.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from crossdistill.bench import library_versions
from crossdistill.bench.quality_corpus import bytes_per_token, share_path, write_corpus
from crossdistill.bench.quality_report import Cell, summarize
from crossdistill.bench.quality_spec import (
    ARCH_KEYS,
    QualitySpec,
    Scale,
    cell_settings,
    target_parts,
    target_terms,
)
from crossdistill.config import (
    DISTRIBUTION_LOSSES,
    Config,
    TeacherConfig,
    TrainConfig,
    from_dict,
    to_dict,
)
from crossdistill.errors import RunFailed, UserError
from crossdistill.losses.target_kinds import target_kind

SAME_LOSS = "forward_kl"  # the same-tokenizer reference: plain top-k KL, nothing to project


def student_train_file(data: Path, scale: Scale) -> Path:
    """The students' training JSONL in the corpus folder `data`."""
    if scale.student_train_bytes is None:
        return data / "train.jsonl"
    return share_path(data, scale.student_train_bytes)


# ----------------------------------------------------------------------------- runs


def tokenizer_label(path: str) -> str:
    """`…/qwen3/hf` → `qwen3`; `…/my-tok` → `my-tok`."""
    p = Path(path).resolve()
    return p.parent.name if p.name == "hf" else p.name


def model_entry(size: dict[str, int], tokenizer: str, vocab: int) -> dict[str, Any]:
    overrides: dict[str, Any] = {k: size[k] for k in ARCH_KEYS}
    overrides["vocab_size"] = (vocab + 63) // 64 * 64
    overrides["tie_word_embeddings"] = True
    return {
        "arch": "tiny-llama",
        "tokenizer": tokenizer,
        "dtype": "float32",
        "overrides": overrides,
    }


def run_config(
    spec: QualitySpec,
    data: Path,
    run_dir: Path,
    model: dict[str, Any],
    *,
    steps: int,
    lr: float,
    seq_len: int,
    batch: int,
    seed: int,
    teachers: list[dict[str, Any]] | None = None,
    progress: bool = True,
    accum: int = 1,
    train_file: Path | None = None,
    ce_without_kd: str = TrainConfig.ce_without_kd,
    kd_warmup_steps: int = TrainConfig.kd_warmup_steps,
    kd_ratio: float = TrainConfig.kd_ratio,
) -> Config:
    """One training run; `train_file` (default: all of the training text) is what it reads."""
    s = spec.scale
    raw = {
        "student": model,
        "teachers": teachers or [],
        "data": {
            "train": [str(train_file or data / "train.jsonl")],
            "validation": [str(data / "val.jsonl")],
            "seq_len": seq_len,
            "micro_batch_size": batch,
            "num_workers": s.num_workers,
            "seed": seed,
        },
        "optim": {"lr": lr, "warmup_steps": max(1, steps // 20), "weight_decay": 0.05},
        "train": {
            "steps": steps,
            "grad_accum": accum,
            "kd_ratio": kd_ratio if teachers else 0.0,
            "ce_without_kd": ce_without_kd,
            "kd_warmup_steps": kd_warmup_steps,
            "seed": seed,
            "eval_every": steps,
            "eval_batches": 1 << 30,  # the whole held-out split
            "checkpoint_every": steps,
            "keep_last": 1,
            "log_every": max(1, steps // 50),
            "device": s.device,
            "loss_chunk_size": 1024,
        },
        "run": {"out_dir": str(run_dir), "tensorboard": False, "progress": progress},
    }
    return from_dict(Config, raw)


def config_hash(cfg: Config, *extra: str) -> str:
    """Twelve hex digits of the config (its output folder left out) and `extra`."""
    raw = to_dict(cfg)
    raw["run"].pop("out_dir")
    payload = json.dumps(raw, sort_keys=True) + "\0".join(extra)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


@dataclass
class Job:
    """One training run of the experiment and what to do with its held-out bits per byte."""

    cell: str
    seed: int | None
    cfg: Config
    describe: str
    on_done: Callable[[float], None]
    bpb: float | None = None
    teacher_seed: int | None = None  # of the teacher it is, or learns from, when several

    def done(self, bpb: float) -> None:
        self.bpb = bpb
        self.on_done(bpb)

    @property
    def name(self) -> str:
        """The cell and its seeds, as the log and an error name the run."""
        seeds = {"teacher seed": self.teacher_seed, "seed": self.seed}
        return self.cell + "".join(f" {k} {v}" for k, v in seeds.items() if v is not None)


def chosen_target(cfg: Config) -> str:
    """What `target: auto` of the run `cfg`'s one teacher chooses, as the run will."""
    from crossdistill.models import load_tokenizer
    from crossdistill.train.auto_target import resolve_targets

    tok_s = load_tokenizer(cfg.student.tokenizer or cfg.student.path)
    tok_t = load_tokenizer(cfg.teachers[0].tokenizer or cfg.teachers[0].path)
    return resolve_targets(cfg, tok_s, [tok_t])[0][0].target


def train_one(raw: dict[str, Any]) -> float:
    """One run in a process of its own (`--jobs` above 1): its held-out bits per byte."""
    from crossdistill.train.demo import run_stage

    return run_stage(from_dict(Config, raw), reuse=True)["val/bpb/student"]


def build_one(raw: dict[str, Any]) -> float:
    """One teacher cache build in a process of its own (`--teacher-cache`): the config's one
    teacher over its data section into its `run.out_dir`, in windows of its `data.seq_len`
    teacher tokens (the length the teacher was trained at; its positions end there). Resumes a
    build stopped part-way. Returns the teacher's bits per byte on that text."""
    from crossdistill.train.cache_build import BuildOptions, build_cache

    cfg = from_dict(Config, raw)
    options = BuildOptions(context=cfg.data.seq_len, progress=False)
    (manifest,) = build_cache(cfg, {0: Path(cfg.run.out_dir)}, options)
    return manifest["teacher_bpb"]


def train_many(
    cfgs: dict[Any, Config],
    jobs: int,
    run: Callable[[dict[str, Any]], float] = train_one,
    on_start: Callable[[Any], None] | None = None,
) -> Iterator[tuple[Any, float]]:
    """Train every config, `jobs` at a time, each in a process of its own; yields
    `(key, run(config as a dict))` as each run finishes. `on_start(key)` is called as each
    run's process starts.

    Runs on a CUDA device (or `auto`) start as fresh spawned processes: no CUDA state crosses a
    fork. Runs that are all on the CPU fork from a server that has imported the trainer once
    (`RUN_PRELOAD`), since there a small run's import of torch and transformers (seconds each
    time) can be most of the run.

    A run that raises, or whose process ends without a result (killed, out of memory, or it
    could not start), stops the experiment at once with its key and reason, and the runs still
    going are stopped with it; runs that ended at the same moment are yielded first. (The
    standard library's process pool, which this replaces, let every queued run train before it
    raised a run's error, named no run when one was killed, and can wait forever when a
    replacement worker fails to start: CPython gh-119592, fixed in 3.14.) A user error in a run
    is raised as one, so it stays one line.

    A run also ends when this process does, however it ends (SIGTERM or SIGKILL included, where
    no `finally` runs): each child holds the reading end of a pipe whose only writing end is
    here, and leaves when that pipe closes. Otherwise a killed bench's runs would go on
    training, and a rerun of the same command would train the same runs into the same folders
    beside them.

    What a run prints goes where this process's stdout and stderr point as the run starts: a
    run forked from the server would otherwise write to the descriptors the server inherited
    when it started, those of this process's first CPU bench."""
    from multiprocessing.connection import wait

    context = _run_context(cfgs.values())
    pending = list(cfgs.items())[::-1]
    # sentinel -> (key, process, result pipe, lifeline: the pipe whose closing stops the run)
    running: dict[Any, tuple[Any, Any, Any, Any]] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                key, cfg = pending.pop()
                receive, send = context.Pipe(duplex=False)
                held, lifeline = context.Pipe(duplex=False)
                args = (run, to_dict(cfg), send, held, _Output())
                process = context.Process(target=_child_run, args=args)
                process.start()
                if on_start is not None:
                    on_start(key)
                send.close()  # the child holds the only sending end: its exit ends the pipe
                held.close()  # and only the child reads the lifeline
                running[process.sentinel] = (key, process, receive, lifeline)
            failure: Exception | None = None
            for sentinel in wait(list(running)):  # every run that ended since the last wait
                key, process, receive, lifeline = running.pop(sentinel)
                try:
                    result = receive.recv()  # sent before the process ended, or nothing
                except EOFError:
                    result = None
                receive.close()
                lifeline.close()
                process.join()
                try:
                    value = _child_result(key, result, process.exitcode)
                except (UserError, RunFailed) as e:
                    failure = failure or e  # the runs that ended with it are still reported
                    continue
                yield key, value
            if failure is not None:
                raise failure
    finally:
        for _, process, receive, lifeline in running.values():
            process.terminate()
            receive.close()
            lifeline.close()
        for _, process, _, _ in running.values():
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


# what a run imports, loaded once by the fork server of CPU runs (one that fails to import is
# skipped there, and its run imports it as a spawned one would)
RUN_PRELOAD = [
    "crossdistill.train.demo",
    "crossdistill.train.loop",
    "crossdistill.train.cache_build",
    "transformers.modeling_utils",
]


def _run_context(cfgs: Iterable[Config]) -> Any:
    """`train_many`'s process context: the fork server for runs all on the CPU (where the
    platform has one), spawn otherwise."""
    import multiprocessing

    on_cpu = all(cfg.train.device == "cpu" for cfg in cfgs)
    if on_cpu and "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(RUN_PRELOAD)
        return context
    return multiprocessing.get_context("spawn")


class _Output:
    """The starting process's stdout and stderr descriptors, carried to a run's process as
    copies (the way a pipe's ends travel), where `attach` makes them that process's own."""

    def __init__(self, fds: tuple[int, int] = (1, 2)):
        self.fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_Output._carried, tuple(reduction.DupFd(fd) for fd in self.fds))

    @staticmethod
    def _carried(*copies: Any) -> _Output:
        return _Output(tuple(copy.detach() for copy in copies))

    def attach(self) -> None:
        """Point this process's stdout and stderr at the carried descriptors."""
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), self.fds, strict=True):
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _child_run(
    run: Callable[[dict[str, Any]], float],
    raw: dict[str, Any],
    send: Any,
    lifeline: Any,
    output: _Output,
) -> None:
    """A process of `train_many`: one run, its result or its error sent back; it
    exits at once when `lifeline` closes (the parent has ended). It writes to `output`."""
    import threading
    import traceback

    output.attach()
    threading.Thread(target=_exit_when_closed, args=(lifeline,), daemon=True).start()
    try:
        message: tuple[str, Any] = ("ok", run(raw))
    except UserError as e:
        message = ("user_error", str(e))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        lines = traceback.format_exception(e)
        message = ("error", "".join(lines)[-4000:])  # a pipe's buffer holds it whole
    send.send(message)
    send.close()


def _exit_when_closed(lifeline: Any) -> None:
    """Wait for `lifeline` to close (nothing is ever sent on it), then end this process: its
    parent is gone, and nobody would read what the run gives. A rerun of the bench reuses the
    finished runs and trains this one again."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    os._exit(1)


def _child_result(key: Any, message: tuple[str, Any] | None, exitcode: int | None) -> float:
    """What one of `train_many`'s processes reported, or the error that says why it did not."""
    if message is None:
        signalled = exitcode is not None and exitcode < 0
        how = f"killed by signal {-exitcode}" if signalled else f"exit code {exitcode}"
        raise RunFailed(
            f"run {key}: its process ended ({how}) without a result, before or during training"
            " (out of memory?); the finished runs are kept: rerun the same command to go on"
        )
    kind, value = message
    if kind == "user_error":
        raise UserError(f"run {key}: {value}")
    if kind == "error":
        raise RunFailed(f"run {key} failed; its traceback:\n{value}")
    return value


class Experiment:
    """Runs the cells of a `QualitySpec` in order, reusing every finished run."""

    def __init__(self, spec: QualitySpec, log: Callable[[str], None] = print):
        spec.check()
        self.spec = spec
        self.log = log
        self.out = spec.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.same_label = tokenizer_label(spec.student_tokenizer)
        self.labels = {}
        for path in spec.teacher_tokenizers:
            label = tokenizer_label(path)
            while label in self.labels.values() or label == self.same_label:
                label += "'"
            self.labels[path] = label
        self.cells = [Cell("ce")]
        reference = spec.kd_ratios[0]
        for ratio in spec.kd_ratios:
            # the reference weight's cells keep their plain names, so a run at one weight reuses
            # the students of an earlier run
            weight = "" if ratio == reference else f"-kd{ratio:g}"
            self.cells.append(Cell(f"same{weight}", self.same_label, SAME_LOSS, kd_ratio=ratio))
        for label in self.labels.values():
            for loss, target in cell_settings(spec.losses, spec.targets):
                suffix = "" if target == TeacherConfig.target else f"-{target}"
                # past_end changes only a target that reads past the end (or `auto`, which
                # may choose one)
                reads = target == "auto" or any(
                    target_kind(part).past_end for part in target_parts(target)
                )
                # many_chunks and deep_alternatives change only a lookahead target (or `auto`)
                ahead = target == "auto" or any(
                    target_kind(part).lookahead for part in target_parts(target)
                )
                for ratio, chunks, ce, warmup, end, many, deep, bound, ctx in itertools.product(
                    spec.kd_ratios,
                    spec.kd_chunks,
                    spec.ce_without_kd,
                    spec.kd_warmup_steps,
                    spec.past_end if reads else [TeacherConfig.past_end],
                    spec.many_chunks if ahead else [TeacherConfig.many_chunks],
                    spec.deep_alternatives if ahead else [TeacherConfig.deep_alternatives],
                    spec.boundary,
                    spec.split_context if ahead else [TeacherConfig.split_context],
                ):
                    name = f"cross-{label}-{loss}{suffix}"
                    if chunks != TeacherConfig.kd_chunks:
                        name += f"-{chunks}"
                    if end != TeacherConfig.past_end:
                        name += f"-past_end_{end}"
                    if many != TeacherConfig.many_chunks:
                        name += f"-many_{many}"
                    if deep != TeacherConfig.deep_alternatives:
                        name += f"-deep_{deep}"
                    if bound != TeacherConfig.boundary:
                        name += f"-boundary_{bound}"
                    if ctx != TeacherConfig.split_context:
                        name += f"-split_{ctx}"
                    if ce != TrainConfig.ce_without_kd:
                        name += f"-ce_{ce}"
                    if warmup != TrainConfig.kd_warmup_steps:
                        name += f"-kd_warmup{warmup}"
                    if ratio != reference:
                        name += f"-kd{ratio:g}"
                    self.cells.append(
                        Cell(
                            name,
                            label,
                            loss,
                            target,
                            chunks,
                            ce,
                            warmup,
                            kd_ratio=ratio,
                            past_end=end,
                            many_chunks=many,
                            deep_alternatives=deep,
                            boundary=bound,
                            split_context=ctx,
                        )
                    )
        self.teachers: dict[str, float] = {}  # label -> mean over the teacher seeds
        self.teacher_seed_bpb: dict[str, dict[int, float]] = {}
        self.teacher_paths: dict[tuple[str, int], Path] = {}  # (label, teacher seed) -> model
        self.cache_paths: dict[tuple[str, int], Path] = {}  # with --teacher-cache: its cache
        self.teacher_info: dict[str, dict[str, Any]] = {}
        self.vocab: dict[str, int] = {}  # tokenizer path -> its size, once the corpus is written
        # cell -> seed -> bits per byte; a KD cell's key is (teacher seed, seed)
        self.runs: dict[str, dict[Any, float]] = {}
        self.chosen: dict[str, str] = {}  # cell -> what its `target: auto` chose
        self.t0 = time.perf_counter()

    def teacher_jobs(self) -> list[Job]:
        """Writes the corpus, then one teacher run per tokenizer, the student's first, each with
        the sequence length that gives it the same bytes of text per step."""
        from crossdistill.models import load_tokenizer

        s, spec = self.spec.scale, self.spec
        self.data, train_texts = write_corpus(
            self.out, spec.corpora, train_bytes=s.train_bytes, val_bytes=s.val_bytes,
            student_bytes=s.student_train_bytes, text_field=spec.text_field,
            piece_bytes=s.piece_bytes, log=self.log,
        )  # fmt: skip
        self.log(f"[quality] corpus -> {self.data}")
        self.vocab = {p: len(load_tokenizer(p)) for p in [spec.student_tokenizer, *self.labels]}
        bpt_ref = bytes_per_token(spec.student_tokenizer, train_texts)
        everyone = [(spec.student_tokenizer, self.same_label), *self.labels.items()]
        jobs = []
        for path, label in everyone:
            bpt = bpt_ref if path == spec.student_tokenizer else bytes_per_token(path, train_texts)
            seq_len = max(16, round(s.seq_len * bpt_ref / bpt / 8) * 8)
            for seed in range(spec.teacher_seeds):
                jobs.append(self._teacher(path, label, self.vocab[path], seq_len, bpt, seed))
        return jobs

    def run(self) -> dict[str, Any]:
        s, spec = self.spec.scale, self.spec
        self.run_jobs(self.teacher_jobs())
        report = self.report()
        if report["refused"] and not self.spec.keep_going:
            return report  # the teachers alone say the comparison cannot be made
        vocab = self.vocab[spec.student_tokenizer]
        student = model_entry(s.student, spec.student_tokenizer, vocab)
        seeds = range(spec.seeds)
        self.run_jobs([self.student_job(self.cells[0], student, seed) for seed in seeds])
        report = self.report()
        if report["refused"] and not self.spec.keep_going:
            return report
        if s.teacher_cache:
            self.run_jobs([self.cache_job(*key) for key in self.teacher_paths], run=build_one)
        # seed-major: a run stopped early still has every cell at its first seeds
        self.run_jobs(
            [
                self.student_job(c, student, seed, t)
                for seed in seeds
                for t in range(spec.teacher_seeds)
                for c in self.cells[1:]
            ]
        )
        return self.report()

    def run_jobs(self, jobs: list[Job], run: Callable[[dict[str, Any]], float] = train_one) -> None:
        """Run `jobs` (`run`: train each; `build_one`: build each one's cache), `spec.jobs` at
        a time (each in a process of its own when more than one), logging each as it starts
        and recording each, with the seconds since its start, as it finishes."""
        if self.spec.jobs == 1 or len(jobs) == 1:
            for job in jobs:
                self.log(f"[quality] {job.describe}")
                start = time.perf_counter()
                job.done(run(to_dict(job.cfg)))
                self._record(job, start)
            return
        by_name = {job.name: job for job in jobs}
        assert len(by_name) == len(jobs), "two runs of one name"
        started: dict[str, float] = {}

        def begin(name: str) -> None:
            self.log(f"[quality] {by_name[name].describe}")
            started[name] = time.perf_counter()

        cfgs = {n: job.cfg for n, job in by_name.items()}
        for name, bpb in train_many(cfgs, self.spec.jobs, run, on_start=begin):
            by_name[name].done(bpb)
            self._record(by_name[name], started[name])

    def _teacher(
        self, path: str, label: str, vocab: int, seq_len: int, bpt: float, seed: int
    ) -> Job:
        from crossdistill.models.tokenizers import load_text_tokenizer, tokenizer_fingerprint

        s = self.spec.scale
        model = model_entry(s.teacher, path, vocab)
        probe = run_config(
            self.spec, self.data, self.out, model, steps=s.teacher_steps, lr=s.teacher_lr,
            seq_len=seq_len, batch=s.teacher_batch, seed=seed, progress=self.spec.jobs == 1,
            accum=s.teacher_accum,
        )  # fmt: skip
        fingerprint = tokenizer_fingerprint(load_text_tokenizer(path))
        # progress bars show, they do not train (`--jobs 1` turns them on, more jobs off): a
        # teacher trained under either setting is this teacher (`demo._same_run`)
        folders = [
            self.out / "teachers" / f"{label}-{config_hash(config, fingerprint)}"
            for config in (
                probe,
                replace(probe, run=replace(probe.run, progress=not probe.run.progress)),
            )
        ]
        run_dir = next((f for f in folders if (f / "config.json").is_file()), folders[0])
        cfg = replace(probe, run=replace(probe.run, out_dir=str(run_dir)))
        self.teacher_paths[(label, seed)] = run_dir / "final"
        kind = "the student's tokenizer" if label == self.same_label else "cross"
        several = self.spec.teacher_seeds > 1

        def done(bpb: float) -> None:
            by_seed = self.teacher_seed_bpb.setdefault(label, {})
            by_seed[seed] = bpb
            self.teachers[label] = sum(by_seed.values()) / len(by_seed)
            info = self.teacher_info.setdefault(
                label, {"tokenizer": path, "bytes_per_token": bpt, "seq_len": seq_len}
            )
            info["bpb"] = self.teachers[label]
            if several:
                info.setdefault("seeds", {})[str(seed)] = {"bpb": bpb, "run": str(run_dir)}
            else:
                info["run"] = str(run_dir)

        return Job(
            f"teacher-{label}",
            None,
            cfg,
            f"teacher {label} ({kind}{f', seed {seed}' if several else ''}): "
            f"{s.teacher_steps} steps of {s.teacher_batch * s.teacher_accum} x "
            f"{seq_len} tokens ({bpt:.2f} bytes per token)",
            done,
            teacher_seed=seed if several else None,
        )

    def _teacher_entry(self, label: str, teacher_seed: int, loss: str, target: str) -> dict:
        """A student's `teachers` entry for the teacher `label` trained from `teacher_seed`;
        with `--teacher-cache` it reads that teacher's cache (the path is kept so that the run
        checks the cache was built from it)."""
        s, spec = self.spec.scale, self.spec
        entry = {
            "name": "teacher",
            "path": str(self.teacher_paths[(label, teacher_seed)]),
            "dtype": "bfloat16" if s.device.startswith("cuda") else "float32",
            "loss": loss,
            "target": target,
            "top_k": spec.top_k,
            "temperature": spec.temperature,
        }
        if (label, teacher_seed) in self.cache_paths:
            entry["cache"] = str(self.cache_paths[(label, teacher_seed)])
        return entry

    def cache_job(self, label: str, teacher_seed: int) -> Job:
        """The cache build of the teacher `label` trained from `teacher_seed`: over the
        students' training text and the held-out text, at the students' top-k and temperature,
        in windows of the teacher's own sequence length. Its folder is named by a hash of the
        build's settings and the teacher's weights, so a retrained teacher gets a new cache."""
        from crossdistill.train.cache_build import weights_fingerprint

        s, spec = self.spec.scale, self.spec
        entry = self._teacher_entry(label, teacher_seed, SAME_LOSS, TeacherConfig.target)
        student = model_entry(s.student, spec.student_tokenizer, self.vocab[spec.student_tokenizer])
        # at the default KD weight whatever the students' weights: the cache holds the teacher's
        # top-k, which no weight changes, so students of every `--kd-ratio` share one build
        probe = run_config(
            spec, self.data, self.out, student, steps=1, lr=s.student_lr,
            seq_len=self.teacher_info[label]["seq_len"], batch=s.student_batch,
            seed=0, teachers=[entry], progress=False, train_file=student_train_file(self.data, s),
        )  # fmt: skip
        digest = config_hash(probe, weights_fingerprint(entry["path"]))
        several = spec.teacher_seeds > 1
        seed_part = f"-teacher{teacher_seed}" if several else ""
        folder = self.out / "caches" / f"{label}{seed_part}-{digest}"
        self.cache_paths[(label, teacher_seed)] = folder
        cfg = replace(probe, run=replace(probe.run, out_dir=str(folder)))

        def done(bpb: float) -> None:
            info = self.teacher_info[label]
            caches = info.setdefault("caches", {})
            caches[str(teacher_seed)] = {"folder": str(folder), "bpb_on_cached_text": bpb}

        return Job(
            f"cache-{label}",
            None,
            cfg,
            f"teacher cache {label}{f' (teacher seed {teacher_seed})' if several else ''}: "
            "the students' and the held-out text",
            done,
            teacher_seed=teacher_seed if several else None,
        )

    def student_job(
        self, cell: Cell, student: dict[str, Any], seed: int, teacher_seed: int = 0
    ) -> Job:
        """The student run of `cell` at `seed`, learning from the teacher trained from
        `teacher_seed` (its folder `seedS`, or `seedS-teacherT` past the first teacher seed)."""
        s, spec = self.spec.scale, self.spec
        teachers = []
        if cell.teacher is not None:
            terms = target_terms(cell.target)
            for name, target in terms:
                entry = self._teacher_entry(cell.teacher, teacher_seed, cell.loss, target)
                teachers.append(
                    {
                        **entry,
                        "name": name,
                        "kd_chunks": cell.kd_chunks,
                        "past_end": cell.past_end,
                        "many_chunks": cell.many_chunks,
                        "deep_alternatives": cell.deep_alternatives,
                        "boundary": cell.boundary,
                        "split_context": cell.split_context,
                    }
                )
                if len(terms) > 1:  # one KD term per target, the weight shared equally
                    teachers[-1]["weight"] = 1 / len(terms)
        folder = f"seed{seed}" + (f"-teacher{teacher_seed}" if teacher_seed else "")
        run_dir = self.out / "students" / cell.name / folder
        cfg = run_config(
            spec, self.data, run_dir, student, steps=s.student_steps, lr=s.student_lr,
            seq_len=s.seq_len, batch=s.student_batch, seed=seed, teachers=teachers,
            progress=False, train_file=student_train_file(self.data, s),
            ce_without_kd=cell.ce_without_kd, kd_warmup_steps=cell.kd_warmup_steps,
            kd_ratio=cell.kd_ratio,
        )  # fmt: skip

        cross = cell.teacher not in (None, self.same_label)
        # what `auto` chose is reported for the projected losses only: the others use no target
        projected = cell.loss in DISTRIBUTION_LOSSES
        if cross and projected and cell.target == "auto" and cell.name not in self.chosen:
            self.chosen[cell.name] = chosen_target(cfg)

        key: Any = seed if cell.teacher is None else (teacher_seed, seed)
        several = cell.teacher is not None and spec.teacher_seeds > 1

        def done(bpb: float) -> None:
            self.runs.setdefault(cell.name, {})[key] = bpb

        describe = f"student {cell.name} seed {seed}"
        if several:
            describe += f", teacher seed {teacher_seed}"
        return Job(
            cell.name, seed, cfg, describe, done, teacher_seed=teacher_seed if several else None
        )

    def _record(self, job: Job, start: float) -> None:
        row: dict[str, Any] = {"cell": job.cell}
        if job.seed is not None:
            row["seed"] = job.seed
        if job.teacher_seed is not None:
            row["teacher_seed"] = job.teacher_seed
        row["bpb"] = job.bpb
        row["seconds"] = round(time.perf_counter() - start, 1)
        with open(self.out / "cells.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.log(f"[quality] {job.name}: {row['bpb']:.4f} bits per byte ({row['seconds']} s)")
        self.report()

    def report(self) -> dict[str, Any]:
        """The summary so far, also written to OUT/summary.json."""
        report = summarize(
            self.teachers, self.runs, self.cells, self.same_label, self.spec,
            self.teacher_seed_bpb,
        )  # fmt: skip
        for entry in report["cross"]:
            if entry["cell"] in self.chosen:
                entry["chosen_target"] = self.chosen[entry["cell"]]
        s = self.spec.scale
        report["teacher_runs"] = self.teacher_info
        report["settings"] = {
            "scale": self.spec.scale_name,
            "seeds": self.spec.seeds,
            "teacher_seeds": self.spec.teacher_seeds,
            "losses": self.spec.losses,
            "targets": self.spec.targets,
            "kd_chunks": self.spec.kd_chunks,
            "past_end": self.spec.past_end,
            "many_chunks": self.spec.many_chunks,
            "deep_alternatives": self.spec.deep_alternatives,
            "boundary": self.spec.boundary,
            "split_context": self.spec.split_context,
            "ce_without_kd": self.spec.ce_without_kd,
            "kd_warmup_steps": self.spec.kd_warmup_steps,
            "kd_ratios": self.spec.kd_ratios,
            "top_k": self.spec.top_k,
            "temperature": self.spec.temperature,
            "student_tokenizer": self.spec.student_tokenizer,
            "teacher_tokenizers": self.spec.teacher_tokenizers,
            "corpus": self.spec.corpora or ["python standard library (the demo's corpus)"],
            # a hash of the training and held-out text as the bench split it (it names the folder
            # OUT/data/DIGEST): two runs read the same text only where theirs agree, whatever
            # their corpus paths say
            "corpus_digest": self.data.name,
            "text_field": self.spec.text_field,
            "piece_bytes": s.piece_bytes,
            "teacher": {
                **s.teacher,
                "steps": s.teacher_steps,
                "batch": s.teacher_batch * s.teacher_accum,
                "lr": s.teacher_lr,
            },
            "student": {
                **s.student,
                "steps": s.student_steps,
                "batch": s.student_batch,
                "lr": s.student_lr,
                "train_bytes": s.student_train_bytes,
            },
            "seq_len": s.seq_len,
            "device": s.device,
            "teacher_cache": s.teacher_cache,
            "versions": library_versions(),
        }
        report["seconds"] = round(time.perf_counter() - self.t0, 1)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(self.out / "summary.json")
        return report

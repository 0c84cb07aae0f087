"""Tokenize and align a JSONL file of texts on all cores.

Input lines are `{"text": ...}`; output lines are
`{"student_ids": [...], "teacher_ids": [...], "chunks": [[s0, s1, t0, t1], ...]}`, in input
order (blank input lines are skipped). Worker processes are forked after the tokenizers and
byte tables are loaded, so each starts with them in memory; each batch is tokenized with the
Rust batch encoder and aligned with NumPy.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crossdistill.alignment.batch import align_batch
from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.errors import UserError

BATCH_LINES = 64


@dataclass
class Pipeline:
    """Both tokenizers and their byte tables; `run_batch` is what every worker executes."""

    tok_s: object
    tok_t: object
    bytes_s: TokenBytes
    bytes_t: TokenBytes
    add_special_tokens: bool = True

    @classmethod
    def load(cls, student: str, teacher: str, add_special_tokens: bool = True) -> Pipeline:
        from crossdistill.models import load_tokenizer

        tok_s, tok_t = load_tokenizer(student), load_tokenizer(teacher)
        return cls(
            tok_s,
            tok_t,
            TokenBytes.from_tokenizer(tok_s),
            TokenBytes.from_tokenizer(tok_t),
            add_special_tokens,
        )

    def encode(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Both tokenizations of each text, as the tokenizers' own `tok(text)` gives them."""
        special = self.add_special_tokens
        enc_s = self.tok_s.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=special)
        enc_t = self.tok_t.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=special)
        return [e.ids for e in enc_s], [e.ids for e in enc_t]

    def run_batch(self, batch: tuple[str, int, list[bytes]], stage: str = "full"):
        """(source name, first line number, raw lines) -> (one JSON line per text, CPU seconds
        spent tokenizing, aligning and writing JSON in this process).

        stage: "tokenize" stops after tokenizing, "align" after aligning (both give empty
        lines; they exist to time the stages), "full" also writes the JSON.
        """
        source, first_line, raw = batch
        start = time.process_time()  # the whole process: the Rust encoder may use threads
        texts = [parse_line(line, source, first_line + i) for i, line in enumerate(raw)]
        texts = [t for t in texts if t is not None]
        ids_s, ids_t = self.encode(texts)
        tokenized = time.process_time()
        if stage == "tokenize":
            return [""] * len(texts), (tokenized - start, 0.0, 0.0)
        alignments = [r.chunks for r in align_batch(ids_s, ids_t, self.bytes_s, self.bytes_t)]
        aligned = time.process_time()
        if stage != "full":
            return [""] * len(texts), (tokenized - start, aligned - tokenized, 0.0)
        out = [
            json.dumps(
                {"student_ids": a, "teacher_ids": b, "chunks": c.tolist()}, separators=(",", ":")
            )
            for a, b, c in zip(ids_s, ids_t, alignments)
        ]
        cpu = (tokenized - start, aligned - tokenized, time.process_time() - aligned)
        return out, cpu


def parse_line(line: bytes, source: str, number: int) -> str | None:
    """The text of one JSONL line (None for a blank line), or a UserError naming the line."""
    try:
        decoded = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{source}:{number}: not valid UTF-8 (byte {e.start} of the line: {e.reason}); "
            "re-encode the file as UTF-8"
        ) from None
    if not decoded.strip():
        return None
    try:
        record = json.loads(decoded)
    except json.JSONDecodeError as e:
        raise UserError(f"{source}:{number}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise UserError(f'{source}:{number}: expected an object with a string "text" field')
    return record["text"]


def read_batches(path: Path, lines_per_batch: int = BATCH_LINES) -> Iterator[tuple]:
    """(source name, first line number, raw lines) batches of a file, read in binary so that a
    bad byte is reported with its line number rather than failing the whole read."""
    if not path.is_file():
        raise UserError(f"input file {path} does not exist")
    with open(path, "rb") as f:
        batch, first = [], 1
        for number, line in enumerate(f, start=1):
            if not batch:
                first = number
            batch.append(line)
            if len(batch) == lines_per_batch:
                yield (str(path), first, batch)
                batch = []
        if batch:
            yield (str(path), first, batch)


_WORKER: Pipeline | None = None


def _run_in_worker(job: tuple[tuple, str]) -> tuple[list[str], tuple[float, float, float]]:
    assert _WORKER is not None
    batch, stage = job
    return _WORKER.run_batch(batch, stage)


def _quiet_tokenizer_threads() -> None:
    """One process per core already: the Rust encoder must not start its own threads too."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def process_file(
    pipeline: Pipeline,
    input_path: Path,
    output_path: Path | None,
    workers: int = 0,
    stage: str = "full",
) -> dict:
    """Tokenize (and align) every line of `input_path`; write JSON lines to `output_path`.

    workers: processes to use (0: one per core); stage: see `Pipeline.run_batch`. Returns the
    number of texts, the wall time and the CPU seconds of each stage summed over workers.
    Output goes to a temporary file renamed at the end, so a failure leaves no half-written
    output.
    """
    global _WORKER
    workers = workers or available_cores()
    start = time.perf_counter()
    num_lines = 0
    cpu = [0.0, 0.0, 0.0]
    tmp = output_path.with_name(output_path.name + ".part") if output_path else None
    sink = open(tmp, "w", encoding="utf-8") if tmp else None  # noqa: SIM115
    try:
        jobs = ((batch, stage) for batch in read_batches(input_path))
        _WORKER = pipeline
        if workers == 1:
            results = map(_run_in_worker, jobs)
            pool = None
        else:
            # Fork: children inherit the loaded tokenizers and byte tables.
            context = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else None)
            pool = context.Pool(workers, initializer=_quiet_tokenizer_threads)
            results = pool.imap(_run_in_worker, jobs, chunksize=1)
        try:
            for lines, seconds in results:
                num_lines += len(lines)
                cpu = [total + part for total, part in zip(cpu, seconds)]
                if sink is not None:
                    sink.writelines(line + "\n" for line in lines)
        finally:
            if pool is not None:
                pool.terminate()
        if sink is not None:
            sink.close()
            os.replace(tmp, output_path)
    except BaseException:
        if sink is not None:
            sink.close()
            tmp.unlink(missing_ok=True)
        raise
    finally:
        _WORKER = None
    return {
        "lines": num_lines,
        "seconds": time.perf_counter() - start,
        "workers": workers,
        "cpu_seconds": dict(zip(("tokenize", "align", "json"), cpu)),
    }

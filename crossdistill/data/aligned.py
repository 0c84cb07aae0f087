"""Tokenize and align a corpus file on all cores, exactly as training tokenizes it.

Input: any corpus format the trainer reads (JSONL, plain text, Parquet, Arrow, a `datasets`
folder; `crossdistill.data.sources`), one text per row. Output lines are
`{"student_ids": [...], "teacher_ids": [...], "chunks": [[s0, s1, t0, t1], ...]}`, in input
order (blank JSONL lines are skipped). Each text is encoded as a training document is
(`TokenizerSide`): start tokens, the text as text (a literal `<s>` or `<|im_start|>` in it is
characters, never a control token), the end-of-document token.

Start-up is a small part of a run: the tokenizers come from the disk cache of converted
tokenizers (`models.tokenizers.load_text_tokenizer`) and byte tables (`TokenBytes`), and
torch is never imported. Worker processes are forked after that, so each starts with
everything in memory.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crossdistill.alignment.batch import align_batch
from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.sources import Bad, open_source
from crossdistill.errors import UserError

BATCH_ROWS = 64


@dataclass
class Pipeline:
    """Both tokenizers as the data pipeline uses them; `run_batch` is what every worker runs."""

    side_s: TokenizerSide
    side_t: TokenizerSide
    add_special_tokens: bool = True

    @classmethod
    def load(
        cls, student: str, teacher: str, add_special_tokens: bool = True, fast: bool = True
    ) -> Pipeline:
        """`fast`: also build the tiktoken encoders (a second or two each; worth it for files)."""
        from crossdistill.models.tokenizers import load_text_tokenizer

        sides = [TokenizerSide(load_text_tokenizer(s), fast=fast) for s in (student, teacher)]
        return cls(sides[0], sides[1], add_special_tokens)

    @property
    def bytes_s(self) -> TokenBytes:
        return self.side_s.token_bytes

    @property
    def bytes_t(self) -> TokenBytes:
        return self.side_t.token_bytes

    def encode(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Both tokenizations of each text, as training encodes a document (with its start
        and end tokens unless `add_special_tokens` is off)."""
        return [self._encode(self.side_s, t) for t in texts], [
            self._encode(self.side_t, t) for t in texts
        ]

    def _encode(self, side: TokenizerSide, text: str) -> list[int]:
        ids = side.encode_content(text)
        if self.add_special_tokens:
            end = [] if side.doc_end_id is None else [side.doc_end_id]
            ids = np.concatenate([side.start_ids, ids, np.asarray(end, dtype=np.int64)])
        return ids.tolist()

    def run_batch(self, batch: tuple[str, list[str]], stage: str = "full"):
        """(source name, texts) -> (one JSON line per text, CPU seconds spent tokenizing,
        aligning and writing JSON in this process).

        stage: "tokenize" stops after tokenizing, "align" after aligning (both give empty
        lines; they exist to time the stages), "full" also writes the JSON.
        """
        _, texts = batch
        start = time.process_time()  # the whole process: the Rust encoder may use threads
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


def read_batches(
    path: Path, fmt: str = "auto", field: str = "text", rows_per_batch: int = BATCH_ROWS
) -> Iterator[tuple[str, list[str]]]:
    """(source name, texts) batches of a corpus file in any training format; a row that is not
    a text is one `UserError` naming its file and row."""
    if not Path(path).exists():
        raise UserError(f"input file {path} does not exist")
    source = open_source(str(path), fmt, field)
    for lo in range(0, source.num_rows, rows_per_batch):
        hi = min(lo + rows_per_batch, source.num_rows)
        texts = []
        for row, value in zip(range(lo, hi), source.read(lo, hi)):
            if value is None:  # a blank JSONL line
                continue
            texts.append(_text(value, source.where(row), field))
        if texts:
            yield (str(path), texts)


def _text(value: Any, where: str, field: str) -> str:
    if isinstance(value, Bad):
        raise UserError(f"{where}: {value.reason}")
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(
                f"{where}: not valid UTF-8 (byte {e.start}); re-encode as UTF-8"
            ) from None
    if not isinstance(value, str):
        raise UserError(f"{where}: field {field!r} is a {type(value).__name__}, not a string")
    return value


# Building the tiktoken tables of two 150k vocabularies costs about 2.5 s once; they save about
# 1.8 CPU-seconds per MB of text over the `tokenizers` library, spread over the workers.
_FAST_PAYS_OFF_MB_PER_WORKER = 1.5


def worth_fast_encoders(path: Path, workers: int = 0) -> bool:
    """Whether building the fast encoders pays off for a corpus of this size."""
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    size_mb = sum(p.stat().st_size for p in files) / 2**20
    return size_mb > _FAST_PAYS_OFF_MB_PER_WORKER * (workers or available_cores())


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
    fmt: str = "auto",
    field: str = "text",
) -> dict:
    """Tokenize (and align) every text of `input_path`; write JSON lines to `output_path`.

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
        jobs = ((batch, stage) for batch in read_batches(input_path, fmt, field))
        _WORKER = pipeline
        if workers == 1:
            results = map(_run_in_worker, jobs)
            pool = None
        else:
            # Fork: children inherit the loaded tokenizers and byte tables (no torch, no CUDA
            # in this process, so nothing a child could trip over).
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

"""The corpus of `crossdistill bench quality`: documents cut into pieces, split once into
training and held-out text by a hash of each piece, written as JSONL in a folder named by its
content; the students' share of the training text spread through it; a tokenizer's bytes per
token on it. The corpus is read only as far as the split needs (`CorpusReader`). Reads files
with `data.sources`, takes the students' share with `data.documents`, counts tokens with
`models`, and takes the demo's corpus from `train` when none is given."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from crossdistill.data.documents import spread_pieces
from crossdistill.errors import UserError

PIECE_BYTES = 16_384  # documents are cut into pieces of about this size, at a line end
MIN_PIECE_BYTES = 256  # a piece holds a few lines at least
VAL_EVERY = 20  # at most about one piece in this many is held out


class CorpusReader:
    """The corpus's text documents (`data.documents.TextDocuments`: any format the trainer
    reads, the files read only as far as the consumer takes them) cut into pieces of about
    `piece_bytes` at line ends, so that a corpus of a few long texts still splits into training
    and held-out text, and a training step reads from several places in it."""

    def __init__(
        self, corpora: list[str], text_field: str = "text", piece_bytes: int = PIECE_BYTES
    ):
        from crossdistill.data.documents import TextDocuments

        self.documents = TextDocuments(corpora, text_field)
        self.piece_bytes = piece_bytes

    @property
    def rows(self) -> int:
        return self.documents.rows

    def __iter__(self) -> Iterator[str]:
        for doc in self.documents:
            yield from _cut(doc, self.piece_bytes)

    def note(self) -> str | None:
        """How many of the rows read were skipped, and why the first was; None when none."""
        note = self.documents.note()
        return None if note is None else f"[quality] {note}"

    def unread_note(self, num_bytes: int) -> str | None:
        """A warning naming the corpus files the read of `num_bytes` never reached; None when
        it reached them all."""
        unread = self.documents.unread()
        if not unread:
            return None
        return (
            f"[quality] warning: {', '.join(unread)} not read: the corpus files are read in "
            f"order, and the {num_bytes / 1e6:.1f} MB this scale takes (training and held-out "
            "text) came from the files before; to have every file in the experiment, mix their "
            "documents into one corpus file, or name the one you need first"
        )


def corpus_pieces(
    corpora: list[str],
    text_field: str = "text",
    log: Callable[[str], None] | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> list[str]:
    """Every piece of the corpus (`CorpusReader`); `log` hears how many rows were skipped."""
    reader = CorpusReader(corpora, text_field, piece_bytes)
    pieces = list(reader)
    if log is not None and (note := reader.note()) is not None:
        log(note)
    return pieces


def _cut(text: str, piece_bytes: int) -> list[str]:
    out: list[str] = []
    start = 0
    while start < len(text):
        stop = start + piece_bytes
        if stop < len(text):
            newline = text.rfind("\n", start + piece_bytes // 2, stop)
            stop = newline + 1 if newline >= 0 else stop
        out.append(text[start:stop])
        start = stop
    return out


def split_pieces(
    pieces: Iterable[str], train_bytes: int, val_bytes: int
) -> tuple[list[str], list[str]]:
    """Training and held-out pieces of the first `train_bytes + val_bytes` of the corpus (all of
    it, when it is shorter), each piece held out by a hash of its text (no seed: the same split
    for every run) at the rate that gives about `val_bytes`, at most one piece in `VAL_EVERY`.

    The held-out pieces are drawn from the whole stretch the training text is, not from its
    start: a corpus of files in order (a library by path) changes along its length, and a
    held-out text from its first part alone is another text than the one trained on (Perl's
    library held out 1.2% digits from its first 2 MB against the 16% of the 6 MB trained on;
    benchmarks/README.md, "The groups on Perl's near pair, and the held-out text from the whole
    of the training stretch")."""
    read: list[str] = []
    total = 0
    for piece in pieces:
        if total >= train_bytes + val_bytes:
            break
        read.append(piece)
        total += len(piece.encode())
    rate = min(val_bytes / total, 1.0 / VAL_EVERY) if total else 0.0
    train: list[str] = []
    val: list[str] = []
    for piece in read:
        held = int(hashlib.sha256(piece.encode()).hexdigest()[:8], 16) < rate * 2**32
        (val if held else train).append(piece)
    if not val or not train:
        raise UserError(
            f"the corpus ({len(read)} pieces) is too small to hold "
            "out text for scoring; give a corpus of at least a few hundred kilobytes"
        )
    return train, val


def write_corpus(
    out: Path,
    corpora: list[str],
    *,
    train_bytes: int,
    val_bytes: int,
    student_bytes: int | None = None,
    text_field: str = "text",
    piece_bytes: int = PIECE_BYTES,
    log: Callable[[str], None] | None = None,
) -> tuple[Path, list[str]]:
    """Training and held-out JSONL in a folder named by their content (a changed corpus is a new
    folder, so nothing trained on the old one is reused); returns it and the training texts.
    With `student_bytes` the students' share of the training text is written beside them
    (`share_path`). `text_field` and `piece_bytes` are `CorpusReader`'s; `log` hears how many
    rows it skipped and which corpus files it never reached."""
    if corpora:
        reader = CorpusReader(corpora, text_field, piece_bytes)
        train, val = split_pieces(reader, train_bytes, val_bytes)
        if log is not None:
            for note in (reader.note(), reader.unread_note(train_bytes + val_bytes)):
                if note is not None:
                    log(note)
    else:
        from crossdistill.train.demo_assets import stdlib_corpus

        files, held_files = stdlib_corpus(
            max_files=100_000, seed=0, train_bytes=train_bytes, val_bytes=val_bytes
        )
        # split by file (no held-out file is trained on), then cut as a `--corpus` is, so that
        # a step reads several files rather than the rows of one (benchmarks/README.md,
        # "`bench quality`'s default corpus in pieces")
        train = [piece for text in files for piece in _cut(text, piece_bytes)]
        val = [piece for text in held_files for piece in _cut(text, piece_bytes)]
    digest = hashlib.sha256()
    for text in [*train, "\0", *val]:
        digest.update(text.encode())
        digest.update(b"\0")
    folder = out / "data" / digest.hexdigest()[:12]
    folder.mkdir(parents=True, exist_ok=True)
    _write_jsonl(folder / "train.jsonl", train)
    _write_jsonl(folder / "val.jsonl", val)
    if student_bytes is not None:
        write_student_share(folder, train, student_bytes)
    return folder, train


def write_student_share(data: Path, train: list[str], num_bytes: int) -> Path:
    """About `num_bytes` of `train` in whole pieces taken at an even stride through it
    (`spread_pieces`), written beside the training text in the corpus folder `data`; returns the
    file (`share_path`)."""
    path = share_path(data, num_bytes)
    _write_jsonl(path, spread_pieces(train, num_bytes))
    return path


def share_path(data: Path, num_bytes: int) -> Path:
    """Where `write_student_share` writes `num_bytes` of the training text in the corpus folder
    `data`."""
    return data / f"train-spread-{num_bytes}.jsonl"


def _write_jsonl(path: Path, texts: list[str]) -> None:
    """`texts` as JSONL rows `{"text": ...}`, written beside and renamed; kept when present (the
    folder is named by its content)."""
    if path.is_file():
        return
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    tmp.replace(path)


def bytes_per_token(tokenizer: str, texts: list[str], sample_bytes: int = 2_000_000) -> float:
    """UTF-8 bytes per token of `tokenizer` on `sample_bytes` of `texts` spread through them."""
    from crossdistill.models.tokenizers import load_text_tokenizer

    backend = load_text_tokenizer(tokenizer).backend_tokenizer
    sample = spread_pieces(texts, sample_bytes)
    size = sum(len(text.encode()) for text in sample)
    tokens = sum(len(e.ids) for e in backend.encode_batch(sample, add_special_tokens=False))
    return size / max(tokens, 1)

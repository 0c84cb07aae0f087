"""Ingredients of `crossdistill demo`: a corpus and two different tokenizers, made on the spot.

The demo must run anywhere with no network and no data files, so its corpus is the Python
standard library's own source code on this machine, split held-out by file, and its two
tokenizers are trained on that corpus in a few seconds:

- teacher: byte-level BPE (GPT-2 style: `Ġ` for space, the GPT-2 split regex), 4096 tokens;
- student: SentencePiece-style BPE (Llama-2 style: `▁` for space, a dummy prefix space, splits on
  whitespace only, `<0xNN>` byte fallback, a BOS before every text), 3072 tokens.

They cut text differently (different pre-tokenisation, space marker, vocabulary size and unknown
character handling), so the distillation between them is a genuine cross-tokenizer one. Both
round-trip any text exactly, with one documented exception: the student decodes a literal `▁`
(U+2581) as a space, as SentencePiece does; the stdlib sources hold none.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

from crossdistill.errors import UserError

# All demo corpus and tokenizer sizes, in one place: chosen so that the whole demo (corpus,
# tokenizers, teacher, two students) fits in 5 minutes on 2 CPU cores.
DEMO_SIZES = {
    "max_files": 400,  # stdlib files read at most (about 670 usable in CPython 3.11)
    "max_file_bytes": 200_000,  # skip the few huge generated files (pydoc topics, codec tables)
    "train_bytes": 3_000_000,  # training text, whole files
    "val_bytes": 300_000,  # held-out text, other whole files
    "teacher_vocab": 4096,
    "student_vocab": 3072,  # including the 256 byte-fallback tokens
}

STUDENT_DIR = "tokenizer_student"
TEACHER_DIR = "tokenizer_teacher"
FINGERPRINT_FILE = "crossdistill_demo.json"
_FORMAT = 3  # bump when the recipes below change, so cached tokenizers are retrained
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
_MIN_FILES = 2  # one to train on and one held out

TEACHER_SPECIALS = {
    "bos_token": "<|endoftext|>",
    "eos_token": "<|endoftext|>",
    "pad_token": "<|pad|>",
}
STUDENT_SPECIALS = {
    "unk_token": "<unk>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
}
SPIECE_SPACE = "\u2581"  # "▁"
STUDENT_ALPHABET = 200  # characters the student's BPE starts from; rarer ones use byte fallback
# The student's split: whitespace-separated words keep their leading "▁",
# runs of whitespace (indentation) stay together apart from the space that starts the next word.
_STUDENT_SPLIT = r"▁?[^\s▁]+|[\s▁]+(?![^\s▁])|[\s▁]+"


# ----------------------------------------------------------------------------- corpus


def stdlib_corpus(
    max_files: int = DEMO_SIZES["max_files"],
    seed: int = 0,
    *,
    train_bytes: int = DEMO_SIZES["train_bytes"],
    val_bytes: int = DEMO_SIZES["val_bytes"],
    root: str | Path | None = None,
) -> tuple[list[str], list[str]]:
    """`(train_texts, val_texts)`: whole `.py` files of the standard library at `root` (default:
    this interpreter's), shuffled with `seed` and split by file, so no held-out file was seen.

    Validation takes files first, up to `val_bytes` (and at most a tenth of the files read, at
    least one), then training up to `train_bytes`. Skips tests, idlelib, site-packages, files
    over `DEMO_SIZES["max_file_bytes"]`, and files that are not UTF-8.
    """
    stdlib = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = _source_files(stdlib)
    random.Random(seed).shuffle(files)
    texts = _read_texts(files, max_files)
    if len(texts) < _MIN_FILES:
        raise UserError(
            f"the demo trains on the Python standard library's .py sources, but only "
            f"{len(texts)} readable ones were found under {stdlib}. Install the Python sources "
            f"(e.g. the full python3 package rather than a minimal/.pyc-only one) or train on "
            f"your own data with `crossdistill train`"
        )
    max_val_files = max(1, len(texts) // 10)
    val: list[str] = []
    size = 0
    while len(val) < max_val_files and size < val_bytes:
        val.append(texts[len(val)])
        size += len(val[-1].encode())
    train: list[str] = []
    size = 0
    for text in texts[len(val) :]:
        if size >= train_bytes:
            break
        train.append(text)
        size += len(text.encode())
    return train, val


def _source_files(stdlib: Path) -> list[Path]:
    files: list[Path] = []
    if not stdlib.is_dir():
        return files
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return files  # sorted walk: the same list on every run, so `seed` decides the split


def _read_texts(files: list[Path], max_files: int) -> list[str]:
    texts = []
    for path in files:
        if len(texts) >= max_files:
            break
        try:
            if path.stat().st_size > DEMO_SIZES["max_file_bytes"]:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append(text)
    return texts


# ----------------------------------------------------------------------------- tokenizers


def train_demo_tokenizers(
    train_texts: Sequence[str],
    out_dir: str | Path,
    *,
    val_texts: Sequence[str] = (),
    teacher_vocab: int = DEMO_SIZES["teacher_vocab"],
    student_vocab: int = DEMO_SIZES["student_vocab"],
) -> tuple[Path, Path]:
    """Train (or reuse) the demo tokenizers on `train_texts`; returns `(student_dir, teacher_dir)`,
    Hugging Face folders that `crossdistill.models.load_tokenizer` loads.

    Cached: folders whose fingerprint (corpus content, sizes, recipe version) matches are
    reused. Both tokenizers, as loaded from disk, are checked to round-trip `val_texts` and a
    few awkward strings exactly (`decode(encode(x)) == x`).
    """
    if not train_texts:
        raise UserError("cannot train the demo tokenizers on an empty corpus")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fingerprint = _fingerprint(train_texts, teacher_vocab, student_vocab)
    student_dir, teacher_dir = out_dir / STUDENT_DIR, out_dir / TEACHER_DIR
    recipes = (
        (teacher_dir, lambda: _train_teacher(train_texts, teacher_vocab), TEACHER_SPECIALS),
        (student_dir, lambda: _train_student(train_texts, student_vocab), STUDENT_SPECIALS),
    )
    trained = False
    for folder, train, specials in recipes:
        if _cached_fingerprint(folder) != fingerprint:
            _save_hf_folder(train(), specials, folder, fingerprint)
            trained = True
    if trained:
        from crossdistill.models import load_tokenizer

        load_tokenizer.cache_clear()  # the same paths may hold other tokenizers than before
    check_round_trip(student_dir, val_texts)
    check_round_trip(teacher_dir, val_texts)
    return student_dir, teacher_dir


def _train_teacher(texts: Sequence[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = list(dict.fromkeys(TEACHER_SPECIALS.values()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def _train_student(texts: Sequence[str], vocab_size: int):
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPIECE_SPACE), normalizers.Replace(" ", SPIECE_SPACE)]
    )
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_STUDENT_SPLIT), behavior="isolated")
    # The dummy prefix space is removed again on decoding, as in Llama-2's tokenizer.
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace(SPIECE_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    # The trainer's own `limit_alphabet` breaks ties in character counts in hash-map order,
    # which differs from one training to the next: the alphabet is chosen here, and the trainer
    # keeps exactly it (its characters count as infinitely frequent, so every other one goes).
    alphabet = student_alphabet(texts, tok.normalizer, STUDENT_ALPHABET)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 256,  # room for the byte tokens added below
        special_tokens=list(STUDENT_SPECIALS.values()),
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # BpeTrainer does not create the <0xNN> tokens byte fallback needs: append them to the
    # model's vocabulary (not as added tokens, which would match "<0x41>" typed in the text).
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = STUDENT_SPECIALS["unk_token"]
    student = Tokenizer.from_str(json.dumps(spec))
    # Like Llama-2, the student puts a BOS before every text; the teacher, like GPT-2, does not.
    bos = STUDENT_SPECIALS["bos_token"]
    student.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, student.token_to_id(bos))],
    )
    return student


def student_alphabet(texts: Sequence[str], normalizer, limit: int) -> list[str]:
    """The `limit` most frequent characters of `texts` as `normalizer` leaves them (the
    characters the trainer counts), ties broken by code point; the rarer ones go through byte
    fallback."""
    from collections import Counter

    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(normalizer.normalize_str(text))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], ord(kv[0])))
    return sorted(c for c, _ in ranked[:limit])


def _save_hf_folder(backend, specials: dict[str, str], folder: Path, fingerprint: str) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, clean_up_tokenization_spaces=False, **specials
    )
    # Write beside the final folder, then swap it in: a killed run never leaves half a tokenizer.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        tok.save_pretrained(str(tmp))
        (tmp / FINGERPRINT_FILE).write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
        if folder.exists():
            shutil.rmtree(folder)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def check_round_trip(tokenizer_dir: str | Path, texts: Sequence[str]) -> None:
    """Raise if the tokenizer saved at `tokenizer_dir` does not give back `texts` (plus a few
    probes: leading spaces, tabs, non-ASCII, special-token names) from their ids.

    Text is encoded as the data pipeline encodes document content: no BOS/EOS added and special
    token names read as plain text. The student's one documented exception, a literal `▁` in the
    text, is not checked.
    """
    from crossdistill.models import load_tokenizer

    tok = load_tokenizer(str(tokenizer_dir))
    content = type(tok.backend_tokenizer).from_str(tok.backend_tokenizer.to_str())
    content.encode_special_tokens = True
    probes = ["  two leading spaces", "\ttab\r\nCRLF", "naïve ünïcödé → ∑ 😀", "<0x41> <bos>", ""]
    for text in [*probes, *texts]:
        if SPIECE_SPACE in text:
            continue
        back = tok.decode(content.encode(text, add_special_tokens=False).ids)
        if back != text:
            at = next(
                (i for i, (a, b) in enumerate(zip(back, text)) if a != b), min(len(back), len(text))
            )
            raise RuntimeError(
                f"tokenizer {tokenizer_dir} does not round-trip text: first difference at "
                f"character {at}: {text[max(0, at - 20) : at + 20]!r} -> "
                f"{back[max(0, at - 20) : at + 20]!r}"
            )


def _fingerprint(texts: Sequence[str], teacher_vocab: int, student_vocab: int) -> str:
    h = hashlib.sha256(f"{_FORMAT}:{teacher_vocab}:{student_vocab}:{len(texts)}".encode())
    for text in texts:
        data = text.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _cached_fingerprint(folder: Path) -> str | None:
    try:
        return json.loads((folder / FINGERPRINT_FILE).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None

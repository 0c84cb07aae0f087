"""Vocabulary projection: a sparse `[V_t, V_s]` matrix mapping a teacher next-token
distribution onto the student vocabulary, `q_s = sum_t p_t * W[t, s]`.

Default, `first_piece`: teacher token t's bytes, tokenized by the student tokenizer, put
weight 1 on the first student token, the student's next token when the teacher's is t. An
exact match (a student token with the same bytes) is the case where that piece is all of t.
`multi_piece` spreads the weight over all the pieces, in proportion to their byte lengths.
Special tokens map to the student special token of the same name, if any; teacher tokens with
no text and no such counterpart get an empty row (`first_piece == -1`).

Built from both vocabularies' byte tables and one batched encode of the teacher tokens' text
(never a dense matrix), stored as safetensors with both tokenizers' fingerprints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from crossdistill.alignment.token_bytes import TokenBytes
from crossdistill.errors import UserError

MODES = ("first_piece", "multi_piece")
_FORMAT = "crossdistill.projection.v1"


@dataclass(frozen=True, eq=False)
class Projection:
    """Sparse teacher-to-student vocabulary map.

    first_piece: [V_t] int64, the student id each teacher id maps to (-1: empty row)
    exact:       [V_t] bool, the teacher token's bytes (or special name) equal that student token's
    rows, cols:  [nnz] int64, COO coordinates, sorted by row then column
    weights:     [nnz] float32, each non-empty row sums to 1
    """

    first_piece: torch.Tensor
    exact: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    weights: torch.Tensor
    vocab_size_s: int
    mode: str
    fingerprint_t: str
    fingerprint_s: str
    name_t: str = ""
    name_s: str = ""

    @property
    def vocab_size_t(self) -> int:
        return int(self.first_piece.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.vocab_size_t, self.vocab_size_s)

    def to_sparse(self) -> torch.Tensor:
        """The matrix as a sparse COO tensor [V_t, V_s] (float32)."""
        index = torch.stack((self.rows, self.cols))
        # Entries are sorted by (row, col) and unique: already coalesced.
        return torch.sparse_coo_tensor(
            index, self.weights, self.shape, check_invariants=True, is_coalesced=True
        )

    def csr(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(crow [V_t + 1], cols [nnz], weights [nnz]): the matrix in CSR form."""
        counts = torch.bincount(self.rows, minlength=self.vocab_size_t)
        crow = torch.zeros(self.vocab_size_t + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=crow[1:])
        return crow, self.cols, self.weights

    def stats(self) -> dict:
        """Coverage (teacher ids with a non-empty row) and exact-match share, each also over
        teacher tokens that carry text."""
        covered = self.first_piece >= 0
        return {
            "vocab_t": self.vocab_size_t,
            "vocab_s": self.vocab_size_s,
            "mode": self.mode,
            "nnz": int(self.rows.shape[0]),
            "coverage": float(covered.float().mean()),
            "exact_share": float(self.exact.float().mean()),
            "exact_share_of_covered": float(self.exact[covered].float().mean())
            if bool(covered.any())
            else 0.0,
        }

    def save(self, path: str | Path) -> None:
        """Write one safetensors file; fingerprints and options go in its metadata."""
        from safetensors.torch import save_file

        tensors = {
            "first_piece": self.first_piece.contiguous(),
            "exact": self.exact.to(torch.uint8).contiguous(),
            "rows": self.rows.contiguous(),
            "cols": self.cols.contiguous(),
            "weights": self.weights.contiguous(),
        }
        meta = {
            "format": _FORMAT,
            "mode": self.mode,
            "fingerprint_t": self.fingerprint_t,
            "fingerprint_s": self.fingerprint_s,
            "vocab_size_s": str(self.vocab_size_s),
            "name_t": self.name_t,
            "name_s": self.name_s,
        }
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, tok_t=None, tok_s=None) -> Projection:
        """Read a projection; with tokenizers given, refuse one built for other tokenizers."""
        meta, tensors = _read(Path(path))
        projection = cls(
            first_piece=tensors["first_piece"],
            exact=tensors["exact"].bool(),
            rows=tensors["rows"],
            cols=tensors["cols"],
            weights=tensors["weights"],
            vocab_size_s=int(meta["vocab_size_s"]),
            mode=meta["mode"],
            fingerprint_t=meta["fingerprint_t"],
            fingerprint_s=meta["fingerprint_s"],
            name_t=meta.get("name_t", ""),
            name_s=meta.get("name_s", ""),
        )
        projection.check(tok_t=tok_t, tok_s=tok_s, path=str(path))
        return projection

    def check(self, tok_t=None, tok_s=None, path: str = "projection") -> None:
        """Raise a UserError naming both fingerprints if a tokenizer is not the one used."""
        from crossdistill.models import tokenizer_fingerprint

        for role, tok, expected in (
            ("teacher", tok_t, self.fingerprint_t),
            ("student", tok_s, self.fingerprint_s),
        ):
            if tok is None:
                continue
            got = tokenizer_fingerprint(tok)
            if got != expected:
                raise UserError(
                    f"{path} was built for a {role} tokenizer with fingerprint {expected}, but "
                    f"the given {role} tokenizer has fingerprint {got}; rebuild it with "
                    "`crossdistill projection build --student-tokenizer S --teacher-tokenizer T "
                    "--out P.safetensors`"
                )


def _read(path: Path) -> tuple[dict, dict]:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise UserError(f"projection file {path} does not exist; build one with `projection build`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{path} is not a readable safetensors file: {e}") from None
    needed = {"first_piece", "exact", "rows", "cols", "weights"}
    if meta.get("format") != _FORMAT or not needed <= tensors.keys():
        raise UserError(f"{path} is not a crossdistill projection file (format {_FORMAT})")
    return meta, tensors


def build_projection(tok_t, tok_s, mode: str = "first_piece") -> Projection:
    """Build the `[V_t, V_s]` projection from teacher tokenizer `tok_t` to student `tok_s`.

    mode: "first_piece" (weight 1 on the first student piece of each teacher token) or
    "multi_piece" (weights over all pieces, proportional to their byte lengths).
    """
    if mode not in MODES:
        raise UserError(f"unknown projection mode {mode!r}; use one of {', '.join(MODES)}")
    bytes_t, bytes_s = TokenBytes.from_tokenizer(tok_t), TokenBytes.from_tokenizer(tok_s)
    if bytes_t.fingerprint == bytes_s.fingerprint:
        ids = np.arange(bytes_t.vocab_size, dtype=np.int64)
        pieces = [[(int(i), 1.0)] for i in ids]
        exact = np.ones(bytes_t.vocab_size, dtype=bool)
    else:
        pieces, exact = _teacher_pieces(tok_s, bytes_t, bytes_s, mode)
    return _assemble(pieces, exact, bytes_t, bytes_s, mode, tok_t, tok_s)


def _assemble(pieces, exact, bytes_t, bytes_s, mode, tok_t, tok_s) -> Projection:
    first = np.asarray([p[0][0] if p else -1 for p in pieces], dtype=np.int64)
    counts = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    rows = np.repeat(np.arange(len(pieces), dtype=np.int64), counts)
    cols = np.fromiter((c for p in pieces for c, _ in p), dtype=np.int64, count=int(counts.sum()))
    weights = np.fromiter((w for p in pieces for _, w in p), dtype=np.float32, count=cols.shape[0])
    order = np.lexsort((cols, rows))
    return Projection(
        first_piece=torch.from_numpy(first),
        exact=torch.from_numpy(np.asarray(exact, dtype=bool)),
        rows=torch.from_numpy(rows[order]),
        cols=torch.from_numpy(cols[order]),
        weights=torch.from_numpy(weights[order]),
        vocab_size_s=bytes_s.vocab_size,
        mode=mode,
        fingerprint_t=bytes_t.fingerprint,
        fingerprint_s=bytes_s.fingerprint,
        name_t=str(getattr(tok_t, "name_or_path", "")),
        name_s=str(getattr(tok_s, "name_or_path", "")),
    )


def _student_lookup(bytes_s: TokenBytes) -> dict[bytes, int]:
    """Student bytes -> id. Where ids share bytes (SentencePiece '▁' and '<0x20>'), the normal
    piece wins over the byte-fallback one, then the lower id."""
    lookup: dict[bytes, int] = {}
    pieces = bytes_s.pieces()
    for pass_byte_pieces in (False, True):
        for i in np.flatnonzero((bytes_s.lengths > 0) & (bytes_s.byte_piece == pass_byte_pieces)):
            lookup.setdefault(pieces[i], int(i))
    return lookup


def exact_match_mask(bytes_t: TokenBytes, bytes_s: TokenBytes) -> np.ndarray:
    """[V_t] bool: teacher ids whose bytes (or special-token name) some student id has too."""
    lookup = _student_lookup(bytes_s)
    names_s = set(bytes_s.special_text.values())
    return np.fromiter(
        (
            (data in lookup) if data else (bytes_t.special_text.get(t) in names_s)
            for t, data in enumerate(bytes_t.pieces())
        ),
        dtype=bool,
        count=bytes_t.vocab_size,
    )


def _teacher_pieces(tok_s, bytes_t: TokenBytes, bytes_s: TokenBytes, mode: str):
    """Per teacher id, a list of (student id, weight), and whether it is an exact match."""
    lookup = _student_lookup(bytes_s)
    special_s = {text: i for i, text in bytes_s.special_text.items()}
    pieces_t = bytes_t.pieces()
    out: list[list[tuple[int, float]]] = [[] for _ in range(bytes_t.vocab_size)]
    exact = np.zeros(bytes_t.vocab_size, dtype=bool)
    texts: list[tuple[int, str]] = []
    for t, data in enumerate(pieces_t):
        if not data:
            name = bytes_t.special_text.get(t)
            if name is not None and name in special_s:
                out[t], exact[t] = [(special_s[name], 1.0)], True
            continue
        hit = lookup.get(data)
        if hit is not None:
            out[t], exact[t] = [(hit, 1.0)], True
            continue
        try:
            texts.append((t, data.decode("utf-8")))
        except UnicodeDecodeError:  # part of a character: no text to tokenize
            out[t] = _weigh_greedy(data, lookup, mode)
    encoded = _encode_literally(tok_s, [text for _, text in texts])
    for (t, _), ids in zip(texts, encoded):
        out[t] = _weigh(ids, bytes_s, mode) if ids else _weigh_greedy(pieces_t[t], lookup, mode)
    return out, exact


def _weigh(ids: list[int], bytes_s: TokenBytes, mode: str) -> list[tuple[int, float]]:
    if mode == "first_piece":
        return [(ids[0], 1.0)]
    pieces = bytes_s.pieces()
    lengths = [len(pieces[i]) for i in ids]
    total = sum(lengths)
    if total <= 0:
        return [(ids[0], 1.0)]
    merged: dict[int, float] = {}
    for i, n in zip(ids, lengths):
        merged[i] = merged.get(i, 0.0) + n / total
    return list(merged.items())  # in piece order: the first entry is the first piece


def _weigh_greedy(data: bytes, lookup: dict[bytes, int], mode: str) -> list[tuple[int, float]]:
    """Split bytes that are not valid text by longest known prefix (every byte-level and
    byte-fallback vocabulary has all 256 single bytes)."""
    ids, pos = [], 0
    while pos < len(data):
        for end in range(len(data), pos, -1):
            hit = lookup.get(data[pos:end])
            if hit is not None:
                ids.append((hit, end - pos))
                pos = end
                break
        else:
            pos += 1  # a byte this vocabulary cannot express: skip it
        if mode == "first_piece" and ids:
            return [(ids[0][0], 1.0)]
    if not ids:
        return []
    total = sum(n for _, n in ids)
    merged: dict[int, float] = {}
    for i, n in ids:
        merged[i] = merged.get(i, 0.0) + n / total
    return list(merged.items())  # in piece order: the first entry is the first piece


def _encode_literally(tok_s, texts: list[str]) -> list[list[int]]:
    """Student ids of each text as a standalone piece of running text: no special tokens added,
    special-token strings read as text, and no dummy prefix space."""
    from tokenizers import Tokenizer

    source = tok_s.backend_tokenizer
    backend = Tokenizer.from_str(source.to_str())  # a copy: the cached tokenizer stays as it is
    # Rebuild only the small components without their dummy-prefix step, through a tokenizer
    # that holds nothing else (parsing the whole vocabulary in Python would cost seconds).
    parts = {
        "normalizer": _without_prefix(_state(source.normalizer)),
        "pre_tokenizer": _without_prefix(_state(source.pre_tokenizer)),
    }
    shell = Tokenizer.from_str(
        json.dumps(
            {
                "version": "1.0",
                "truncation": None,
                "padding": None,
                "added_tokens": [],
                "post_processor": None,
                "decoder": None,
                "model": {"type": "WordLevel", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"},
                **parts,
            }
        )
    )
    backend.normalizer = shell.normalizer
    backend.pre_tokenizer = shell.pre_tokenizer
    backend.post_processor = None
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = True
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]


def _state(component) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def _without_prefix(component: dict | None) -> dict | None:
    """A normalizer / pre-tokenizer JSON with its dummy-prefix step removed."""
    if not component:
        return component
    for key in ("normalizers", "pretokenizers"):
        if key in component:
            kept = [_without_prefix(c) for c in component[key]]
            kept = [c for c in kept if c is not None]
            return {**component, key: kept} if kept else None
    if component.get("type") == "Prepend":
        return None
    if component.get("type") == "Metaspace":
        return {**component, "prepend_scheme": "never"}
    if component.get("type") == "ByteLevel":
        return {**component, "add_prefix_space": False}
    return component


def build_joins(tok_t, tok_s) -> np.ndarray:
    """`[J, 3]` int64 rows `(a, x, v)`: student token v's bytes are student token a's followed by
    teacher token x's, for every such split of every student token (the lookahead target's
    table: the student token a teacher token continues a known student prefix into). Sorted by
    `(a, x)`; where several student tokens share bytes, the one `_student_lookup` picks."""
    return joins_of(TokenBytes.from_tokenizer(tok_t), TokenBytes.from_tokenizer(tok_s))


def joins_of(bytes_t: TokenBytes, bytes_s: TokenBytes) -> np.ndarray:
    """`build_joins` from the two byte tables."""
    lookup_s = _student_lookup(bytes_s)
    lookup_t: dict[bytes, list[int]] = {}
    for t, data in enumerate(bytes_t.pieces()):
        if data and not bytes_t.special[t]:
            lookup_t.setdefault(data, []).append(t)
    rows = []
    for data, v in lookup_s.items():
        for cut in range(1, len(data)):
            a = lookup_s.get(data[:cut])
            xs = lookup_t.get(data[cut:]) if a is not None else None
            for x in xs or ():
                rows.append((a, x, v))
    if not rows:
        return np.zeros((0, 3), dtype=np.int64)
    out = np.asarray(rows, dtype=np.int64)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


def build_extensions(tok_t, tok_s) -> tuple[np.ndarray, np.ndarray]:
    """The lookahead target's table for `deep_alternatives: longest` (`extensions_of`)."""
    return extensions_of(TokenBytes.from_tokenizer(tok_t), TokenBytes.from_tokenizer(tok_s))


def extensions_of(bytes_t: TokenBytes, bytes_s: TokenBytes) -> tuple[np.ndarray, np.ndarray]:
    """Student tokens as a student token a followed by the start of a teacher token x: the
    longest student token whose bytes are a's then a prefix of x's is what the student writes
    first where the text is a then x. Returns `(rows [E, 3], prefixes [V_t, L])`: rows
    `(a, r, v)`, student token v's bytes are student token a's followed by the rest r (an id of
    the byte strings that end a student token after a student prefix and start a teacher
    token), sorted by `(a, r)`; `prefixes[x, l]` the id of x's first l + 1 bytes as such a rest
    (−1: none, or past x's end), `L` the longest rest. Where student tokens share bytes, the one
    `_student_lookup` picks."""
    lookup_s = _student_lookup(bytes_s)
    starts: set[bytes] = set()
    for t, data in enumerate(bytes_t.pieces()):
        if data and not bytes_t.special[t]:
            starts.update(data[:n] for n in range(1, len(data) + 1))
    rest_id: dict[bytes, int] = {}
    rows = []
    for data, v in lookup_s.items():
        for cut in range(1, len(data)):
            a, rest = lookup_s.get(data[:cut]), data[cut:]
            if a is not None and rest in starts:
                rows.append((a, rest_id.setdefault(rest, len(rest_id)), v))
    width = max((len(r) for r in rest_id), default=1)
    prefixes = np.full((bytes_t.vocab_size, width), -1, dtype=np.int64)
    for t, data in enumerate(bytes_t.pieces()):
        if data and not bytes_t.special[t]:
            for n in range(1, min(len(data), width) + 1):
                prefixes[t, n - 1] = rest_id.get(data[:n], -1)
    if not rows:
        return np.zeros((0, 3), dtype=np.int64), prefixes
    out = np.asarray(rows, dtype=np.int64)
    return out[np.lexsort((out[:, 1], out[:, 0]))], prefixes


def own_joins(tok) -> np.ndarray:
    """`[J, 3]` int64 rows `(a, x, v)`: token v's bytes are token a's followed by token x's, all
    three tokens of `tok` (every id of each byte string, special tokens left out), sorted by
    `(a, x)`: the pairs of tokens that `tok`'s own tokenizer writes as one token."""
    return own_joins_of(TokenBytes.from_tokenizer(tok))


def own_joins_of(table: TokenBytes) -> np.ndarray:
    """`own_joins` from a byte table."""
    ids: dict[bytes, list[int]] = {}
    for t, data in enumerate(table.pieces()):
        if data and not table.special[t]:
            ids.setdefault(data, []).append(t)
    rows = [
        (a, x, v)
        for data, vs in ids.items()
        for cut in range(1, len(data))
        for a in ids.get(data[:cut], ())
        for x in ids.get(data[cut:], ())
        for v in vs[:1]
    ]
    if not rows:
        return np.zeros((0, 3), dtype=np.int64)
    out = np.asarray(rows, dtype=np.int64)
    return out[np.lexsort((out[:, 1], out[:, 0]))]


def relaxed_matches(tok_t, tok_s, forward: Projection | None = None) -> np.ndarray:
    """`[V_t]` int64: the `hkl` loss's one-to-one pairing of teacher and student tokens (the
    relaxed common vocabulary of X-Token's hybrid KL), −1 for a teacher token left unpaired.

    A teacher token with an exact student match (the same bytes) is paired with it, as in
    `gold`. Every other teacher token t is paired with a student token whose bytes, cut by the
    teacher's tokenizer, start with t: the one cut into the fewest distinct teacher pieces
    (X-Token's decaying piece weights rank it first), then the lowest id. A student token that
    is some teacher token's exact match is never paired with another, so no student token is
    paired twice. Identical tokenizers pair every token with itself. `forward`: the pair's
    teacher-to-student projection, when the caller has built it already."""
    forward = build_projection(tok_t, tok_s) if forward is None else forward
    matched = np.where(forward.exact.numpy(), forward.first_piece.numpy(), -1)
    if forward.fingerprint_t == forward.fingerprint_s:
        return matched
    backward = build_projection(tok_s, tok_t, mode="multi_piece")
    first = backward.first_piece.numpy()  # each student token's first teacher piece
    pieces = np.bincount(backward.rows.numpy(), minlength=first.shape[0])
    taken = np.zeros(first.shape[0], dtype=bool)
    taken[matched[matched >= 0]] = True
    open_t = np.zeros(matched.shape[0] + 1, dtype=bool)
    open_t[: matched.shape[0]] = matched < 0
    cand = np.flatnonzero((first >= 0) & ~taken & open_t[np.where(first >= 0, first, -1)])
    order = np.lexsort((cand, pieces[cand], first[cand]))  # by teacher, fewest pieces, lowest id
    cand = cand[order]
    lead = np.ones(cand.shape[0], dtype=bool)
    lead[1:] = first[cand[1:]] != first[cand[:-1]]
    matched[first[cand[lead]]] = cand[lead]
    return matched

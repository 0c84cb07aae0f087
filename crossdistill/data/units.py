"""A document (or one piece of a long text) tokenized by every distinct tokenizer and aligned.

A `Unit` is built from parts, in order: template parts (BOS, EOS, chat headers; one chunk per
part, never a KD position) and content parts (text; chunks from `align`, KD positions). Its
common cut points are the student indices where every cross-tokenizer teacher has a chunk
start: cutting there leaves student and teachers with the same text on each side of the cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from crossdistill.alignment.text_bytes import token_text_bytes
from crossdistill.data.chat import render_layout
from crossdistill.data.documents import Message
from crossdistill.data.encoders import TokenizerSide
from crossdistill.data.sources import Bad

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class UnitTeacher:
    """One cross-tokenizer teacher's view of a unit.

    ids: [n_t] int64; target: [n_t] bool, token may be a CE target; chunks: [C, 4] int64
    `(s0, s1, t0, t1)` unit-local; kd: [C] bool, chunk is content (may carry KD);
    cuts: [K] int64 teacher index at each common cut point; text_bytes: [n_t] int64 bytes of
    the document's text each token covers (0 for template tokens).
    """

    ids: np.ndarray
    target: np.ndarray
    chunks: np.ndarray
    kd: np.ndarray
    cuts: np.ndarray
    text_bytes: np.ndarray


@dataclass
class Unit:
    """ids_s: [n_s] int64; target_s: [n_s] bool; template_s: [n_s] bool (template token);
    cuts_s: [K] int64 common cut points, ascending, from 0 to n_s; teachers: one per distinct
    cross-tokenizer; first/last: this piece starts/ends its document; text_bytes_s: [n_s]
    int64 bytes of the text each token covers (0 for template tokens; content tokens sum to
    the UTF-8 bytes of the contents on every side, see `alignment.text_bytes`).

    key / offsets (set by the stream when a teacher reads from a cache): the document's cache
    key (`teacher_cache.document_key`) and, per side (student first), the tokens of the
    document's earlier pieces: where this piece starts in the document's tokens."""

    ids_s: np.ndarray
    target_s: np.ndarray
    template_s: np.ndarray
    cuts_s: np.ndarray
    teachers: list[UnitTeacher]
    first: bool
    last: bool
    chat: bool
    text_bytes_s: np.ndarray
    key: str = ""
    offsets: tuple[int, ...] = ()


@dataclass
class _Part:
    ids: list[np.ndarray]  # per side: student first, then each cross teacher
    target: list[np.ndarray]
    content: bool
    text: str = ""  # a content part's text


def text_unit(
    text: str, sides: list[TokenizerSide], first: bool = True, last: bool = True
) -> Unit | Bad:
    """A plain-text document piece: [start] text [doc end], per each tokenizer's conventions
    (`TokenizerSide.start_ids`: the BOS, or the document end where there is none)."""
    parts = []
    if first:
        parts.append(_template_part([s.start_ids for s in sides]))
    content = [s.encode_content(text) for s in sides]
    parts.append(_content_part(content, [True] * len(sides), text))
    if last:
        parts.append(_template_part([_doc_end(s) for s in sides]))
    return _assemble(parts, sides, first, last, chat=False)


def chat_unit(
    messages: list[Message], sides: list[TokenizerSide], loss_on: Literal["assistant", "all"]
) -> Unit | Bad:
    """A conversation: each tokenizer renders its own template around the same contents. With
    `loss_on="assistant"` the CE targets are assistant contents plus the first template token
    after each (its end-of-turn marker, so the model learns to stop); with `"all"` every token."""
    layouts = []
    for side in sides:
        layout = render_layout(side, messages)
        if isinstance(layout, Bad):
            return layout
        layouts.append(layout)
    lay = layouts[0]
    if any(len(x.contents) != len(lay.contents) for x in layouts[1:]):
        return Bad("chat templates disagree on which messages they render")
    everything = loss_on == "all"
    parts: list[_Part] = []
    for k in range(len(lay.templates)):
        ids = [s.encode_template(x.templates[k]) for s, x in zip(sides, layouts)]
        if k == len(lay.templates) - 1:
            ids = [_with_doc_end(i, s) for i, s in zip(ids, sides)]
        after_assistant = k > 0 and lay.assistant[k - 1]
        parts.append(_template_part(ids, everything, end_of_turn=after_assistant))
        if k < len(lay.contents):
            text = lay.contents[k]
            content = [s.encode_content(text) for s in sides]
            parts.append(
                _content_part(content, [everything or lay.assistant[k]] * len(sides), text)
            )
    return _assemble(parts, sides, True, True, chat=True)


def _doc_end(side: TokenizerSide) -> np.ndarray:
    return _EMPTY if side.doc_end_id is None else np.asarray([side.doc_end_id], dtype=np.int64)


def _with_doc_end(ids: np.ndarray, side: TokenizerSide) -> np.ndarray:
    if side.doc_end_id is None or (ids.size and ids[-1] == side.doc_end_id):
        return ids
    return np.concatenate([ids, _doc_end(side)])


def _template_part(ids: list[np.ndarray], target: bool = True, end_of_turn: bool = False) -> _Part:
    targets = []
    for i in ids:
        t = np.full(i.size, target, dtype=bool)
        if end_of_turn and i.size:
            t[0] = True
        targets.append(t)
    return _Part(ids, targets, content=False)


def _content_part(ids: list[np.ndarray], target: list[bool], text: str) -> _Part:
    targets = [np.full(i.size, t, dtype=bool) for i, t in zip(ids, target)]
    return _Part(ids, targets, content=True, text=text)


def _text_bytes(parts: list[_Part], k: int, side: TokenizerSide) -> np.ndarray:
    """[n] bytes of the text each of side `k`'s tokens covers, over all parts."""
    out = []
    for p in parts:
        if p.content:
            out.append(token_text_bytes(p.ids[k], side.token_bytes, p.text.encode()))
        else:
            out.append(np.zeros(p.ids[k].size, dtype=np.int64))
    return np.concatenate(out)


def _assemble(
    parts: list[_Part], sides: list[TokenizerSide], first: bool, last: bool, chat: bool
) -> Unit | Bad:
    from crossdistill.alignment import align

    ids_s = np.concatenate([p.ids[0] for p in parts])
    target_s = np.concatenate([p.target[0] for p in parts])
    template_s = np.concatenate([np.full(p.ids[0].size, not p.content) for p in parts])
    teachers = []
    common = np.ones(ids_s.size + 1, dtype=bool)  # [n_s + 1] cut allowed before token i
    for k in range(1, len(sides)):
        rows, kd = [], []
        off_s = off_t = 0
        for p in parts:
            n_s, n_t = p.ids[0].size, p.ids[k].size
            if p.content:
                chunks = align(
                    p.ids[0], p.ids[k], sides[0].token_bytes, sides[k].token_bytes
                ).chunks
                if chunks.shape[0] == 0 and (n_s or n_t):
                    chunks = np.asarray([[0, n_s, 0, n_t]], dtype=np.int64)
            else:
                chunks = np.asarray([[0, n_s, 0, n_t]] if n_s or n_t else [], dtype=np.int64)
            chunks = chunks.reshape(-1, 4) + np.asarray([off_s, off_s, off_t, off_t])
            rows.append(chunks)
            kd.append(np.full(chunks.shape[0], p.content))
            off_s, off_t = off_s + n_s, off_t + n_t
        chunks, kd_k = _merge_one_sided(np.concatenate(rows), np.concatenate(kd))
        if chunks.shape[0] == 0:
            return Bad("the document has no tokens")
        ids_t = np.concatenate([p.ids[k] for p in parts])
        target_t = np.concatenate([p.target[k] for p in parts])
        bytes_t = _text_bytes(parts, k, sides[k])
        teachers.append(UnitTeacher(ids_t, target_t, chunks, kd_k, _EMPTY, bytes_t))
        starts = np.zeros_like(common)
        starts[chunks[:, 0]] = True
        starts[-1] = True
        common &= starts
    cuts_s = np.flatnonzero(common)
    for t in teachers:
        starts = np.append(t.chunks[:, 0], ids_s.size)
        t.cuts = np.append(t.chunks[:, 2], t.ids.size)[np.searchsorted(starts, cuts_s)]
    bytes_s = _text_bytes(parts, 0, sides[0])
    return Unit(ids_s, target_s, template_s, cuts_s, teachers, first, last, chat, bytes_s)


def _merge_one_sided(chunks: np.ndarray, kd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fold chunks with no token on one side into a neighbour (the next one at the start, the
    previous one elsewhere), so every chunk has tokens on both sides. A merged chunk no longer
    covers the same text on both sides, so it is never a KD position."""
    one_sided = (chunks[:, 1] == chunks[:, 0]) | (chunks[:, 3] == chunks[:, 2])
    if not one_sided.any():
        return chunks, kd
    lead = int(np.argmax(~one_sided))
    if not one_sided[lead:].any():  # the common case: a BOS only one tokenizer writes
        chunks, kd = chunks[lead:].copy(), kd[lead:].copy()
        chunks[0, 0], chunks[0, 2], kd[0] = 0, 0, False
        return chunks, kd
    out: list[list[int]] = []
    out_kd: list[bool] = []
    carry: list[int] | None = None  # a one-sided chunk at the start, waiting for the next one
    for row, ok, bad in zip(chunks.tolist(), kd.tolist(), one_sided.tolist()):
        if carry is not None:
            row, ok, carry = [carry[0], row[1], carry[2], row[3]], False, None
            bad = row[1] == row[0] or row[3] == row[2]
        if bad and not out:
            carry = row
        elif bad:
            out[-1][1], out[-1][3], out_kd[-1] = row[1], row[3], False
        else:
            out.append(row)
            out_kd.append(ok)
    if carry is not None:  # everything was one-sided: one inexact chunk
        out, out_kd = [carry], [False]
    return np.asarray(out, dtype=np.int64).reshape(-1, 4), np.asarray(out_kd, dtype=bool)

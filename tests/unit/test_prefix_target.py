"""The byte-prefix target (`teachers.N.target: prefix`): every student token belongs to the teacher
token its bytes start with, and the divergence compares the teacher's top-k with the student's
total probability of each such group.

- the chunked pass and the full-logits reference against a float64 reference written out
  plainly here (per KD position: teacher mass per event, student mass per event by summing
  its token probabilities), loss and gradients, at τ = 1 and 2, for every projected loss;
- groups of one token each give the ordinary first-piece loss, value and gradients;
- how events are built: a teacher token that no student token starts with shares the event of
  its first student piece; on real tokenizers (Llama-3 student, Llama-2 teacher) every student
  token's event is a teacher token its bytes start with;
- what the settings refuse: a loss that is not projected, a tensor-parallel student.
"""

from __future__ import annotations

import math

import pytest
import torch

from crossdistill.config import DISTRIBUTION_LOSSES
from crossdistill.losses import KDTerm, PrefixGroups, VocabProjection, ce_count, kd_count
from tests.unit.test_losses_student import make_problem, plain_divergence, rel, run

F64 = torch.float64


def grouped(seed: int, tau: float = 1.0, v_s: int = 16, v_t: int = 13):
    """A random problem whose projection carries random prefix groups: each student token's
    event a random teacher id (some none), the teacher's events from its first pieces."""
    hidden, weight, labels, chunks, targets, proj = make_problem(seed, v_s=v_s, v_t=v_t, tau=tau)
    gen = torch.Generator().manual_seed(100 + seed)
    first_t = torch.randint(-1, v_t // 2, (v_s,), generator=gen)  # half the teacher ids: events
    proj.groups = PrefixGroups.from_first_pieces(first_t, proj.first_piece)
    return hidden, weight, labels, chunks, targets, proj


def plain_prefix_kd(name, z_row, tg, c, groups: PrefixGroups, tau, params):
    """One KD position the obvious way: the teacher's mass per event, the student's summed per
    event over its tokens, the rest in one tail on each side."""
    p = torch.softmax(z_row / tau, -1)
    event_t = groups.teacher_event.first_piece.tolist()
    event_s = groups.student_event.tolist()
    q, q_tail = {}, math.exp(tg.tail_logprob[c].item())
    for t, lq in zip(tg.topk_ids[c].tolist(), tg.topk_logprobs[c].tolist()):
        if event_t[t] < 0:
            q_tail += math.exp(lq)
        else:
            q[event_t[t]] = q.get(event_t[t], 0.0) + math.exp(lq)
    buckets = sorted(q)
    zero = torch.zeros((), dtype=p.dtype)
    p_b = [sum((p[j] for j in range(len(event_s)) if event_s[j] == b), zero) for b in buckets]
    p_tail = sum((p[j] for j in range(len(event_s)) if event_s[j] not in q), zero)
    return plain_divergence(name, [q[b] for b in buckets] + [q_tail], p_b + [p_tail], params)


def plain_loss(hidden, weight, labels, term, kd_ratio):
    z = hidden.double() @ weight.double().t()
    logp = torch.log_softmax(z, -1)
    ce = sum(-logp[r, labels[r]] for r in range(len(labels)) if labels[r] >= 0)
    loss = (1 - kd_ratio) * ce / int(ce_count(labels))
    kd, tau = 0.0, term.temperature
    for c, (s0, s1, t0, t1) in enumerate(term.chunks.tolist()):
        if s0 > 0 and t0 > 0 and s1 > s0 and t1 > t0:
            row = z[s0 - 1]
            kd = kd + plain_prefix_kd(
                term.loss, row, term.targets, c, term.projection.groups, tau, term.params
            )
    return loss + kd_ratio * float(term.weight) * tau**2 * kd / float(term.denominator)


def make_term(loss, targets, proj, chunks, labels):
    params = {"jsd": {"beta": 0.3}, "skew_kl": {"alpha": 0.2}}.get(loss, {})
    term = KDTerm(targets, proj, chunks, torch.tensor(0.0), loss, weight=0.8, params=params)
    term.denominator = kd_count(term, labels).double()
    return term


@pytest.mark.parametrize("tau", [1.0, 2.0])
@pytest.mark.parametrize("loss", DISTRIBUTION_LOSSES)
def test_matches_plain_float64_reference(loss, tau):
    hidden, weight, labels, chunks, targets, proj = grouped(3, tau=tau)
    term = make_term(loss, targets, proj, chunks, labels)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    want = plain_loss(h, w, labels, term, 0.6)
    gh, gw = torch.autograd.grad(want, (h, w))
    for backend in ("chunked", "reference"):
        got, got_h, got_w, metrics = run(backend, hidden, weight, labels, [term])
        assert torch.isfinite(got) and torch.isfinite(got_h).all() and torch.isfinite(got_w).all()
        assert abs(got.item() - want.item()) <= 1e-10 * abs(want.item()), backend
        assert rel(got_h, gh) < 1e-10 and rel(got_w, gw) < 1e-10, backend
        assert metrics["kd/teacher"] > 0


def test_gradcheck():
    hidden, weight, labels, chunks, targets, proj = grouped(4, tau=1.5, v_s=9, v_t=8)
    term = make_term("forward_kl", targets, proj, chunks, labels)

    def f(h, w):
        return run_loss(h, w, labels, term)

    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (h, w), fast_mode=True)


def run_loss(h, w, labels, term):
    from crossdistill.losses import student_loss

    return student_loss(h, w, labels, [term], 0.6, ce_count(labels), chunk_size=3)[0]


@pytest.mark.parametrize("loss", ["forward_kl", "jsd", "tvd"])
def test_groups_of_one_token_give_the_first_piece_loss(loss):
    hidden, weight, labels, chunks, targets, proj = make_problem(5, v_s=16, v_t=16)
    ident = VocabProjection.identity(16)
    plain = make_term(loss, targets, ident, chunks, labels)
    ident_g = VocabProjection.identity(16)
    ident_g.groups = PrefixGroups.from_first_pieces(torch.arange(16), torch.arange(16))
    groups = make_term(loss, targets, ident_g, chunks, labels)
    want, want_h, want_w, _ = run("chunked", hidden, weight, labels, [plain])
    for backend in ("chunked", "reference"):
        got, got_h, got_w, _ = run(backend, hidden, weight, labels, [groups])
        assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
        assert rel(got_h, want_h) < 1e-12 and rel(got_w, want_w) < 1e-12


def test_events_of_teacher_tokens_without_student_tokens_under_them():
    # student ids 0..3 start with teacher ids 0, 0, 2, none; teacher 1 has no student token
    # under it and its first student piece is 1 (event 0); teacher 3's first piece is none
    g = PrefixGroups.from_first_pieces(torch.tensor([0, 0, 2, -1]), torch.tensor([0, 1, 2, -1]))
    assert g.student_event.tolist() == [0, 0, 2, 4]  # 4 = num_events: the tail
    assert g.teacher_event.first_piece.tolist() == [0, 0, 2, -1]
    assert g.num_events == 4


def test_real_tokenizers_group_each_student_token_under_a_prefix(real_tokenizer):
    from crossdistill.alignment.projection import build_projection
    from crossdistill.alignment.token_bytes import TokenBytes

    tok_s, tok_t = real_tokenizer("llama3"), real_tokenizer("llama2")
    forward = build_projection(tok_t, tok_s)
    back = build_projection(tok_s, tok_t)
    g = PrefixGroups.from_first_pieces(back.first_piece, forward.first_piece)
    pieces_s = TokenBytes.from_tokenizer(tok_s).pieces()
    pieces_t = TokenBytes.from_tokenizer(tok_t).pieces()
    events = g.student_event.tolist()
    grouped_ids = [s for s, e in enumerate(events) if e < g.num_events and pieces_s[s]]
    assert len(grouped_ids) > 0.99 * len([p for p in pieces_s if p])
    assert all(pieces_s[s].startswith(pieces_t[events[s]]) for s in grouped_ids)
    for word, start in ((" unbelievable", b" un"), (" getattr", b" get"), (".append", b".")):
        ids = tok_s.encode(word, add_special_tokens=False)
        assert len(ids) == 1  # one Llama-3 token; Llama-2 splits it, and it joins its start's group
        assert pieces_t[events[ids[0]]] == start
    event_t = g.teacher_event.first_piece
    used = set(events) - {g.num_events}
    assert all(int(event_t[e]) == e for e in used)  # an event is its own teacher token's


def test_settings_refuse_what_the_target_cannot_do(tmp_path, tokenizer_dir):
    from crossdistill.errors import UserError
    from tests.distributed import _harness as h

    cfg = h.trainer_config(tmp_path, tokenizer_dir, 2, eval_every=2)
    cfg.teachers[0].target, cfg.teachers[0].loss = "prefix", "chunk_likelihood"
    from crossdistill.train.validate import validate_config

    with pytest.raises(UserError, match="target = prefix needs a projected loss"):
        validate_config(cfg)
    cfg.teachers[0].loss = "forward_kl"
    cfg.student.parallel.tp = 2
    with pytest.raises(UserError, match="student.parallel.tp = 2"):
        validate_config(cfg)


def test_a_run_with_the_prefix_target_trains_and_differs_from_first_piece(tmp_path, tokenizer_dir):
    """`train()` in one process (tiny Llama-2-tokenizer student, GPT-2-tokenizer teacher on the
    prefix target, a Mistral-tokenizer teacher on chunk likelihood): finite losses, a KD term,
    and a first step whose KD value is not the first-piece run's (the groups are in use)."""
    from tests.distributed import _harness as h

    kd = {}
    for target in ("first_piece", "prefix"):
        cfg = h.probe_config(tmp_path / target, tokenizer_dir)
        cfg.teachers[0].target = target
        kd[target] = h.first_kd(cfg)
    assert abs(kd["prefix"] - kd["first_piece"]) > 1e-6 * kd["first_piece"]

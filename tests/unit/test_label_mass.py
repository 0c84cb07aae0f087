"""`benchmarks/label_mass.py`: the label's bits and the mass on two token sets at positions whose
label is not a digit token, against a float64 computation document by document on a tiny model
over real packed batches (GPT-2 student, Llama-2 teacher)."""

from __future__ import annotations

import math

import numpy as np
import torch

from benchmarks.bpb_by_class import TEXT_CLASSES, text_class_of_tokens
from benchmarks.label_mass import label_mass
from tests.unit.test_bpb_by_class import packed_held_out, per_document_logprobs

TEXTS = [
    'my $total = 12345;\n        print "sum: $total\\n";\n',
    "The quick brown fox, 1999 and 2024, naive cafe.\n\n    indented line here\n",
    "sub add { my ($a, $b) = @_; return $a + $b; }  # 42 apples, 7 pears\n",
] * 3


def test_label_mass_against_float64_by_document(tmp_path, tokenizer_dir):
    from crossdistill.models import build_causal_lm

    tok_s, batches = packed_held_out(tmp_path, tokenizer_dir, TEXTS)
    rows = 50304
    classes = np.full(rows, TEXT_CLASSES.index("other"), dtype=np.int8)
    classes[: len(tok_s)] = text_class_of_tokens(tok_s)
    digit = torch.from_numpy(classes == TEXT_CLASSES.index("digits"))
    unspelled = torch.rand(rows, generator=torch.Generator().manual_seed(0)) < 0.3
    model = build_causal_lm(
        arch="tiny-llama",
        overrides={"vocab_size": rows, "hidden_size": 32, "intermediate_size": 64,
                   "initializer_range": 0.3},
        seed=0,
    ).eval()  # fmt: skip
    got = label_mass(model, batches, digit, unspelled)

    want = {"bits": 0.0, "digit": 0.0, "unspelled": 0.0, "unspelled_other": 0.0}
    n = digit_labels = 0
    for batch in batches:
        for _, label, lp in per_document_logprobs(model, batch.student):
            if digit[label]:
                digit_labels += 1
                continue
            p = lp.exp()
            n += 1
            want["bits"] += -float(lp[label]) / math.log(2)
            want["digit"] += float(p[digit].sum())
            want["unspelled"] += float(p[unspelled].sum())
            want["unspelled_other"] += float(p[unspelled & ~digit].sum())
    assert digit_labels > 0 and n > 50  # the texts have numbers, and they are left out
    assert got["positions"] == n
    for key, value in want.items():
        assert math.isfinite(got[key])
        assert abs(got[key] - value / n) <= 1e-4 * max(1.0, value / n), key

"""`benchmarks/label_mass.py`: the label's bits and the mass on two token sets at positions whose
label is not a digit token, against a float64 computation document by document on a tiny model
over real packed batches (GPT-2 student, Llama-2 teacher)."""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from benchmarks.bpb_by_class import TEXT_CLASSES, held_out, text_class_of_tokens
from benchmarks.label_mass import label_mass

TEXTS = [
    'my $total = 12345;\n        print "sum: $total\\n";\n',
    "The quick brown fox, 1999 and 2024, naive cafe.\n\n    indented line here\n",
    "sub add { my ($a, $b) = @_; return $a + $b; }  # 42 apples, 7 pears\n",
] * 3


def test_label_mass_against_float64_by_document(tmp_path, tokenizer_dir):
    from crossdistill.models import build_causal_lm

    corpus = tmp_path / "val.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    config = {
        "student": {"arch": "tiny-llama", "tokenizer": str(tokenizer_dir("gpt2"))},
        "data": {"train": [str(corpus)], "validation": [str(corpus)], "seq_len": 64,
                 "micro_batch_size": 2},
    }  # fmt: skip
    tok_s, batches = held_out(config, [str(tokenizer_dir("llama2"))])
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
    with torch.no_grad():
        for batch in batches:
            sb = batch.student
            for b in range(sb.input_ids.shape[0]):
                doc = sb.doc_ids[b]
                for d in doc.unique().tolist():
                    if d < 0:
                        continue
                    where = (doc == d).nonzero().flatten()
                    logits = model(sb.input_ids[b, where][None]).logits[0].double()
                    p = torch.softmax(logits, -1)
                    for i, pos in enumerate(where.tolist()):
                        label = int(sb.labels[b, pos])
                        if label < 0:
                            continue
                        if digit[label]:
                            digit_labels += 1
                            continue
                        n += 1
                        want["bits"] += -math.log2(float(p[i, label]))
                        want["digit"] += float(p[i, digit].sum())
                        want["unspelled"] += float(p[i, unspelled].sum())
                        want["unspelled_other"] += float(p[i, unspelled & ~digit].sum())
    assert digit_labels > 0 and n > 50  # the texts have numbers, and they are left out
    assert got["positions"] == n
    for key, value in want.items():
        assert math.isfinite(got[key])
        assert abs(got[key] - value / n) <= 1e-4 * max(1.0, value / n), key

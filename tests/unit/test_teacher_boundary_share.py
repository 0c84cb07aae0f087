"""`benchmarks/teacher_boundary_share.py`: the KD positions it counts are the aligner's, and the
continuations past a teacher token are counted where the text shows them."""

from __future__ import annotations

from benchmarks.teacher_boundary_share import shares

TEXTS = [
    "#define GL_APIENTRY APIENTRY\nGLAPI void GLAPIENTRY glEnd (void);\n",
    # Llama-3 writes the 20 spaces as 19 and 1 (the space before a digit), Mistral as 16 and 4:
    # a student boundary three spaces into Mistral's run of 4, and Mistral has a run of 3
    "#define EGL_BAD_ACCESS                    0x3002",
    "  int x = 10;\n    return x + 1;\n",
    "The quick brown fox jumps over the lazy dog, 1234 times.\n",
]


def test_kd_positions_are_the_aligners(tokenizer_dir):
    from crossdistill.models import load_tokenizer
    from crossdistill.train.auto_target import aligned_sample

    tok_s = load_tokenizer(str(tokenizer_dir("llama3")))
    tok_t = load_tokenizer(str(tokenizer_dir("mistral")))
    got = shares(tok_s, tok_t, TEXTS)
    want = 0
    for _, _, chunks in aligned_sample(tok_s, tok_t, TEXTS):
        want += int(((chunks[:, 0] > 0) & (chunks[:, 2] > 0)).sum())
    # the aligner also counts each text's first token, predicted from both start tokens; no
    # teacher token of the text comes before it, so the script leaves it out
    assert got["kd_positions"] == want - len(TEXTS) > 0
    assert got["continuations"] > 0 and 0.0 < got["mean_share"] < 1.0
    # the same tokenizer on both sides: every boundary is a KD position, nothing goes on past
    same = shares(tok_s, tok_s, TEXTS)
    assert same["continuations"] == 0 and same["mean_share"] == 0.0

"""`crossdistill eval`: bits per byte and multiple-choice scores against direct computations on
a tiny model with a real tokenizer (CPU)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from crossdistill.cli import main
from crossdistill.errors import UserError
from crossdistill.eval.bpb import bits_per_byte
from crossdistill.eval.choice import multiple_choice, read_task
from crossdistill.eval.model import load_eval_model

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "café naïve — 東京 🙂",
]
QUESTIONS = [
    {"question": "2 + 2 =", "choices": ["4", "5", "22"], "answer": 0, "subject": "math"},
    {"question": "The sky is", "choices": ["blue", "green"], "answer": "A", "subject": "nature"},
    {"question": "Water is", "choices": ["dry", "wet", "hot"], "answer": 1, "subject": "nature"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    from crossdistill.models import build_causal_lm, load_tokenizer

    d = tmp_path_factory.mktemp("evalmodel")
    model = build_causal_lm(
        arch="tiny-llama",
        overrides={"vocab_size": 50304, "hidden_size": 32, "intermediate_size": 64,
                   "initializer_range": 0.3},
        seed=0,
    )  # fmt: skip
    model.save_pretrained(d, safe_serialization=True)
    load_tokenizer(str(tokenizer_dir("gpt2"))).save_pretrained(d)
    return d


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_bits_per_byte_is_the_models_nll_over_the_texts_bytes(model_dir, tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    m = load_eval_model(str(model_dir), "cpu")
    got = bits_per_byte(m, [str(corpus)], seq_len=64, batch_size=2)
    eot = m.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    nll = 0.0
    for text in TEXTS:  # GPT-2: the document end token starts and ends each document
        ids = [eot, *m.tokenizer.encode(text), eot]
        lp = _logprobs(m.model, ids)
        nll -= float(sum(lp[i, ids[i + 1]] for i in range(len(ids) - 1)))
    nbytes = sum(len(t.encode()) for t in TEXTS)
    assert got["bytes"] == nbytes
    assert got["bpb"] == pytest.approx(nll / math.log(2) / nbytes, rel=1e-4)


def test_multiple_choice_scores_are_the_choices_log_likelihoods(model_dir, tmp_path):
    task = tmp_path / "t.jsonl"
    lines = [json.dumps(q) for q in QUESTIONS]
    lines += ["not json", json.dumps({"question": "q", "choices": ["a"], "answer": 0})]
    task.write_text("\n".join(lines) + "\n")
    m = load_eval_model(str(model_dir), "cpu")
    got = multiple_choice(m, str(task))
    assert got["questions"] == 3 and got["skipped"] == 2
    eot = m.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    right = 0
    for q in QUESTIONS:
        scores = []
        for c in q["choices"]:
            ctx = [eot, *m.tokenizer.encode(f"{q['question']}\nAnswer:")]
            cont = m.tokenizer.encode(f" {c}")
            lp = _logprobs(m.model, ctx + cont)
            scores.append(sum(float(lp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
        answer = q["answer"] if isinstance(q["answer"], int) else "ABC".index(q["answer"])
        right += max(range(len(scores)), key=scores.__getitem__) == answer
    assert got["accuracy"] == pytest.approx(right / 3)
    assert set(got["subjects"]) == {"math", "nature"}


def test_bad_input_is_one_line(model_dir, tmp_path, capsys):
    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps(QUESTIONS[0]) + "\n" + json.dumps({"question": "x"}) + "\n")
    with pytest.raises(UserError, match="t.jsonl:2: `choices`"):
        read_task(str(task), "error")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="no \\*.safetensors"):
        load_eval_model(str(tmp_path / "empty"))
    with pytest.raises(UserError, match="does not exist"):
        load_eval_model(str(tmp_path / "nothing"))
    assert main(["eval", str(model_dir), "--task", "mmlu"]) == 2
    assert "KIND=PATH" in capsys.readouterr().err


def test_the_command_compares_models_in_one_table_and_json(model_dir, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    task = tmp_path / "t.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    args = ["eval", str(model_dir), str(model_dir), "--task", f"bpb={corpus}",
            "--task", f"choice={task}", "--seq-len", "64", "--device", "cpu"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == [str(model_dir)]  # the same folder twice: one entry
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "accuracy" in table and "bpb" in table and "nature" in table


def test_code_generation_runs_the_models_completions(model_dir, tmp_path, capsys):
    from crossdistill.eval.code import code_generation

    f = tmp_path / "mbpp.jsonl"
    row = {"task_id": 1, "text": "Add two numbers.", "test_list": ["assert add(1, 2) == 3"]}
    f.write_text(json.dumps(row) + "\n")
    m = load_eval_model(str(model_dir), "cpu")
    got = code_generation(m, str(f), max_new_tokens=8)
    assert got["tasks"] == 1 and sum(got["outcomes"].values()) == 1
    assert got["pass@1"] in (0.0, 1.0)
    args = ["eval", str(model_dir), "--task", f"code={f}", "--max-new-tokens", "8", "--json"]
    assert main(args) == 0
    assert "pass@1" in json.loads(capsys.readouterr().out)[str(model_dir)][f"code:{f}"]


def test_training_runs_its_eval_tasks_at_each_validation(tmp_path, tokenizer_dir):
    from crossdistill.train.loop import train
    from crossdistill.train.metrics import read_metrics
    from crossdistill.train.plot import plot_run
    from tests.unit.test_train import TEXTS, _cfg

    data = tmp_path / "data"
    data.mkdir()
    for name, texts in (("train.jsonl", TEXTS), ("val.jsonl", TEXTS[:8])):
        (data / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    task = tmp_path / "quiz.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    specs = [f"bpb={data / 'val.jsonl'}", f"choice={task}"]
    cfg = _cfg(data, tmp_path / "run", tokenizer_dir, [], kd_ratio=0.0, eval_tasks=specs)
    final = train(cfg)
    assert 0 < final["eval/bpb/val"] < 40 and 0 <= final["eval/choice/quiz/accuracy"] <= 1
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "eval/bpb/val" in r]
    assert [r["step"] for r in rows] == [2, 4]
    assert any(p.name == "eval.png" for p in plot_run(tmp_path / "run"))
    cfg.run.out_dir = str(tmp_path / "refused")
    cfg.train.eval_tasks = ["mmlu=whatever"]
    with pytest.raises(UserError, match="train.eval_tasks.0 'mmlu=whatever': write KIND=PATH"):
        train(cfg)
    cfg.train.eval_tasks = [f"choice={tmp_path / 'missing.jsonl'}"]
    with pytest.raises(UserError, match="missing.jsonl does not exist"):
        train(cfg)


def test_lm_eval_runs_a_task_defined_in_a_local_file(model_dir, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    data = tmp_path / "quiz.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS[:1] + QUESTIONS[2:]))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "quiz.yaml").write_text(
        "task: local_quiz\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n"
    )
    args = ["eval", str(model_dir), "--task", "lm_eval=local_quiz", "--device", "cpu",
            "--lm-eval-include", str(tmp_path / "tasks"), "--json"]  # fmt: skip
    assert main(args) == 0
    got = json.loads(capsys.readouterr().out)[str(model_dir)]["lm_eval:local_quiz"]
    assert 0.0 <= got["local_quiz"]["acc,none"] <= 1.0
    assert main([*args[:2], "--tasks", "lm_eval:local_quiz", *args[4:]]) == 0
    assert "local_quiz" in json.loads(capsys.readouterr().out)[str(model_dir)]["lm_eval:local_quiz"]
    assert main([*args[:3], "lm_eval=no_such_task", *args[4:]]) == 2
    assert "knows no task no_such_task" in capsys.readouterr().err


def test_batched_generation_is_greedy_decoding_of_each_prompt(model_dir):
    from crossdistill.eval.code import complete

    m = load_eval_model(str(model_dir), "cpu")
    prompts = ["def add(a, b):\n", "# a much longer prompt, so the batch is left-padded\nx = 1\n"]
    got = complete(m, prompts, max_new_tokens=6)
    for prompt, text in zip(prompts, got):
        ids = m.tokenizer(prompt)["input_ids"]
        new = []
        for _ in range(6):
            with torch.no_grad():
                nxt = int(m.model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(nxt)
        want = m.tokenizer.decode(new, skip_special_tokens=True)
        assert text == want[: len(text)] and want.startswith(text)
    assert m.model.config._attn_implementation != "sdpa"  # the packed attention is back


def test_packed_attention_refuses_a_key_value_cache(model_dir):
    m = load_eval_model(str(model_dir), "cpu")
    with pytest.raises(ValueError, match="not a key/value cache"):
        m.model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)

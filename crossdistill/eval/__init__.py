"""`crossdistill eval`: the numbers a distilled model is judged by, for any Hugging Face causal
LM folder (a run's `final/` included).

`model.py` (loading a model folder for evaluation), `bpb.py` (bits per byte on a corpus,
tokenizer-free, through the trainer's data pipeline), `choice.py` (multiple-choice
log-likelihood tasks), `code.py` (HumanEval / MBPP completions run against their tests,
pass@1), `sandbox.py` (one limited, network-less, guarded process per sample), `cli.py` (the
command: one table or `--json`, several models side by side), `tasks.py` (task specs and
running them on a model in memory: the trainer's `train.eval_tasks`). Imports `data`,
`models` and what they import; `train` and `cli` import it."""

"""`crossdistill eval`: the numbers a distilled model is judged by, for any Hugging Face causal
LM folder (a run's `final/` included).

`model.py` (loading a model folder for evaluation), `bpb.py` (bits per byte on a corpus,
tokenizer-free, through the trainer's data pipeline), `choice.py` (multiple-choice
log-likelihood tasks), `code.py` (HumanEval / MBPP completions run against their tests,
pass@1), `sandbox.py` (one limited, network-less, guarded process per sample), `cli.py` (the
command: one table or `--json`, several models side by side). Imports `train` and everything
below it; only `cli` imports it."""

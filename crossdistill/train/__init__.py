"""Building components, the training step, the loop, checkpoints, metrics.

`build.py` (components from a config, every model in its layout: one process is the
one-rank layout), `step.py` (one optimizer step over a window of micro-batches), `loop.py`,
`evaluate.py` (held-out loss and bits per byte), `serve.py` (a separate teacher's processes:
the student's schedule, sending targets), `checkpoint.py` (DCP checkpoints of every
layout, the Hugging Face export), `metrics.py`, `demo.py`, `cache_build.py` (a teacher cache
built over a config's corpus), `teacher_cache.py` (`crossdistill cache build|inspect`, and the
checks a run does before it reads a cache), `audit.py` (`crossdistill audit`: a tokenizer pair
on the user's text), `auto_target.py` (`teachers.N.target: auto`: each teacher's target chosen
at load from how its pair aligns on the training text). Imports every part below it; only `bench` and `cli` import it."""

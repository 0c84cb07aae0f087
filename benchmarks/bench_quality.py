"""`crossdistill bench quality` from a checkout, without installing the package:

    python benchmarks/bench_quality.py --student-tokenizer $TOK/llama3/hf \\
        --teacher-tokenizer $TOK/qwen3/hf --teacher-tokenizer $TOK/llama2/hf --scale gpu --seeds 5

The experiment itself is library code (`crossdistill.bench.quality`); `quality_gpu.sh` runs
it detached on a GPU machine and copies its results out while it goes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from crossdistill.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", "quality", *sys.argv[1:]]))

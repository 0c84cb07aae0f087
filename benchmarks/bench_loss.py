"""Chunked student loss vs naive full logits vs bare matmuls; same as `crossdistill bench loss`.

python benchmarks/bench_loss.py --device cpu --json
python benchmarks/bench_loss.py --device cuda
"""

import sys

from crossdistill.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["bench", "loss", *sys.argv[1:]]))

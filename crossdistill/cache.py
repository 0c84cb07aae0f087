"""The on-disk cache of derived files (JSONL line indexes, tokenizer byte tables, converted
tokenizers): `$CROSSDISTILL_CACHE`, default `~/.cache/crossdistill`.

Every entry is derived from inputs its key names, written to a temporary file and renamed into
place (concurrent writers race harmlessly: the last rename wins with a complete file), and
read defensively: an entry that does not load is rebuilt, never trusted. A read-only home just
means nothing is cached.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def cache_path(kind: str, name: str) -> Path:
    """Where entry `name` of kind `kind` lives (the folder is not created)."""
    root = Path(os.environ.get("CROSSDISTILL_CACHE", Path.home() / ".cache" / "crossdistill"))
    return root / kind / name


def write_atomic(path: Path, write: Callable[[Path], None]) -> bool:
    """`write(tmp)` then rename `tmp` to `path`; False (and nothing left behind) when the cache
    cannot be written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
        return True
    except OSError:
        tmp.unlink(missing_ok=True)
        return False

"""Task files: JSONL records (gzip-compressed or not), each checked by the task's own rule; a
malformed record is skipped and counted, or with `bad_input="error"` stops the run naming its
line."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from crossdistill.errors import UserError

Check = Callable[[dict], "tuple[dict | None, str | None]"]


def read_records(path: Path, check: Check, bad_input: str, what: str) -> tuple[list[dict], int]:
    """(the records `check` accepts, as it returns them; how many lines it refused). `check`
    gets each JSON object and returns (record, None) or (None, why)."""
    if not path.is_file():
        raise UserError(f"task file {path} does not exist")
    opener: Any = gzip.open if path.suffix == ".gz" else open
    records, skipped = [], 0
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            record, why = _parse(line, check)
            if why is None:
                records.append(record)
            elif bad_input == "error":
                raise UserError(f"{path}:{n}: {why}; fix the record or use --bad-input skip")
            else:
                skipped += 1
    if not records:
        raise UserError(f"{path} holds no well-formed {what} ({skipped} malformed lines)")
    return records, skipped


def _parse(line: str, check: Check) -> tuple[dict | None, str | None]:
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"not JSON ({e.msg})"
    if not isinstance(r, dict):
        return None, "not a JSON object"
    return check(r)

"""Byte offsets, chunk alignment between two tokenizations of one text, vocabulary projection.

`TokenBytes` (per-vocabulary byte table), `align` / `align_batch` (chunks of one text, or of a
batch), `align_dp` (the quadratic fallback, as a baseline), `Projection` / `build_projection`
(sparse teacher-to-student vocabulary map; imported on first use, it needs torch).

Imports `errors`, `cache` and `models` (tokenizers) only."""

from crossdistill.alignment.align import align
from crossdistill.alignment.batch import align_batch
from crossdistill.alignment.chunks import Alignment, align_dp
from crossdistill.alignment.token_bytes import TokenBytes

__all__ = [
    "Alignment",
    "Projection",
    "TokenBytes",
    "align",
    "align_batch",
    "align_dp",
    "build_projection",
]


def __getattr__(name: str):
    if name in ("Projection", "build_projection"):
        from crossdistill.alignment import projection

        return getattr(projection, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

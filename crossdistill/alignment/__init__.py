"""Byte offsets, chunk alignment between two tokenizations of one text, vocabulary projection."""

from crossdistill.alignment.align import Alignment, align, align_batch, align_dp
from crossdistill.alignment.token_bytes import TokenBytes

__all__ = ["Alignment", "TokenBytes", "align", "align_batch", "align_dp"]

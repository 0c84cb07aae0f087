"""Byte offsets, chunk alignment between two tokenizations of one text, vocabulary projection."""

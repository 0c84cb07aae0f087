"""Datasets, packing on common boundaries, chat data, collator, resumable loader."""

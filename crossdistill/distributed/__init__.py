"""Parallel layouts and their application (FSDP2, TP, CP)."""

"""Held-out loss and bits per byte."""

"""Distillation losses: pure tensor math, and the chunked student pass."""

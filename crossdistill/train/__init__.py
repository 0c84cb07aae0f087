"""Building components, the training step, the loop, checkpoints, metrics."""

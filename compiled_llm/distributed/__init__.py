"""Tensor parallelism: the process group of one engine's ranks, and the collectives the model's
layers and the runner call (an all-reduce that stays inside the compiled pieces)."""

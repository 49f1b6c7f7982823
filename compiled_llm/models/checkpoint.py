"""Checkpoint tensors read lazily: a tensor-parallel rank reads only the rows or columns it keeps
(safetensors slices read just those bytes from the memory-mapped file)."""

from __future__ import annotations

from typing import Any

import torch


class CheckpointTensor:
    """One tensor of a safetensors file, not read yet."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self) -> torch.Tensor:
        return self._slice[:]

    def read_slice(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]


def read(loaded: CheckpointTensor | torch.Tensor, dim: int | None = None, start: int = 0,
         length: int | None = None) -> torch.Tensor:
    """All of `loaded`, or `length` entries of dimension `dim` from `start`."""
    if dim is None:
        return loaded.read() if isinstance(loaded, CheckpointTensor) else loaded
    length = loaded.shape[dim] - start if length is None else length
    if isinstance(loaded, CheckpointTensor):
        return loaded.read_slice(dim, start, length)
    return loaded.narrow(dim, start, length)

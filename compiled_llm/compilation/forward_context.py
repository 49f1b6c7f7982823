"""The per-step context that ops outside the traced arguments read.

The attention op needs the step's metadata (slot mapping, block tables, ...) and the CUDA-graph
wrappers need the step's mode and batch shape. Passing those as traced arguments would bake
Python values into the graph, so they travel here instead, set around each forward.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

from compiled_llm.compilation.config import CUDAGraphMode


class BatchDescriptor(NamedTuple):
    """The shape of a step that selects a CUDA graph: frozen, hashable, compared by value."""

    num_tokens: int
    num_reqs: int | None = None
    uniform: bool = False
    # Uniform batches: every request's query tokens (1 for plain decode, 1 + k for a verification
    # of k drafts each), so a FULL graph's attention launch is fixed by the descriptor alone.
    query_len: int | None = None


@dataclass
class ForwardContext:
    attn_metadata: Any
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE
    batch_descriptor: BatchDescriptor | None = None


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("No forward context is set: run the model inside set_forward_context().")
    return _current


def peek_forward_context() -> ForwardContext | None:
    return _current


@contextmanager
def set_forward_context(
    attn_metadata: Any,
    cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    batch_descriptor: BatchDescriptor | None = None,
) -> Iterator[ForwardContext]:
    global _current
    previous = _current
    _current = ForwardContext(attn_metadata, cudagraph_runtime_mode, batch_descriptor)
    try:
        yield _current
    finally:
        _current = previous

"""The compiler side of the runtime: trace once, split around attention, compile pieces with
Inductor per shape range, cache the artifacts on disk, and replay CUDA graphs on GPUs."""

from compiled_llm.compilation.config import CompilationConfig, CUDAGraphMode
from compiled_llm.compilation.forward_context import (
    BatchDescriptor,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)

__all__ = [
    "BatchDescriptor",
    "CompilationConfig",
    "CUDAGraphMode",
    "ForwardContext",
    "get_forward_context",
    "set_forward_context",
]

"""The compiler side of the runtime: trace once, split around attention, compile pieces with
Inductor per shape range, cache the artifacts on disk, and replay CUDA graphs on GPUs."""

from compiled_llm.compilation.config import CompilationConfig, CUDAGraphMode
from compiled_llm.compilation.cuda_graph import CUDAGraphWrapper, capture_phase
from compiled_llm.compilation.cudagraph_dispatcher import CudagraphDispatcher
from compiled_llm.compilation.forward_context import (
    BatchDescriptor,
    ForwardContext,
    get_forward_context,
    set_forward_context,
)

__all__ = [
    "BatchDescriptor",
    "capture_phase",
    "CompilationConfig",
    "CudagraphDispatcher",
    "CUDAGraphMode",
    "CUDAGraphWrapper",
    "ForwardContext",
    "get_forward_context",
    "set_forward_context",
]

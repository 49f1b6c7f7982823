"""Start-up work that makes the forward fast: compile it piecewise (or load it from the compile
cache) and, at -O2 on a GPU, capture its CUDA graphs. Nothing is compiled or captured later,
while serving."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from compiled_llm.compilation.compile_cache import CompileCache
from compiled_llm.compilation.config import CompilationConfig, CUDAGraphMode
from compiled_llm.compilation.cudagraph_dispatcher import CudagraphDispatcher
from compiled_llm.compilation.forward_context import set_forward_context
from compiled_llm.logger import init_logger
from compiled_llm.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from compiled_llm.compilation.compiled_forward import CompiledForward

logger = init_logger(__name__)


def compile_model(
    model: torch.nn.Module, inputs: StepInputs, config: CompilationConfig, cache: CompileCache, max_num_tokens: int
) -> CompiledForward:
    """Trace and compile `model` (or load it from `cache`), tracing with dummy `inputs`."""
    from compiled_llm.compilation.compiled_forward import CompiledForward

    if max_num_tokens < 2:
        raise ValueError("compilation needs max_num_batched_tokens >= 2")
    compiled = CompiledForward(model, config, cache, max_num_tokens)
    num_tokens = min(max_num_tokens, 16)
    with torch.inference_mode(), set_forward_context(inputs.dummy(num_tokens)):
        compiled.trace(*inputs.model_args(num_tokens))
    r = compiled.report
    how = ("traced with Dynamo and " + ("compiled" if r.inductor_compilations else "loaded")) if r.traced \
        else "loaded the saved graph"
    logger.info(
        "Compilation (-O%d): %s in %.2f s; %d pieces (%d unique); %d artifacts loaded, "
        "%d Inductor compilations; cache %s",
        config.level, how, compiled.seconds, r.pieces, r.unique_pieces, r.artifacts_loaded,
        r.inductor_compilations, r.cache_dir,
    )
    return compiled


def compile_summary(compiled: CompiledForward, rank: int) -> dict[str, Any]:
    """What one rank's compile did (its report, its seconds), in plain values that cross a pipe:
    `precompile --json` is made of these."""
    return {"rank": rank, "seconds": compiled.seconds, **dataclasses.asdict(compiled.report)}


def capture_cudagraphs(
    model_forward: Callable[..., torch.Tensor],
    inputs: StepInputs,
    config: CompilationConfig,
    max_num_tokens: int,
    max_num_reqs: int,
    uniform_query_lens: tuple[int, ...] = (1,),
    name: str = "model",
) -> tuple[Callable[..., torch.Tensor], CudagraphDispatcher]:
    """Capture every graph the dispatcher can pick, largest first, into one memory pool. Returns
    the forward to call from now on (wrapped in a FULL graph wrapper when the mode has full
    graphs) and the dispatcher that picks each step's graph. `uniform_query_lens`: the query
    lengths uniform batches get FULL graphs for (1, and 1 + k under speculation)."""
    from compiled_llm.compilation.counters import counters
    from compiled_llm.compilation.cuda_graph import CUDAGraphWrapper, capture_phase

    sizes = [s for s in config.cudagraph_capture_sizes if s <= max_num_tokens]
    dispatcher = CudagraphDispatcher(sizes, config.cudagraph_mode, max_num_reqs, uniform_query_lens)
    if config.cudagraph_mode.has_full_cudagraphs():
        model_forward = CUDAGraphWrapper(model_forward, CUDAGraphMode.FULL, name=name)
    started, captured = time.perf_counter(), counters.num_cudagraph_captured
    free_before = torch.cuda.mem_get_info()[0]
    with torch.inference_mode(), capture_phase():
        for mode, descriptor in dispatcher.capture_descriptors():
            metadata = inputs.dummy(descriptor.num_tokens, descriptor.num_reqs or 1)
            with set_forward_context(metadata, mode, descriptor):
                model_forward(*inputs.model_args(descriptor.num_tokens))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    counters.cudagraph_capture_seconds += seconds
    logger.info(
        "CUDA graphs (%s) of the %s: %d captured for %d sizes up to %d tokens in %.2f s, using %.2f GiB.",
        config.cudagraph_mode.name, name, counters.num_cudagraph_captured - captured, len(sizes), max(sizes, default=0),
        seconds, (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30),
    )
    return model_forward, dispatcher

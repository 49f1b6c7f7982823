"""Start-up work that makes the forward fast: compile it piecewise (or load it from the compile
cache) and, at -O2 on a GPU, capture its CUDA graphs. Nothing is compiled or captured later,
while serving."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from compiled_llm.compilation.cache_key import engine_compile_cache
from compiled_llm.compilation.config import CUDAGraphMode
from compiled_llm.compilation.cudagraph_dispatcher import CudagraphDispatcher
from compiled_llm.compilation.forward_context import set_forward_context
from compiled_llm.logger import init_logger

if TYPE_CHECKING:
    from compiled_llm.compilation.compiled_forward import CompiledForward
    from compiled_llm.worker.model_runner import ModelRunner

logger = init_logger(__name__)


def compile_model(runner: ModelRunner) -> CompiledForward:
    """Trace and compile the runner's model (or load it from the compile cache)."""
    from compiled_llm.compilation.compiled_forward import CompiledForward

    config = runner.config.compilation_config
    if runner.max_num_tokens < 2:
        raise ValueError("compilation needs max_num_batched_tokens >= 2")
    compiled = CompiledForward(runner.model, config, engine_compile_cache(runner.config), runner.max_num_tokens)
    num_tokens = min(runner.max_num_tokens, 16)
    with torch.inference_mode(), set_forward_context(runner.inputs.dummy(num_tokens)):
        compiled.trace(*runner.inputs.model_args(num_tokens))
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


def capture_cudagraphs(runner: ModelRunner) -> CudagraphDispatcher:
    """Capture every graph the dispatcher can pick, largest first, into one memory pool."""
    from compiled_llm.compilation.counters import counters
    from compiled_llm.compilation.cuda_graph import CUDAGraphWrapper, capture_phase

    config = runner.config.compilation_config
    sizes = [s for s in config.cudagraph_capture_sizes if s <= runner.max_num_tokens]
    dispatcher = CudagraphDispatcher(sizes, config.cudagraph_mode, runner.max_num_reqs)
    if config.cudagraph_mode.has_full_cudagraphs():
        runner.model_forward = CUDAGraphWrapper(runner.model_forward, CUDAGraphMode.FULL, name="model")
    started, captured = time.perf_counter(), counters.num_cudagraph_captured
    free_before = torch.cuda.mem_get_info()[0]
    with torch.inference_mode(), capture_phase():
        for mode, descriptor in dispatcher.capture_descriptors():
            metadata = runner.inputs.dummy(descriptor.num_tokens, descriptor.num_reqs or 1)
            with set_forward_context(metadata, mode, descriptor):
                runner.model_forward(*runner.inputs.model_args(descriptor.num_tokens))
    torch.cuda.synchronize()
    logger.info(
        "CUDA graphs (%s): %d captured for %d sizes up to %d tokens in %.2f s, using %.2f GiB.",
        config.cudagraph_mode.name, counters.num_cudagraph_captured - captured, len(sizes), max(sizes, default=0),
        time.perf_counter() - started, (free_before - torch.cuda.mem_get_info()[0]) / (1 << 30),
    )
    return dispatcher

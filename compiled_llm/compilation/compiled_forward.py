"""A model forward compiled piecewise and then called directly, without Dynamo per call.

A warm start (the cache entry holds the traced graph and every artifact) rebuilds the split
graph from disk and never runs Dynamo. A cold start traces once with Dynamo (the token
dimension of every input marked dynamic), compiles or loads every piece, and saves the graph.
Either way later calls go straight to the split graph: no guards, no recompiles.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from compiled_llm.compilation.backend import CompilerBackend
from compiled_llm.compilation.compile_cache import CompileCache, CompileCacheError
from compiled_llm.compilation.config import CompilationConfig
from compiled_llm.compilation.counters import CompileReport, counters
from compiled_llm.compilation.traced_graph import DirectCall


class CompiledForward:
    def __init__(
        self,
        model: torch.nn.Module,
        config: CompilationConfig,
        cache: CompileCache,
        max_num_batched_tokens: int,
        progress: bool = True,
    ) -> None:
        self.model = model
        self.config = config
        self.cache = cache
        self.backend = CompilerBackend(config, cache, max_num_batched_tokens, model, progress)
        self.call: DirectCall | None = None
        self.seconds: float | None = None  # loading (warm) or tracing + compiling (cold)
        self.report: CompileReport | None = None  # what the start did (set by `trace`)

    def trace(self, *example_args: torch.Tensor) -> Any:
        """Load or trace and compile everything, then run `example_args` (token dimension > 1)."""
        for arg in example_args:
            if isinstance(arg, torch.Tensor) and arg.dim() and arg.shape[0] < 2:
                raise ValueError("trace with at least 2 tokens: Dynamo specializes sizes 0 and 1")
        before = counters.snapshot()
        started = time.perf_counter()
        with self.cache.opened(self.config.require_cache_hit):
            saved = self.backend.load_saved()
            if saved is None:
                self._trace_with_dynamo(example_args)
                saved = self.backend.traced
        self.call = DirectCall(self.backend.split, saved.bindings, self.model)
        self.seconds = time.perf_counter() - started
        self.report = CompileReport.between(
            before, counters, cache_dir=str(self.cache.entry),
            compile_ranges=list(self.config.compile_ranges), compile_sizes=list(self.config.compile_sizes),
        )
        return self.call(*example_args)

    def _trace_with_dynamo(self, example_args: tuple[torch.Tensor, ...]) -> None:
        from compiled_llm.compilation import inductor_settings

        inductor_settings.apply()
        for arg in example_args:
            torch._dynamo.mark_dynamic(arg, 0)
        self.backend.inputs = example_args
        compiled = torch.compile(self.model.forward, fullgraph=True, dynamic=False, backend=self.backend)
        try:
            compiled(*example_args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            # Surface our own errors (a strict-mode cache miss) as they are, not wrapped by Dynamo.
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, CompileCacheError):
                raise inner from None
            raise
        finally:
            self.backend.inputs = ()

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)

"""A model forward traced once by Dynamo with our backend, then served without guards.

The token dimension of every tensor argument is marked dynamic; all guards are dropped after
the one trace (`guard_filter_fn`), so no guard is evaluated per call and nothing recompiles
while serving. The first call (a dummy batch at start-up) traces, compiles or loads everything.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from compiled_llm.compilation.backend import CompilerBackend, CompileReport
from compiled_llm.compilation.compile_cache import CompileCache, CompileCacheMissError
from compiled_llm.compilation.config import CompilationConfig


def _drop_all_guards(guards: list[Any]) -> list[bool]:
    return [False] * len(guards)


class CompiledForward:
    def __init__(
        self,
        forward: Callable[..., Any],
        config: CompilationConfig,
        cache: CompileCache,
        max_num_batched_tokens: int,
        progress: bool = True,
    ) -> None:
        self.backend = CompilerBackend(config, cache, max_num_batched_tokens, progress)
        self.compiled = torch.compile(
            forward, fullgraph=True, dynamic=False, backend=self.backend, options={"guard_filter_fn": _drop_all_guards}
        )
        self.seconds: float | None = None  # trace + compile-or-load, from the first call

    @property
    def report(self) -> CompileReport:
        return self.backend.report

    def trace(self, *example_args: torch.Tensor) -> Any:
        """Trace with `example_args` (token dimension > 1) and compile or load every piece."""
        for arg in example_args:
            if isinstance(arg, torch.Tensor) and arg.dim() and arg.shape[0] < 2:
                raise ValueError("trace with at least 2 tokens: Dynamo specializes sizes 0 and 1")
            torch._dynamo.mark_dynamic(arg, 0)
        started = time.perf_counter()
        try:
            out = self.compiled(*example_args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            # Surface our own errors (a strict-mode cache miss) as they are, not wrapped by Dynamo.
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, CompileCacheMissError):
                raise inner from None
            raise
        self.seconds = time.perf_counter() - started
        return out

    def __call__(self, *args: Any) -> Any:
        return self.compiled(*args)

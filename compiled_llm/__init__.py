"""compiled-llm: an LLM-serving runtime built around the compiler."""

from __future__ import annotations

__version__ = "0.1.0"

from compiled_llm.outputs import CompletionOutput, Logprob, RequestOutput
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams


def __getattr__(name: str):
    # LLM pulls in torch and the engine; import it only when asked for.
    if name == "LLM":
        from compiled_llm.utils import gc_paused

        with gc_paused():  # torch and the engine's modules: no collection walks them mid-import
            from compiled_llm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = [
    "LLM",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "__version__",
]

"""compiled-llm: an LLM-serving runtime built around the compiler."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"


def _allow_source_checkout() -> None:
    """Run from a source checkout (PYTHONPATH=repo) as if installed.

    pyproject maps the top-level `compilation/` and `kernels/` folders to
    `compiled_llm.compilation` and `compiled_llm.kernels`; without an install, adding the
    checkout root to this package's search path gives the same names.
    """
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "compilation" / "__init__.py").is_file():
        if str(root) not in __path__:
            __path__.append(str(root))


_allow_source_checkout()

from compiled_llm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402


def __getattr__(name: str):
    # LLM pulls in torch and the engine; import it only when asked for.
    if name == "LLM":
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

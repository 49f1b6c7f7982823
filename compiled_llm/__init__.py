"""compiled-llm: an LLM-serving runtime built around the compiler."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"


def _map_checkout_subpackages() -> None:
    """Run from a source checkout (PYTHONPATH=repo) as if installed.

    pyproject maps the top-level `compilation/` and `kernels/` folders to `compiled_llm.compilation`
    and `compiled_llm.kernels`. From a checkout, a finder first in line maps exactly those two names
    (their submodules follow their `__path__`), so nothing else of the checkout (tests/,
    benchmarks/) becomes part of the package, and an installed copy elsewhere cannot shadow them.
    """
    root = Path(__file__).resolve().parent.parent
    if not ((root / "pyproject.toml").is_file() and (root / "compilation" / "__init__.py").is_file()):
        return
    import importlib.abc
    import importlib.util
    import sys

    folders = {f"{__name__}.compilation": root / "compilation", f"{__name__}.kernels": root / "kernels"}

    class CheckoutSubpackages(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            folder = folders.get(name)
            if folder is None:
                return None
            return importlib.util.spec_from_file_location(
                name, folder / "__init__.py", submodule_search_locations=[str(folder)]
            )

    if not any(type(f).__name__ == "CheckoutSubpackages" for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutSubpackages())


_map_checkout_subpackages()

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

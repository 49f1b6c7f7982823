"""The layering holds: every import between the project's modules follows an allowed edge.

The request path reads top-down (entrypoints -> engine -> core -> executor -> worker -> models ->
compilation and kernels), and imports point down it, never back up: the frontend never reaches
into the engine core's insides, the core reaches the runner only through the executor and the
messages it hands back, and `compilation/` and `kernels/` stand alone. Every import counts:
module-level, inside a function, and under TYPE_CHECKING alike (each is a dependency a reader
must follow). The table below is the one place that says what may import what.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Source folders and the import name each is installed under.
SOURCE_ROOTS = {ROOT / "compiled_llm": "compiled_llm"}

# What any layer may use: the logger and small utilities.
FOUNDATION = frozenset({"logger", "utils"})
# The settings and values every layer shares (CompilationConfig is part of the engine's config).
SHARED = FOUNDATION | {"config", "compilation.config", "sampling_params", "pooling_params", "structured_output_spec",
                       "outputs",
                       "bundled_model",  # the default model: where its files are
                       "gguf_file",  # a GGUF file as MODEL: its config and tokenizer, its checked tables
                       "lora.request"}  # which adapter a request runs with

ALLOWED: dict[str, frozenset[str]] = {
    # precompile: the executor, and the worker's cache key (`--print-cache-key` builds no runner)
    "entrypoints": SHARED | {"engine", "executor", "worker", "compilation", "messages"},
    # the frontend starts the core (in-process, a process, Ray) and reads an adapter to refuse a bad one
    "engine": SHARED | {"core", "messages", "lora"},
    "core": SHARED | {"executor", "messages", "spec_decode"},  # the scheduler asks the proposers for drafts
    "executor": SHARED | {"worker", "distributed", "messages"},
    # (spec_decode: with asynchronous scheduling the runner fills the drafts from n-grams)
    "worker": SHARED | {"models", "quantization", "compilation", "kernels", "distributed", "messages", "lora",
                        "spec_decode"},
    "models": SHARED | {"quantization", "compilation", "kernels", "distributed"},
    "quantization": SHARED | {"kernels", "distributed"},  # the weight formats the models' linears ask for
    "spec_decode": FOUNDATION,  # proposers: pure functions of a request's tokens
    "distributed": FOUNDATION,
    "messages": FOUNDATION | {"sampling_params", "pooling_params", "lora.request"},
    "lora": SHARED | {"models"},  # adapters read from PEFT files into the models' LoRA layers
    "lora.request": FOUNDATION,
    # a .gguf MODEL's config and tokenizer folder; config.json read directly
    "config": FOUNDATION | {"compilation.config", "gguf_file", "config_json"},
    "config_json": frozenset(),  # config.json read without transformers
    "compilation.config": FOUNDATION | {"compilation"},  # its defaults come from the cache and the passes
    "sampling_params": FOUNDATION,
    "pooling_params": FOUNDATION,
    "structured_output_spec": FOUNDATION | {"sampling_params"},  # what a request's constraint becomes
    "outputs": FOUNDATION,
    "bundled_model": FOUNDATION,
    "gguf_file": FOUNDATION,
    "compilation": FOUNDATION | {"compilation.config"},
    "kernels": FOUNDATION,
    "utils": frozenset({"logger"}),
    "logger": frozenset(),
}


def module_name(path: Path) -> str:
    for folder, name in SOURCE_ROOTS.items():
        if folder in path.parents:
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([name, *parts])
    raise ValueError(path)


def layer(module: str) -> str | None:
    """The node of the table a module belongs to (None: the package root, which anyone may
    import for its version and which re-exports the public API)."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if parts[:2] == ["compilation", "config"]:
        return "compilation.config"
    if parts[:2] == ["lora", "request"]:
        return "lora.request"
    return parts[0]


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every import of a compiled_llm module in `source`, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # `from compiled_llm.x import y` may name a submodule y: count both.
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name == "compiled_llm" or name.startswith("compiled_llm.")]


def known_module(name: str, modules: set[str]) -> str | None:
    """The longest prefix of `name` that is one of the project's modules."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import of `sources` (module -> (text, is_package)) outside the table, as text."""
    modules = set(sources)
    bad = []
    for module, (text, is_package) in sorted(sources.items()):
        src = layer(module)
        for line, name in imported_modules(text, module, is_package):
            target = known_module(name, modules)
            if target is None:
                continue
            dst = layer(target)
            if src is None or dst is None or dst == src:
                continue
            if src not in ALLOWED:
                bad.append(f"{module}: layer {src!r} is not in the table")
            elif dst not in ALLOWED[src]:
                bad.append(f"{module}:{line} imports {target} ({src} -> {dst} is not an allowed edge)")
    return sorted(set(bad))


@functools.cache
def _read_sources() -> tuple[tuple[str, str, bool], ...]:
    return tuple((module_name(path), path.read_text(), path.name == "__init__.py")
                 for folder in SOURCE_ROOTS for path in sorted(folder.rglob("*.py")))


def project_sources() -> dict[str, tuple[str, bool]]:
    return {module: (text, is_package) for module, text, is_package in _read_sources()}


def file_cycles(sources: dict[str, tuple[str, bool]]) -> list[list[str]]:
    """Circles between files, through any of their imports (one deferred into a function to
    dodge the circle at import time, or kept under TYPE_CHECKING, still makes two files that each
    need the other to be understood). A package's `__init__` re-exporting its modules is no circle."""
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for module, (text, is_package) in sources.items():
        edges = set()
        for _, name in imported_modules(text, module, is_package):
            target = known_module(name, modules)
            if target and target != module and not module.startswith(target + "."):
                edges.add(target)
        graph[module] = edges
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return cycles


def test_every_import_follows_an_allowed_edge() -> None:
    assert violations(project_sources()) == []


def test_every_layer_is_in_the_table() -> None:
    layers = {layer(m) for m in project_sources()} - {None}
    assert layers <= set(ALLOWED), f"add {sorted(layers - set(ALLOWED))} to ALLOWED"


def test_no_two_files_import_each_other() -> None:
    assert file_cycles(project_sources()) == []


@pytest.mark.parametrize(
    ("module", "line", "allowed"),
    [
        ("compiled_llm.core.scheduler", "from compiled_llm.worker.model_runner import ModelRunner", False),
        ("compiled_llm.core.engine_core", "from ..worker import model_runner", False),
        ("compiled_llm.compilation.cache_key", "from compiled_llm.config import EngineConfig", False),
        ("compiled_llm.engine.processor", "import compiled_llm.executor.ray_executor", False),
        ("compiled_llm.entrypoints.openai.api_server", "from compiled_llm.core import core_proc", False),
        ("compiled_llm.kernels.cpu_attention", "from compiled_llm.worker import model_runner", False),
        ("compiled_llm.models.llama", "from compiled_llm.kernels.cpu_attention import paged_attention", True),
        ("compiled_llm.core.scheduler", "from compiled_llm.messages import scheduler_output", True),
    ],
)
def test_an_upward_import_is_caught(module: str, line: str, allowed: bool) -> None:
    """The checker itself: an import added against the direction is reported, one along it is not."""
    sources = project_sources()
    text, is_package = sources[module]
    sources[module] = (text + "\n" + line + "\n", is_package)
    added = [v for v in violations(sources) if v not in violations(project_sources())]
    assert (added == []) is allowed, added

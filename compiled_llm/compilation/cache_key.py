"""The compile cache key: a hash of every factor that changes the compiled code.

The factors are written beside the cache entry as JSON so that a person can see why two
starts used different entries (`compiled-llm cache explain` compares them by name). The sources
factor holds one digest per file: the package files the graph-building packages can reach by
import (`GRAPH_PACKAGES` and their import closure, see source_closure.py) and the files defining
the model's classes. That is a superset of what Dynamo traces, which is safe and lets the key be
computed without tracing (`precompile --print-cache-key`), and it leaves out what cannot shape
compiled code (the server, the CLI, tool parsers, the scheduler), so editing those keeps every
cache. The factors come as plain values: an engine's are assembled on the worker's side
(`compiled_llm/worker/cache_factors.py`).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import importlib
import inspect
import json
import os
import platform
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._config_module import _UNSET_SENTINEL

import compiled_llm
from compiled_llm.compilation.config import CompilationConfig
from compiled_llm.compilation.source_closure import SourceTree, import_closure


def _hash_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# The config modules whose values shape the generated code, and the entries that
# inductor_settings.apply() sets in every process that compiles or loads (constants of this
# package, so not read back).
CONFIG_MODULES = {"inductor_config": "torch._inductor.config", "functorch_config": "torch._functorch.config"}
APPLIED_SETTINGS = {"cpp.vec_isa_ok", "cpp_cache_precompile_headers"}
_ENV_NAME = re.compile(r"[\"']([A-Z][A-Z0-9_]+)[\"']")


@functools.cache
def _config_env_names(module_name: str) -> tuple[str, ...]:
    """Every quoted upper-case name in the config module's source: a superset of the environment
    variables it reads (read as text: importing Inductor's config imports Inductor, 3 s)."""
    source = Path(torch.__file__).parent.joinpath(*module_name.split(".")[1:]).with_suffix(".py")
    return tuple(sorted(set(_ENV_NAME.findall(source.read_text()))))


def config_fingerprint(module_name: str) -> dict[str, Any]:
    """A torch config module's values without importing it: the torch version (a factor of its
    own) fixes the defaults, so what can differ is the environment variables the module reads
    and, where this process has already imported it, the values set in it."""
    names = _config_env_names(module_name)
    env = {name: os.environ[name] for name in names if name in os.environ}
    overrides: dict[str, str] = {}
    module = sys.modules.get(module_name)
    if module is not None:
        for name, entry in getattr(module, "_config", {}).items():
            value = getattr(entry, "user_override", _UNSET_SENTINEL)
            if isinstance(value, contextvars.ContextVar):  # torch 2.13; a plain value (a dict, say) in older ones
                value = value.get(_UNSET_SENTINEL)
            if not name.startswith("_") and name not in APPLIED_SETTINGS and value is not _UNSET_SENTINEL \
                    and value != entry.default:
                overrides[name] = repr(value)
    return {"environment": env, "set_in_process": overrides}


# The packages whose code builds the traced graph or the code generated for it: the models and
# their layers, the weight formats, the compiler, the kernels (custom ops and their fake
# implementations), the collectives inside compiled pieces, and the runner that makes the traced
# inputs. Whatever they import from the rest of the package (config, utils, messages...) joins.
GRAPH_PACKAGES = ("compiled_llm.models", "compiled_llm.quantization", "compiled_llm.compilation",
                  "compiled_llm.kernels", "compiled_llm.distributed", "compiled_llm.worker")


def source_tree() -> SourceTree:
    """compiled_llm's module names -> files."""
    return SourceTree({"compiled_llm": Path(importlib.import_module("compiled_llm").__file__).parent})


def package_sources() -> list[Path]:
    """The package files that can shape compiled code: `GRAPH_PACKAGES` and the closure of their
    imports (the package's own `__init__.py`, which re-exports the public API, is not entered).
    Found once a process (parsing 200 files: 0.2 s of a warm start, which asks twice)."""
    return list(_package_sources())


@functools.cache
def _package_sources() -> tuple[Path, ...]:
    tree = source_tree()
    roots = [tree.file_of(name) for name in GRAPH_PACKAGES]
    top = tree.file_of("compiled_llm")
    return tuple(import_closure(tree, [p.parent if p.name == "__init__.py" else p for p in roots if p], leaves={top}))


def model_sources(model: torch.nn.Module) -> list[Path]:
    """The files defining the classes of the model and its submodules (torch's own excluded:
    the torch version is a factor already)."""
    torch_dir = Path(torch.__file__).parent
    files = set()
    for module in model.modules():
        try:
            path = Path(inspect.getfile(type(module)))
        except (TypeError, OSError):
            continue
        if torch_dir not in path.parents:
            files.add(path)
    return sorted(files)


def source_digests(files: list[Path]) -> dict[str, str]:
    """A digest per file, named by its module (`compiled_llm.models.llama`) or, outside the
    package, by its file name, so that `cache explain` can say which files changed. The names do
    not depend on where the package is installed: the key follows content, not paths."""
    tree = source_tree()
    digests: dict[str, str] = {}
    for path in sorted(set(files)):
        try:
            name = tree.module_of(path)
        except ValueError:
            name = path.name
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        # Two files of one name (a model file beside an edited copy): both count.
        digests[name] = _hash_text(digests[name] + digest)[:16] if name in digests else digest
    return digests


def sources_hash(files: list[Path]) -> str:
    return _hash_text(json.dumps(source_digests(files), sort_keys=True))


def device_description(device: torch.device) -> str:
    """What the generated code was built for: an entry restored onto another machine must only
    be reused where that code runs (Inductor's C++ targets the vector ISA it finds)."""
    if device.type == "cuda":
        import triton

        props = torch.cuda.get_device_properties(device)
        return f"cuda:{props.name}:sm{props.major}{props.minor}:triton{triton.__version__}"
    return f"cpu:{platform.machine()}:{cpu_vector_isa()}"


def cpu_vector_isa() -> str:
    """The CPU features Inductor chooses its vector ISA from (`cpu_vec_isa.pick_vec_isa`), read
    as it reads them but without importing Inductor; ATEN_CPU_CAPABILITY narrows its choice."""
    cpu = torch.cpu
    if platform.machine() in ("x86_64", "AMD64"):
        flags = {"avx2": cpu._is_avx2_supported(), "avx512": cpu._is_avx512_supported(),
                 "avx512_vnni": cpu._is_avx512_supported() and cpu._is_vnni_supported(),
                 "amx_tile": cpu._is_amx_tile_supported()}
        isa = "+".join(name for name, present in flags.items() if present) or "none"
    elif platform.machine() == "aarch64":
        caps = torch.cpu.get_capabilities()
        isa = "+".join(f"{k}={caps[k]}" for k in ("sve", "sve2", "bf16", "sve_max_length") if k in caps) or "neon"
    else:
        isa = "default"
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    return f"{isa}(ATEN_CPU_CAPABILITY={capability})" if capability else isa


def compute_factors(
    *,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    compilation_config: CompilationConfig,
    max_num_batched_tokens: int,
    source_files: list[Path],
    cpu_kernels: bool = False,
    tensor_parallel: tuple[int, int] = (0, 1),
) -> dict[str, Any]:
    """Everything that changes the traced graph or the code generated for it. `cpu_kernels`: the
    model calls this project's C++ CPU ops (a graph that calls them cannot run where they are
    not built)."""
    from compiled_llm.compilation.pass_manager import PassManager

    model = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash"):
        model.pop(volatile, None)
    return {
        "compiled_llm_version": compiled_llm.__version__,
        "torch_version": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "device": device_description(device),
        **{factor: config_fingerprint(module) for factor, module in CONFIG_MODULES.items()},
        "inductor_options": compilation_config.inductor_options,
        "model_config": model,
        "dtype": str(dtype),
        "max_num_batched_tokens": max_num_batched_tokens,
        "compile_ranges": [list(r) for r in compilation_config.compile_ranges],
        "compile_sizes": list(compilation_config.compile_sizes),
        "splitting_ops": sorted(compilation_config.splitting_ops),
        "passes": {"enabled": list(compilation_config.passes), "uuid": PassManager(compilation_config.passes).uuid()},
        "sources": source_digests(source_files),
        "cpu_kernels": cpu_kernels,
        # Each tensor-parallel rank compiles its own slice of the model into its own entry.
        **({"tensor_parallel": {"rank": tensor_parallel[0], "world_size": tensor_parallel[1]}}
           if tensor_parallel[1] > 1 else {}),
    }


def cache_key(factors: dict[str, Any]) -> str:
    return _hash_text(json.dumps(factors, sort_keys=True, default=repr))[:16]

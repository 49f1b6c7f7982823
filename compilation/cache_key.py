"""The compile cache key: a hash of every factor that changes the compiled code.

The factors are written beside the cache entry as JSON so that a person can see why two
starts used different entries. The source hash covers every Python file of the package and the
files defining the model's classes: a superset of what Dynamo traces, which is safe and lets
the key be computed without tracing (`precompile --print-cache-key`). The factors come as plain
values: an engine's are assembled on the worker's side (`compiled_llm/worker/cache_factors.py`).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch

import compiled_llm
from compiled_llm.compilation.config import CompilationConfig


def _hash_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _config_module_hash(module: Any) -> str:
    """Hash of a torch config module (inductor, functorch), skipping entries that don't change code."""
    try:
        data = module.save_config_portable()
    except Exception:  # older torch: fall back to the full dict
        data = module.get_config_copy()
    return _hash_text(json.dumps(data, sort_keys=True, default=repr))


def package_sources() -> list[Path]:
    """Every .py file of compiled_llm (its compilation and kernels packages included)."""
    files: set[Path] = set()
    for name in ("compiled_llm", "compiled_llm.compilation", "compiled_llm.kernels"):
        folder = Path(importlib.import_module(name).__file__).parent
        files.update(folder.rglob("*.py") if name == "compiled_llm" else folder.glob("*.py"))
    return sorted(files)


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


def sources_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in sorted(set(files)):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def device_description(device: torch.device) -> str:
    """What the generated code was built for: an entry restored onto another machine must only
    be reused where that code runs (Inductor's C++ targets the vector ISA it found)."""
    if device.type == "cuda":
        import triton

        props = torch.cuda.get_device_properties(device)
        return f"cuda:{props.name}:sm{props.major}{props.minor}:triton{triton.__version__}"
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return f"cpu:{platform.machine()}:{pick_vec_isa()}"


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
    from compiled_llm.compilation import inductor_settings
    from compiled_llm.compilation.pass_manager import PassManager

    inductor_settings.apply()  # before hashing Inductor's configuration
    model = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    for volatile in ("_name_or_path", "transformers_version", "_commit_hash"):
        model.pop(volatile, None)
    return {
        "compiled_llm_version": compiled_llm.__version__,
        "torch_version": torch.__version__,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "device": device_description(device),
        "inductor_config": _config_module_hash(torch._inductor.config),
        "functorch_config": _config_module_hash(torch._functorch.config),
        "inductor_options": compilation_config.inductor_options,
        "model_config": model,
        "dtype": str(dtype),
        "max_num_batched_tokens": max_num_batched_tokens,
        "compile_ranges": [list(r) for r in compilation_config.compile_ranges],
        "compile_sizes": list(compilation_config.compile_sizes),
        "splitting_ops": sorted(compilation_config.splitting_ops),
        "passes": {"enabled": list(compilation_config.passes), "uuid": PassManager(compilation_config.passes).uuid()},
        "sources": sources_hash(source_files),
        "cpu_kernels": cpu_kernels,
        # Each tensor-parallel rank compiles its own slice of the model into its own entry.
        **({"tensor_parallel": {"rank": tensor_parallel[0], "world_size": tensor_parallel[1]}}
           if tensor_parallel[1] > 1 else {}),
    }


def cache_key(factors: dict[str, Any]) -> str:
    return _hash_text(json.dumps(factors, sort_keys=True, default=repr))[:16]

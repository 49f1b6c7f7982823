"""Builds and loads the C++ CPU kernels (kernels/csrc: paged attention, decode-sized linear) once
per machine.

The build (about 20 s) lands under the user cache dir, keyed by the source and torch version,
and is shared by every later process. Without a working compiler the engine falls back to the
torch implementation, with one warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

logger = logging.getLogger("compiled_llm.kernels")

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "cpu_attention.cpp", _CSRC / "cpu_linear.cpp"]
_HEADERS = [_CSRC / "simd.h"]
# -fopenmp: at::parallel_for is an inline OpenMP template; without it the kernels run serially.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp"]


def build_dir() -> Path:
    from compiled_llm.utils import user_cache_dir

    h = hashlib.sha256(" ".join(_FLAGS).encode() + torch.__version__.encode())
    for path in _SOURCES + _HEADERS:
        h.update(path.read_bytes())
    return user_cache_dir() / "torch_extensions" / f"cpu_kernels-{h.hexdigest()[:16]}"


def _register_fakes() -> None:
    """Shapes of the ops that return tensors, for tracing (Dynamo and Inductor use fake tensors)."""

    @torch.library.register_fake("compiled_llm_cpu::linear")
    def _linear_fake(x, weight, bias):
        return x.new_empty(x.shape[0], weight.shape[0])


@lru_cache(maxsize=1)
def cpu_kernels_available() -> bool:
    """Build (first time on this machine) and load the kernels; False if that is impossible."""
    if os.environ.get("COMPILED_LLM_DISABLE_CPU_KERNELS"):
        return False
    try:
        from torch.utils.cpp_extension import load

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        load(
            name="compiled_llm_cpu_kernels",
            sources=[str(p) for p in _SOURCES],
            extra_include_paths=[str(_CSRC)],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
        _register_fakes()
        return hasattr(torch.ops.compiled_llm_cpu, "paged_decode_attention")
    except Exception as e:  # no compiler, no headers, an unsupported platform
        logger.warning("C++ CPU kernels unavailable (%s); using the torch implementation.", e)
        return False


def uses_cpu_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` calls the C++ CPU kernels: fp32 on a CPU, where they
    can be built (this builds them, once per machine)."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available()

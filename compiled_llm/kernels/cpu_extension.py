"""Builds and loads the C++ CPU kernels (kernels/csrc: paged decode and prefill attention, the
packed-weight linear, linears over quantized and 16-bit weights, batched LoRA, the logits' row-wise
argmax) once per machine.

The build (about a minute) lands under the user cache dir, keyed by the sources, the torch version
and the CPU's feature flags, and is shared by every later process on the machine. Without a
working compiler the engine falls back to the torch implementation, with one warning.
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
_SOURCES = [_CSRC / "cpu_attention.cpp", _CSRC / "cpu_prefill_attention.cpp", _CSRC / "cpu_attention_step.cpp",
            _CSRC / "cpu_gemm.cpp", _CSRC / "cpu_quant_gemm.cpp", _CSRC / "cpu_half_gemm.cpp",
            _CSRC / "cpu_lora.cpp", _CSRC / "cpu_argmax.cpp"]
_HEADERS = [_CSRC / "simd.h", _CSRC / "parallel.h", _CSRC / "vec.h", _CSRC / "huge_pages.h", _CSRC / "panel_gemm.h",
            _CSRC / "widen.h"]
# -march=native: the kernels pick their vector width (AVX2 or AVX-512) from the CPU they are built
# on; the folder's hash covers the flags, and the cache key's device factor the CPU's vector ISA.
# No OpenMP: the kernels share out their work through their own pool (csrc/parallel.h).
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast"]


def build_dir() -> Path:
    from compiled_llm.utils import cpu_flags, user_cache_dir

    h = hashlib.sha256(" ".join(_FLAGS).encode() + torch.__version__.encode())
    # The build file names the sources by path: two checkouts (or venvs) sharing one cache folder
    # would otherwise rebuild each other's kernels at every start (90 s on 2 cores).
    h.update(str(_CSRC.resolve()).encode())
    h.update(" ".join(sorted(cpu_flags())).encode())  # a -march=native build runs only where the CPU has them
    for path in _SOURCES + _HEADERS:
        h.update(path.read_bytes())
    return user_cache_dir() / "torch_extensions" / f"cpu_kernels-{h.hexdigest()[:16]}"


def _register_fakes() -> None:
    """Shapes of the ops that return tensors, for tracing (Dynamo and Inductor use fake tensors)."""

    @torch.library.register_fake("compiled_llm_cpu::packed_linear")
    def _packed_linear_fake(x, packed, bias, out_features):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("compiled_llm_cpu::silu_and_mul_packed_linear")
    def _silu_and_mul_packed_linear_fake(x, packed, bias, out_features):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("compiled_llm_cpu::silu_and_mul_packed_linear_act")
    def _silu_and_mul_packed_linear_act_fake(x, packed, bias, out_features):
        return x.new_empty(*x.shape[:-1], out_features), x.new_empty(*x.shape[:-1], x.shape[-1] // 2)

    @torch.library.register_fake("compiled_llm_cpu::pack_quantized_weight")
    def _pack_quantized_weight_fake(q, scales, mins, bits, group_size, panel):
        width = panel if panel > 0 else torch.ops.compiled_llm_cpu.native_panel_width()
        n, k = q.shape
        groups = -(-k // group_size)
        scale_size = scales.element_size()  # fp16 or float32 scales and mins, kept so in the layout
        panel_bytes = width * (groups * scale_size * (2 if bits == 4 else 1) + k * bits // 8)  # scales, mins, q
        return q.new_empty(-(-n // width), panel_bytes, dtype=torch.uint8)

    @torch.library.register_fake("compiled_llm_cpu::quantized_linear")
    def _quantized_linear_fake(x, packed, bias, out_features, in_features, bits, group_size):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("compiled_llm_cpu::pack_half_weight")
    def _pack_half_weight_fake(weight, panel):
        width = panel if panel > 0 else torch.ops.compiled_llm_cpu.native_panel_width()
        n, k = weight.shape
        return weight.new_empty(-(-n // width), k, width)

    @torch.library.register_fake("compiled_llm_cpu::half_linear")
    def _half_linear_fake(x, packed, bias, out_features):
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("compiled_llm_cpu::lora_shrink")
    def _lora_shrink_fake(x, lora_a, indices):
        return x.new_empty(x.shape[0], lora_a.shape[1])

    @torch.library.register_fake("compiled_llm_cpu::lora_expand_")
    def _lora_expand_fake(y, t, lora_b, scalings, indices, slices):
        return None


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
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )
        _register_fakes()
        return hasattr(torch.ops.compiled_llm_cpu, "attention_step")
    except Exception as e:  # no compiler, no headers, an unsupported platform
        logger.warning("C++ CPU kernels unavailable (%s); using the torch implementation.", e)
        return False


def uses_cpu_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on `device` in `dtype` calls the C++ CPU kernels: fp32 on a CPU, where they
    can be built (this builds them, once per machine)."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_kernels_available()

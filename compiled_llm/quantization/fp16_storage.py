"""16-bit weight storage with float32 activations: `--dtype bfloat16` or `float16` on a CPU
without native compute for that dtype (bf16: no AMX, no avx512_bf16; fp16: no CPU here has it).

There, 16-bit matmuls are emulated and about 100x slower than float32, yet a decode step is bound
by the bytes of its weights: so the linear weights (the LM head too) are stored in 16 bits and
converted to float32 in registers inside the GEMM (`compiled_llm_cpu::half_linear`), while
activations, the embedding, the norms and the KV cache stay float32. Half of float32's bytes, on
any CPU. ModelConfig selects it by itself (config.py: `resolve_quantization`) and the start-up
log says so; `--quantization fp16_storage` asks for it where the CPU has native bf16 too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from compiled_llm.quantization.base import LinearMethod, Loaded, QuantizationConfig, copy_part
from compiled_llm.quantization.weight_only import cpu_op_available

_STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class HalfStorageLinearMethod(LinearMethod):
    """The weight in `storage_dtype`; on a CPU with the C++ kernels packed for `half_linear`
    (only the packed copy is kept), elsewhere converted to float32 inside the compiled piece."""

    def __init__(self, storage_dtype: torch.dtype) -> None:
        self.storage_dtype = storage_dtype

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(output_sizes), in_features, dtype=self.storage_dtype),
                                    requires_grad=False)
        layer.register_buffer("packed_weight", None, persistent=False)

    def load(self, layer: nn.Module, loaded: Loaded, shard_index: int | None) -> None:
        if not isinstance(loaded, torch.Tensor):
            raise ValueError("16-bit weight storage loads float checkpoint tensors only")
        copy_part(layer, loaded, shard_index)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if weight.device.type == "cpu" and cpu_op_available("half_linear"):
            layer.packed_weight = torch.ops.compiled_llm_cpu.pack_half_weight(weight.detach(), 0)
            del layer.weight  # the packed copy is the weight now: keep half of float32's bytes, not more

    def packed_state(self, layer: nn.Module) -> dict[str, torch.Tensor | int] | None:
        return None if layer.packed_weight is None else {"packed_weight": layer.packed_weight}

    def restore_packed(self, layer: nn.Module, state: dict[str, torch.Tensor | int]) -> None:
        layer.packed_weight = state["packed_weight"]
        if "weight" in layer._parameters:
            del layer.weight

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.packed_weight is not None:
            return torch.ops.compiled_llm_cpu.half_linear(x, layer.packed_weight, bias, layer.out_features)
        return F.linear(x, layer.weight.to(x.dtype), bias)


class HalfStorageConfig(QuantizationConfig):
    name: ClassVar[str] = "fp16_storage"

    def __init__(self, options: dict[str, Any]) -> None:
        dtype = options.get("dtype")
        if dtype not in _STORAGE_DTYPES or set(options) != {"dtype"}:
            raise ValueError(f"fp16_storage takes the option dtype ({' or '.join(_STORAGE_DTYPES)}), got {options!r}")
        self.dtype_name = dtype

    def linear_method(self, prefix: str) -> LinearMethod | None:
        return HalfStorageLinearMethod(_STORAGE_DTYPES[self.dtype_name])

    def cache_factors(self) -> dict[str, Any]:
        return {"method": self.name, "dtype": self.dtype_name}

    def describe(self) -> str:
        return (f"fp16_storage: every linear and the lm_head stored in {self.dtype_name}, "
                "float32 activations (converted in the GEMM)")

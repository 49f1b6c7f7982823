"""`--quantization fp8`, as vLLM spells it: every linear's weight quantized at load from a float
checkpoint to float8_e4m3fn with one float32 scale per output channel (1 byte a weight; no float
copy is ever held: each part is quantized as it loads), the LM head and the embedding left in the
model's dtype (vLLM's fp8 leaves them too).

The forward (kernels/fp8_linear.py), chosen once per layer after loading, from its device:
- on NVIDIA GPUs of compute capability 8.9 and up (Ada, Hopper), where K and N are multiples of
  16: activations quantized per token at run time (dynamic scales) and `torch._scaled_mm`;
- elsewhere (CPUs, older GPUs): weight-only, the e4m3 weight widened to the activations' dtype
  inside the compiled piece and the channels' scales applied to the output.
Both are plain tensor code that Dynamo traces into the pieces. Checkpoints shipped in fp8 (with
their own scales) are not read yet. Tensor parallelism gives each rank's slice of a row-parallel
weight its own channel scales (over its columns): close to TP=1's weights, not equal to them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from compiled_llm.kernels.fp8_linear import (
    FP8,
    SCALED_MM_MULTIPLE,
    fp8_scaled_linear,
    fp8_weight_only_linear,
    quantize_fp8_rows,
    scaled_mm_supported,
)
from compiled_llm.quantization.base import LinearMethod, Loaded, QuantizationConfig, part_rows

LM_HEAD = "lm_head"


class Fp8LinearMethod(LinearMethod):
    """The weight in e4m3 with per-output-channel scales. `scaled_mm`: None picks the forward from
    the layer's device after loading; True or False forces it (True runs on a CPU as well)."""

    def __init__(self, scaled_mm: bool | None = None) -> None:
        self.scaled_mm = scaled_mm

    def create_weights(self, layer: nn.Module, in_features: int, output_sizes: list[int],
                       params_dtype: torch.dtype) -> None:
        rows = sum(output_sizes)
        # Buffers, not parameters: what a dummy load or a float copy_ would write into is not this.
        layer.register_buffer("weight", torch.empty(rows, in_features, dtype=FP8), persistent=False)
        layer.register_buffer("weight_scale", torch.empty(rows, dtype=torch.float32), persistent=False)
        layer.fp8_scaled_mm = False  # chosen after loading

    def load(self, layer: nn.Module, loaded: Loaded, shard_index: int | None) -> None:
        if not isinstance(loaded, torch.Tensor):
            raise ValueError("fp8 quantizes float checkpoint tensors at load; this one arrives quantized already")
        start, rows = part_rows(layer, shard_index)
        if tuple(loaded.shape) != (rows, layer.in_features):
            raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs model {(rows, layer.in_features)}")
        q, scale = quantize_fp8_rows(loaded)
        layer.weight.narrow(0, start, rows).copy_(q)
        layer.weight_scale.narrow(0, start, rows).copy_(scale.view(-1))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        device = layer.weight.device
        fits = layer.in_features % SCALED_MM_MULTIPLE == 0 and layer.out_features % SCALED_MM_MULTIPLE == 0
        wanted = scaled_mm_supported(device) if self.scaled_mm is None else self.scaled_mm
        layer.fp8_scaled_mm = wanted and fits

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if layer.fp8_scaled_mm:
            return fp8_scaled_linear(x, layer.weight, layer.weight_scale, bias)
        return fp8_weight_only_linear(x, layer.weight, layer.weight_scale, bias)


class Fp8Config(QuantizationConfig):
    name: ClassVar[str] = "fp8"

    def __init__(self, options: dict[str, Any]) -> None:
        if options:
            raise ValueError(f"fp8 takes no quantization options, got {sorted(options)}")

    def linear_method(self, prefix: str) -> LinearMethod | None:
        return None if prefix == LM_HEAD else Fp8LinearMethod()

    def cache_factors(self) -> dict[str, Any]:
        # Which forward a layer takes follows from the device (its capability is in the key already).
        return {"method": self.name, "weight": "float8_e4m3fn", "weight_scales": "per_channel",
                "activations": "dynamic_per_token on compute capability >= 8.9, else weight-only"}

    def describe(self) -> str:
        return ("fp8: every linear float8_e4m3fn with per-channel scales (quantized at load), activations "
                "quantized per token for torch._scaled_mm on GPUs of compute capability >= 8.9, weight-only "
                "elsewhere; lm_head and embedding in the model's dtype")

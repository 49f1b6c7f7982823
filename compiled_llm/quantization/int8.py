"""`--quantization int8`: per-channel symmetric 8-bit weights, quantized at load from any float
checkpoint (gpt-fast's int8 weight-only), float activations; about a quarter of float32's bytes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from compiled_llm.quantization.base import LinearMethod, QuantizationConfig
from compiled_llm.quantization.weight_only import WeightOnlyLinearMethod

# The LM head gets per-channel int8 under every weight-only method (int4 too, as llama.cpp's 4-bit
# files keep theirs in 8 bits). In float it would be the largest read of a small model's decode
# step: SmolLM2-135M's 49152 x 576 head is 113 MB in float32 next to 106 MB for its 210 other
# linears in int8, and one batch-1 pass over it took 13.4 ms in float32, 4.1 ms in int8 (2-core
# Xeon VM). Its tokens stay within float32's top 5 (tests/quantization/). A tied embedding stays
# float for the lookups.
LM_HEAD = "lm_head"
LM_HEAD_METHOD = (8, None)  # bits, group size (None: per channel)


class Int8Config(QuantizationConfig):
    name: ClassVar[str] = "int8"

    def __init__(self, options: dict[str, Any]) -> None:
        if options:
            raise ValueError(f"int8 takes no quantization options, got {sorted(options)}")

    def linear_method(self, prefix: str) -> LinearMethod | None:
        return WeightOnlyLinearMethod(8, None)

    def cache_factors(self) -> dict[str, Any]:
        return {"method": self.name, "bits": 8, "group_size": "per_channel"}

    def describe(self) -> str:
        return "int8: every linear and the lm_head per-channel symmetric 8-bit (quantized at load)"

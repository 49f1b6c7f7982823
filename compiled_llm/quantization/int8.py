"""`--quantization int8`: per-channel symmetric 8-bit weights, quantized at load from any float
checkpoint (gpt-fast's int8 weight-only), float activations; about a quarter of float32's bytes.

The LM head stays float: see `Int8Config.linear_method`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from compiled_llm.quantization.base import LinearMethod, QuantizationConfig
from compiled_llm.quantization.weight_only import WeightOnlyLinearMethod

# The layer left in float by the weight-only methods: a decode step's logits are the one linear
# whose error every sampled token sees directly, and at batch 1 its share of the bytes is one
# layer of ~30 (SmolLM2 ties it to the embedding, which stays float for the lookups anyway).
LM_HEAD = "lm_head"


class Int8Config(QuantizationConfig):
    name: ClassVar[str] = "int8"

    def __init__(self, options: dict[str, Any]) -> None:
        if options:
            raise ValueError(f"int8 takes no quantization options, got {sorted(options)}")

    def linear_method(self, prefix: str) -> LinearMethod | None:
        return None if prefix == LM_HEAD else WeightOnlyLinearMethod(8, None)

    def cache_factors(self) -> dict[str, Any]:
        return {"method": self.name, "bits": 8, "group_size": "per_channel"}

    def describe(self) -> str:
        return "int8: every linear per-channel symmetric 8-bit (quantized at load), lm_head float"

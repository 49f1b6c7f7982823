"""`--quantization int4`: group-wise asymmetric 4-bit weights (gpt-fast's and torchao's int4
weight-only), quantized at load from any float checkpoint, float activations; about a sixth of
float32's bytes (the LM head in int8: see int8.py). Group size 32 by default; 64 or 128 with
`--quantization-options '{"group_size": 128}'` (larger groups: fewer scale bytes, further from float:
on SmolLM2-135M, perplexity on pydoc_data.topics +0.03% with groups of 32, +57% with 128, for
batch-1 decode 0.9x as fast; benchmarks/perplexity.py and weight_formats.py, 2026-12-02).
"""

from __future__ import annotations

from typing import Any, ClassVar

from compiled_llm.quantization.base import LinearMethod, QuantizationConfig
from compiled_llm.quantization.int8 import LM_HEAD, LM_HEAD_METHOD
from compiled_llm.quantization.weight_only import WeightOnlyLinearMethod

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32  # as the GGUF 4-bit blocks; 128 costs too much accuracy on small models


class Int4Config(QuantizationConfig):
    name: ClassVar[str] = "int4"

    def __init__(self, options: dict[str, Any]) -> None:
        unknown = sorted(set(options) - {"group_size"})
        if unknown:
            raise ValueError(f"int4 takes the quantization option group_size only, got {unknown}")
        self.group_size = options.get("group_size", DEFAULT_GROUP_SIZE)
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group_size must be one of {', '.join(map(str, GROUP_SIZES))}, "
                             f"got {self.group_size!r}")

    def linear_method(self, prefix: str) -> LinearMethod | None:
        if prefix == LM_HEAD:
            return WeightOnlyLinearMethod(*LM_HEAD_METHOD)
        return WeightOnlyLinearMethod(4, self.group_size)

    def cache_factors(self) -> dict[str, Any]:
        return {"method": self.name, "bits": 4, "group_size": self.group_size}

    def describe(self) -> str:
        return (f"int4: every linear group-wise asymmetric 4-bit, groups of {self.group_size} "
                "(quantized at load); lm_head per-channel int8")

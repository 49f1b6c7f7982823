"""Weight formats behind one linear-method interface (base.py), one file per method, as vLLM's
`model_executor/layers/quantization/`. Run by each rank, beside the model code that asks it."""

from __future__ import annotations

from compiled_llm.config import QUANTIZATION_NAMES, ModelConfig
from compiled_llm.quantization.base import QuantizationConfig
from compiled_llm.quantization.fp8 import Fp8Config
from compiled_llm.quantization.fp16_storage import HalfStorageConfig
from compiled_llm.quantization.gguf import GGUFConfig
from compiled_llm.quantization.int4 import Int4Config
from compiled_llm.quantization.int8 import Int8Config

QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    cls.name: cls for cls in (Int8Config, Int4Config, HalfStorageConfig, GGUFConfig, Fp8Config)
}


def get_quantization_config(name: str | None, model_config: ModelConfig) -> QuantizationConfig | None:
    """The config of method `name` (None: no quantization) with the model's quantization options."""
    if name is None:
        return None
    if name not in QUANTIZATION_METHODS:
        raise ValueError(f"Unknown quantization method {name!r}; known: {', '.join(QUANTIZATION_NAMES)}.")
    return QUANTIZATION_METHODS[name].from_model_config(model_config)

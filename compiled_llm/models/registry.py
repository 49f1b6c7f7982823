"""Architecture name (config.json's `architectures[0]`) -> model class."""

from __future__ import annotations

from torch import nn

from compiled_llm.config import SUPPORTED_ARCHITECTURES


def model_class(architecture: str) -> type[nn.Module]:
    if architecture == "LlamaForCausalLM":
        from compiled_llm.models.llama import LlamaForCausalLM as cls
    elif architecture == "Qwen2ForCausalLM":
        from compiled_llm.models.qwen2 import Qwen2ForCausalLM as cls
    elif architecture == "Qwen3ForCausalLM":
        from compiled_llm.models.qwen3 import Qwen3ForCausalLM as cls
    else:
        raise ValueError(
            f"Unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    return cls

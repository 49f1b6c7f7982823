"""Qwen3: the Llama decoder with RMSNorm on every query and key head before RoPE."""

from typing import Any

from compiled_llm.models.llama import Biases, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    @classmethod
    def biases(cls, config: Any) -> Biases:
        attention_bias = bool(getattr(config, "attention_bias", False))
        return Biases(qkv=attention_bias, o=attention_bias)  # Qwen3's MLP has no bias

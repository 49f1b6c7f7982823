"""Qwen2: the Llama decoder with a bias on the fused QKV projection (always) and none elsewhere."""

from typing import Any

from compiled_llm.models.llama import Biases, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def biases(cls, config: Any) -> Biases:
        return Biases(qkv=True)

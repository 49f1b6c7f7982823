"""Qwen3: the Llama decoder with RMSNorm on every query and key head before RoPE."""

from compiled_llm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

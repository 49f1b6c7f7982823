"""Qwen2: the Llama decoder with a bias on the fused QKV projection."""

from compiled_llm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True

"""LoRA on the bundled SmolLM2-135M-Instruct: a random rank-16 adapter on every projection, run in
one batch with the base model, against HF transformers running PEFT's merged adapter (greedy
tokens, top-5 closeness where they part); the base model's rows unchanged by their neighbours."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.lora.request import LoRARequest
from tests.lora.adapters import ALL_TARGETS, make_adapter
from tests.oracle import check_close, hf_greedy, ours_greedy

pytestmark = pytest.mark.slow


def test_bundled_model_with_an_adapter_matches_hf(real_model_path, tmp_path):
    # Small weights: a random update as large as the model's own would only produce noise.
    path, merged = make_adapter(real_model_path, tmp_path / "every", 16, ALL_TARGETS, seed=1, std=0.02)
    llm = LLM(real_model_path, enable_lora=True, max_loras=1, max_lora_rank=16, optimization_level=0,
              kv_cache_memory_bytes=64 << 20, max_model_len=512)
    prompts = ["The capital of France is", "Write a haiku about the sea.", "def add(a, b):"]
    adapter = LoRARequest("every", 1, path)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=5, ignore_eos=True)
    base_alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    mixed = llm.generate(prompts * 2, params, lora_request=[adapter] * 3 + [None] * 3, use_tqdm=False)
    ids = [llm.get_tokenizer()(p)["input_ids"] for p in prompts]
    assert check_close(ours_greedy(mixed[:3]), hf_greedy(merged, ids, params.max_tokens)) >= 2
    assert [o.outputs[0].token_ids for o in mixed[3:]] == base_alone
    assert [o.outputs[0].token_ids for o in mixed[:3]] != base_alone, "the adapter changed nothing"

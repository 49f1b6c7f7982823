"""LoRA under tensor parallelism (2 ranks, the tiny Llama, eager): the adapters' matrices split with
their base layers (column-parallel: B's rows; row-parallel: A's columns, the rank-r partials summed
before the expand), so a batch mixing adapters and the base model gives the tokens of one rank."""

from __future__ import annotations

from compiled_llm import LLM, SamplingParams
from compiled_llm.lora.request import LoRARequest
from tests.lora.adapters import ALL_TARGETS, make_adapter


def test_two_ranks_equal_one(tiny_llama, tmp_path):
    every, _ = make_adapter(tiny_llama, tmp_path / "every", 8, ALL_TARGETS, seed=1, merged=False)
    qv, _ = make_adapter(tiny_llama, tmp_path / "qv", 4, ["q_proj", "v_proj"], seed=2, merged=False)
    prompts = ["The capital of France is", "Once upon a time, there", "def fibonacci(n):"]
    requests = [None, LoRARequest("every", 1, every), LoRARequest("qv", 2, qv)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(tiny_llama, enable_lora=True, max_loras=2, max_lora_rank=8, optimization_level=0,
                  kv_cache_memory_bytes=8 << 20, max_model_len=256, tensor_parallel_size=tp)
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=requests,
                                                                     use_tqdm=False)])
        llm.llm_engine.engine_core_client.shutdown()
    assert results[0] == results[1]

"""The profiling run that sizes the KV cache on a GPU (here on a CPU, where it runs the same code
without the memory arithmetic): the largest possible step runs, writes no KV, and leaves the
runner as it was."""

from __future__ import annotations

import gc

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.models.dummy import write_dummy_model


@pytest.mark.parametrize("max_num_seqs, max_num_batched_tokens", [(4, 600), (2, 512)])
def test_profile_run_takes_the_largest_step_and_writes_nothing(tiny_llama, max_num_seqs, max_num_batched_tokens):
    llm = LLM(tiny_llama, optimization_level=0, max_model_len=128, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory_bytes=4 << 20)
    runner = llm.llm_engine.engine_core.executor.driver
    before = [cache.clone() for cache in runner.kv_caches]
    seen = []
    forward = runner.model_forward
    runner.model_forward = lambda ids, pos: seen.append((len(ids), int(pos.max()))) or forward(ids, pos)
    runner.profile_run()
    runner.model_forward = forward
    # Every token the scheduler could batch, in requests no longer than max_model_len.
    assert seen == [(min(max_num_batched_tokens, max_num_seqs * 128), 127)]
    assert all(layer.kv_cache is cache for layer, cache in zip(runner.attention_layers, runner.kv_caches))
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_caches, before))
    out = llm.generate("Still serving", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.cuda
def test_gpu_kv_cache_takes_what_the_memory_utilization_leaves(tmp_path):
    """On a GPU, with no explicit kv_cache_memory_bytes: the KV cache gets the utilization's share
    less the profiled step, and the process stays inside that share."""
    gc.collect()
    torch.cuda.empty_cache()
    folder = write_dummy_model(tmp_path / "smollm2-shape")
    utilization = 0.25
    total = torch.cuda.mem_get_info()[1]
    held_before = torch.cuda.memory_allocated()
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", optimization_level=0, max_model_len=1024,
              max_num_seqs=16, max_num_batched_tokens=512, gpu_memory_utilization=utilization)
    runner = llm.llm_engine.engine_core.executor.driver
    kv_bytes = sum(cache.numel() * cache.element_size() for cache in runner.kv_caches)
    # Weights (~0.3 GiB) and one 512-token step are small next to a quarter of an H200.
    assert kv_bytes >= 0.8 * (utilization * total - held_before)
    assert torch.cuda.memory_reserved() <= utilization * total
    out = llm.generate({"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8

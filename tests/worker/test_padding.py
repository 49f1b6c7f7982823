"""Persistent input buffers padded for CUDA graphs: on a CPU the padding runs eagerly, so these
check its semantics where every CI run can: padded tokens write no KV, padded requests are
inert, and outputs do not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.compilation.config import CUDAGraphMode
from compiled_llm.compilation.cudagraph_dispatcher import CudagraphDispatcher

PROMPTS = [f"Request {i}: the quick brown fox" + " jumps" * i for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def make_llm(model: str) -> LLM:
    return LLM(model, optimization_level=0, max_model_len=256, max_num_batched_tokens=64, max_num_seqs=8,
               kv_cache_memory_bytes=8 << 20)


@pytest.fixture(scope="module")
def unpadded(tiny_llama):
    """The unpadded run: its tokens and its whole KV cache afterwards."""
    llm = make_llm(tiny_llama)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return tokens, [c.clone() for c in llm.llm_engine.engine_core.executor.driver.kv_caches]


def test_padded_steps_give_the_same_tokens_and_write_no_kv(tiny_llama, unpadded):
    expected, expected_caches = unpadded
    llm = make_llm(tiny_llama)
    runner = llm.llm_engine.engine_core.executor.driver
    # Every step is padded as a graph replay would pad it (uniform decodes to FULL keys with
    # padded requests, other steps to PIECEWISE sizes); on a CPU it then runs eagerly.
    runner.dispatcher = CudagraphDispatcher([4, 8, 16, 32, 64], CUDAGraphMode.FULL_AND_PIECEWISE, max_num_seqs=8)
    seen = []
    prepare = runner.inputs.prepare

    def spy(batch, rows, num_sched, num_decodes, padded_tokens, padded_reqs, **kwargs):
        seen.append((int(num_sched.sum()), len(rows), padded_tokens, padded_reqs))
        return prepare(batch, rows, num_sched, num_decodes, padded_tokens, padded_reqs, **kwargs)

    runner.inputs.prepare = spy
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == expected
    assert any(padded_tokens > tokens for tokens, _, padded_tokens, _ in seen)
    assert any(padded_reqs > reqs for _, reqs, _, padded_reqs in seen)
    for cache, unpadded_cache in zip(runner.kv_caches, expected_caches):
        assert torch.count_nonzero(cache[:, 0]) == 0, "a padded token wrote into the null block"
        # Nowhere else either (a slot of -1 taken as "the last slot" would show here).
        torch.testing.assert_close(cache, unpadded_cache, atol=1e-4, rtol=1e-4)


def test_padded_tails_of_the_buffers(tiny_llama):
    llm = make_llm(tiny_llama)
    engine = llm.llm_engine
    engine.add_request("a", "hello there", SamplingParams(max_tokens=5))
    engine.add_request("b", "good morning", SamplingParams(max_tokens=5))
    engine.step()  # prefill both; the next step is a uniform decode of 2 requests
    runner = engine.engine_core.executor.driver
    rows = np.array([runner.batch.row_of["a"], runner.batch.row_of["b"]])
    runner.batch.num_computed_tokens[rows] = runner.batch.num_tokens[rows] - 1
    metadata, _ = runner.inputs.prepare(runner.batch, rows, np.array([1, 1]), num_decodes=2, padded_tokens=4,
                                        padded_reqs=4)
    assert metadata.num_actual_tokens == 2 and metadata.num_reqs == 4
    assert metadata.slot_mapping.tolist()[2:] == [-1, -1]
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 2, 2]  # padded requests own no tokens
    assert metadata.seq_lens.tolist()[2:] == [0, 0]
    assert metadata.block_tables[2:].abs().sum().item() == 0  # the null block
    assert runner.inputs.input_ids.cpu[2:4].tolist() == [0, 0]

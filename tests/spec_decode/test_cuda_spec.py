"""Speculative decoding on a GPU at -O2 (compiled pieces and CUDA graphs): greedy tokens with n-gram
and draft-model drafts equal those without speculation; full-length verifications (1 + k query
tokens per request) replay FULL graphs keyed by their query length, as do the draft model's
one-token steps; nothing is captured while serving; the KV blocks are all free after.

Float32 small random models saved as checkpoints (no download): a 64-token vocabulary makes greedy
outputs repeat, so n-gram proposals exist and are often accepted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compiled_llm import LLM, SamplingParams
from compiled_llm.compilation.config import CUDAGraphMode
from compiled_llm.compilation.counters import counters
from compiled_llm.models.dummy import SMOLLM2_135M, write_dummy_model
from tests.spec_decode.test_ngram_e2e import REPEATING, assert_blocks_free, tokens

pytestmark = pytest.mark.cuda

K = 4
SHAPE = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=64, tie_word_embeddings=False)
OTHERS = [[3, 9, 1, 14, 2, 60, 33], [7] * 9, list(range(3, 40))]
PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


def write_model(folder: Path, seed: int) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = {**SMOLLM2_135M, **SHAPE, "torch_dtype": "float32"}
    write_dummy_model(folder, config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config), dtype=torch.float32)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str, str]:
    root = tmp_path_factory.mktemp("cuda-spec")
    return write_model(root / "target", 0), write_model(root / "other", 1), str(root / "cache")


def make(model: str, cache: str, spec: dict | None) -> LLM:
    return LLM(model, dtype="float32", optimization_level=2, compile_cache=cache, max_model_len=512,
               max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=64 << 20,
               speculative_config=spec)


def record_dispatches(dispatcher) -> list:
    """Wrap a dispatcher so every (mode, descriptor) it returns is kept."""
    seen: list = []
    dispatch = dispatcher.dispatch

    def recording(*args, **kwargs):
        seen.append(dispatch(*args, **kwargs))
        return seen[-1]

    dispatcher.dispatch = recording
    return seen


@pytest.fixture(scope="module")
def expected(models) -> list[list[int]]:
    target, _, cache = models
    base = make(target, cache, None)
    out = tokens(base, REPEATING + OTHERS, PARAMS)
    del base
    return out


def run_speculating(llm: LLM) -> tuple[list[list[int]], list, list]:
    runner = llm.llm_engine.engine_core.executor.driver
    assert runner.dispatcher is not None
    target_seen = record_dispatches(runner.dispatcher)
    draft_seen = record_dispatches(runner.drafter.dispatcher) if runner.drafter is not None else []
    captured = counters.num_cudagraph_captured
    out = [tokens(llm, [p], PARAMS)[0] for p in REPEATING + OTHERS]  # batch 1: uniform verifications
    assert counters.num_cudagraph_captured == captured, "a graph was captured while serving"
    assert_blocks_free(llm)
    return out, target_seen, draft_seen


def full_keys(seen: list, query_len: int) -> list:
    return [key for mode, key in seen if mode is CUDAGraphMode.FULL and key.query_len == query_len]


def test_ngram_greedy_equals_greedy_without_and_verifies_in_full_graphs(models, expected):
    target, _, cache = models
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "measure_gain": False}
    llm = make(target, cache, spec)
    out, seen, _ = run_speculating(llm)
    assert out == expected
    assert full_keys(seen, 1 + K), "no full-length verification replayed a FULL graph"
    assert full_keys(seen, 1), "no plain decode replayed a FULL graph"
    totals = llm.llm_engine.engine_core.scheduler.spec_totals
    assert totals.num_accepted_tokens > 0


def test_the_target_as_its_own_draft_is_exact_with_every_proposal_accepted(models, expected):
    target, _, cache = models
    llm = make(target, cache, {"method": "draft_model", "model": target, "num_speculative_tokens": K,
                               "measure_gain": False})
    out, seen, draft_seen = run_speculating(llm)
    assert out == expected
    assert full_keys(seen, 1 + K), "no full-length verification replayed a FULL graph"
    assert full_keys(draft_seen, 1), "the draft's one-token steps replayed no FULL graph"
    totals = llm.llm_engine.engine_core.scheduler.spec_totals
    assert totals.num_accepted_tokens == totals.num_draft_tokens > 0


def test_a_random_draft_is_still_exact(models, expected):
    target, other, cache = models
    llm = make(target, cache, {"method": "draft_model", "model": other, "num_speculative_tokens": K,
                               "measure_gain": False})
    out, _, _ = run_speculating(llm)
    assert out == expected

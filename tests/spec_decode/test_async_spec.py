"""Speculative decoding with asynchronous scheduling (n-gram drafts proposed in the runner, and the
draft model): greedy outputs are token for token those without speculation, with fewer steps;
max_tokens, stops and EOS inside accepted runs, n > 1, seeded samples, preemption, prefix caching,
aborts in flight and structured outputs (never given drafts then) keep working; the KV blocks are
all free after."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.sampling_params import StructuredOutputsParams
from tests.spec_decode.test_draft_model import OTHERS, draft_spec
from tests.spec_decode.test_ngram_e2e import (
    REPEATING,
    SPEC,
    abort_mid_flight,
    assert_blocks_free,
    assert_cached_continuations_exact,
    make_llm,
    steps,
    tokens,
)


def make_async(model: str, spec: dict, **kwargs) -> LLM:
    llm = make_llm(model, spec, async_scheduling=True, **kwargs)
    assert llm.llm_engine.engine_core.config.scheduler_config.async_scheduling
    return llm


@pytest.fixture(scope="module")
def base(small_vocab_llama) -> LLM:
    return make_llm(small_vocab_llama, None)


@pytest.fixture(scope="module")
def ngram(small_vocab_llama) -> LLM:
    return make_async(small_vocab_llama, SPEC)


def test_ngram_greedy_equals_greedy_without_speculation(base, ngram):
    """(This random model seldom repeats itself: few drafts hold. The draft-model test below shows
    the steps saved.)"""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = tokens(base, REPEATING, params)
    assert tokens(ngram, REPEATING, params) == expected
    totals = ngram.llm_engine.engine_core.scheduler.spec_totals
    assert 0 < totals.num_accepted_tokens <= totals.num_draft_tokens
    assert_blocks_free(ngram)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13, 31])
def test_max_tokens_inside_an_accepted_run(base, ngram, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got = tokens(ngram, REPEATING, params)
    assert got == tokens(base, REPEATING, params) and all(len(t) == max_tokens for t in got)
    assert_blocks_free(ngram)


def test_stops_eos_n_and_seeded_samples(base, ngram):
    expected = tokens(base, REPEATING, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    for i, out in enumerate(expected):  # a stop token that first appears after runs of accepted drafts
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop_token_ids=[out[40]])
        got = tokens(ngram, [REPEATING[i]], params)[0]
        assert got == tokens(base, [REPEATING[i]], params)[0] and got[-1] == out[40]
    for min_tokens in (0, 30):
        params = SamplingParams(max_tokens=60, temperature=0.0, min_tokens=min_tokens)
        assert tokens(ngram, REPEATING, params) == tokens(base, REPEATING, params)
    greedy = SamplingParams(n=3, max_tokens=40, temperature=0.0, ignore_eos=True)
    assert tokens(ngram, REPEATING, greedy) == [t[:40] for t in expected for _ in range(3)]
    seeded = SamplingParams(n=2, max_tokens=40, temperature=0.7, seed=11, ignore_eos=True)
    assert tokens(ngram, REPEATING, seeded) == tokens(ngram, REPEATING, seeded)
    assert_blocks_free(ngram)


def test_aborts_mid_flight_free_every_block(ngram):
    abort_mid_flight(ngram)


def test_preemption_and_prefix_caching(base, small_vocab_llama):
    block_bytes = base.llm_engine.engine_core.executor.driver.kv_bytes_per_block()
    tight = make_async(small_vocab_llama, SPEC, kv_cache_memory_bytes=block_bytes * 24, block_size=8)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    prompts = REPEATING * 4
    assert tokens(tight, prompts, params) == tokens(base, prompts, params)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert_blocks_free(tight)

    cached = make_async(small_vocab_llama, SPEC, block_size=4)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    assert_cached_continuations_exact(cached, base, params)
    assert_blocks_free(cached)


def test_draft_model_own_draft_accepts_every_guess_and_a_wrong_one_stays_exact(base, small_vocab_llama,
                                                                               other_small_vocab_llama):
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    prompts = REPEATING + OTHERS
    expected = tokens(base, prompts, params)
    own = make_async(small_vocab_llama, draft_spec(small_vocab_llama))
    before_base, before_spec = steps(base), steps(own)
    assert tokens(own, prompts, params) == tokens(base, prompts, params)
    totals = own.llm_engine.engine_core.scheduler.spec_totals
    assert totals.num_draft_tokens > 0 and totals.num_accepted_tokens == totals.num_draft_tokens
    assert steps(own) - before_spec < (steps(base) - before_base) / 2
    for short in (SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, n=2),
                  SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[expected[0][9]])):
        assert tokens(own, REPEATING, short) == tokens(base, REPEATING, short)
    abort_mid_flight(own, steps_before=5)
    block_bytes = base.llm_engine.engine_core.executor.driver.kv_bytes_per_block()
    tight = make_async(small_vocab_llama, draft_spec(small_vocab_llama, k=4), block_size=8,
                       kv_cache_memory_bytes=2 * block_bytes * 24)  # preempted rows rebuild their draft KV
    assert tokens(tight, REPEATING * 4, params) == tokens(base, REPEATING * 4, params)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert_blocks_free(tight)

    for spec in (draft_spec(other_small_vocab_llama, k=2),  # a random draft: most guesses rejected
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "measure_gain": False}):
        llm = make_async(small_vocab_llama, spec)
        assert tokens(llm, prompts, params) == expected
        totals = llm.llm_engine.engine_core.scheduler.spec_totals
        assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
        assert_blocks_free(llm)


def test_structured_outputs_decode_without_drafts_beside_speculating_requests(tiny_llama):
    kwargs = dict(optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    base = LLM(tiny_llama, **kwargs)
    spec = make_async(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "measure_gain": False})
    prompts = [{"prompt_token_ids": [40, 41, 42, 43] * 5}, {"prompt_token_ids": [7, 8, 9] * 4}]
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logit_bias={41: 30.0}),
              SamplingParams(max_tokens=20, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]{3,12}"))]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want and want[0] == [41] * 20
    assert spec.llm_engine.engine_core.scheduler.spec_totals.num_accepted_tokens > 0
    assert_blocks_free(spec)

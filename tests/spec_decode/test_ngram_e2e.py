"""N-gram speculative decoding end to end: greedy outputs are token for token those without it
(tiny random models, prompts with and without repetition, preemption, prefix caching, stops and
max_tokens inside accepted runs, n > 1, min_tokens, logprobs), and the KV cache is all free after."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams

# measure_gain off, and no acceptance bar raised by measured step costs: these tests check what
# speculation computes, so every step may propose drafts (on a tiny random model, whose drafts
# seldom land, the measured cost of a row may well stop them; spec_decode/gain.py, step_cost.py
# and backoff.py have their own tests).
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "measure_gain": False}
REPEATING = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13] * 10, [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]


def make_llm(model: str, spec: dict | None, **kwargs) -> LLM:
    kwargs = {"optimization_level": 0, "max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, **kwargs}
    llm = LLM(model, speculative_config=spec, **kwargs)
    scheduler = llm.llm_engine.engine_core.scheduler
    assert (scheduler.step_cost is not None) == (spec is not None)  # a CPU engine measures what rows cost
    scheduler.step_cost = None
    return llm


def tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(c.token_ids) for o in outs for c in o.outputs]


def steps(llm: LLM) -> int:
    return llm.llm_engine.engine_core.executor.driver._step


def assert_blocks_free(llm: LLM) -> None:
    pool = llm.llm_engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "blocks leaked"


def assert_cached_continuations_exact(cached: LLM, base: LLM, params: SamplingParams) -> list[list[int]]:
    """`cached` (4-token blocks) gives `base`'s greedy tokens, then continuations of its outputs hit
    the cached blocks and still equal base's: a cached block of rejected drafts would change them.
    Returns base's tokens for REPEATING."""
    expected = tokens(base, REPEATING, params)
    assert tokens(cached, REPEATING, params) == expected
    longer = [p + out[:37] for p, out in zip(REPEATING, expected)]
    outs = cached.generate([{"prompt_token_ids": p} for p in longer], params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outs)
    assert [list(o.outputs[0].token_ids) for o in outs] == tokens(base, longer, params)
    return expected


@pytest.fixture(scope="module")
def pair(small_vocab_llama):
    """The small-vocabulary model without and with speculation."""
    return make_llm(small_vocab_llama, None), make_llm(small_vocab_llama, SPEC)


def test_greedy_equals_greedy_without_speculation_in_fewer_steps(pair):
    base, spec = pair
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    before_base, before_spec = steps(base), steps(spec)
    expected = tokens(base, REPEATING, params)
    assert tokens(spec, REPEATING, params) == expected
    assert steps(spec) - before_spec < steps(base) - before_base  # drafts were accepted
    assert_blocks_free(spec)


def test_large_vocabulary_model_where_proposals_are_rejected(tiny_llama):
    prompts = [[100 + i for i in range(30)], [7, 8, 9, 10] * 6, [40, 41, 42, 43, 44, 45] * 3]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = tokens(make_llm(tiny_llama, None), prompts, params)
    spec = make_llm(tiny_llama, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                     "measure_gain": False})
    assert tokens(spec, prompts, params) == expected
    assert_blocks_free(spec)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13, 31])
def test_max_tokens_inside_an_accepted_run(pair, max_tokens):
    base, spec = pair
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    got = tokens(spec, REPEATING, params)
    assert got == tokens(base, REPEATING, params) and all(len(t) == max_tokens for t in got)
    assert_blocks_free(spec)


def test_stop_tokens_eos_and_min_tokens_apply_to_each_accepted_token(pair):
    base, spec = pair
    expected = tokens(base, REPEATING, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    # Stop on a token that first appears late in an output (after runs of accepted drafts).
    for i, out in enumerate(expected):
        stop = out[40]
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
        got = tokens(spec, [REPEATING[i]], params)[0]
        assert got == tokens(base, [REPEATING[i]], params)[0] and got[-1] == stop
    for min_tokens in (0, 7, 30):  # EOS (token 2) ends the output, but not before min_tokens
        params = SamplingParams(max_tokens=60, temperature=0.0, min_tokens=min_tokens)
        assert tokens(spec, REPEATING, params) == tokens(base, REPEATING, params)
    assert_blocks_free(spec)


def test_greedy_logprobs_are_those_of_the_accepted_tokens(pair):
    base, spec = pair
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in REPEATING]
    for want, got in zip(base.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params,
                                                                                       use_tqdm=False)):
        w, g = want.outputs[0], got.outputs[0]
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(g.token_ids)
        for wl, gl, token in zip(w.logprobs, g.logprobs, g.token_ids):
            assert list(gl) == list(wl) and token in gl
            for t in wl:
                assert gl[t].rank == wl[t].rank and gl[t].logprob == pytest.approx(wl[t].logprob, abs=1e-4)


def test_n_greater_than_one_and_seeded_samples_repeat(pair):
    base, spec = pair
    greedy = SamplingParams(n=3, max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = tokens(base, REPEATING, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    got = tokens(spec, REPEATING, greedy)
    assert got == [t for t in expected for _ in range(3)]
    seeded = SamplingParams(n=2, max_tokens=40, temperature=0.7, seed=11, ignore_eos=True)
    first = tokens(spec, REPEATING, seeded)
    assert tokens(spec, REPEATING, seeded) == first
    assert_blocks_free(spec)


def test_preemption_under_a_tiny_kv_cache(small_vocab_llama):
    prompts = REPEATING * 4
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    expected = tokens(make_llm(small_vocab_llama, None), prompts, params)
    roomy = make_llm(small_vocab_llama, None)
    block_bytes = roomy.llm_engine.engine_core.executor.driver.kv_bytes_per_block()
    tight = make_llm(small_vocab_llama, SPEC, kv_cache_memory_bytes=block_bytes * 24, block_size=8)
    assert tokens(tight, prompts, params) == expected
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert_blocks_free(tight)


def test_prefix_caching_reuses_only_blocks_of_known_tokens(small_vocab_llama):
    base = make_llm(small_vocab_llama, None, enable_prefix_caching=False)
    spec = make_llm(small_vocab_llama, SPEC, block_size=4)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    expected = tokens(base, REPEATING, params)
    assert tokens(spec, REPEATING, params) == expected
    # Prompts that extend the first outputs hit the blocks the first run cached: had a block of
    # rejected drafts been cached, these continuations would part from the uncached engine's.
    longer = [{"prompt_token_ids": p + out[:37]} for p, out in zip(REPEATING, expected)]
    outs = spec.generate(longer, params, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in outs)
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        list(o.outputs[0].token_ids) for o in base.generate(longer, params, use_tqdm=False)]
    assert_blocks_free(spec)


def test_tensor_parallel_ranks_take_in_the_drivers_verdict(small_vocab_llama):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = tokens(make_llm(small_vocab_llama, None), REPEATING, params)
    tp = make_llm(small_vocab_llama, SPEC, tensor_parallel_size=2)
    try:
        assert tokens(tp, REPEATING, params) == expected
        assert tp.llm_engine.engine_core.scheduler.spec_totals.num_accepted_tokens > 0
        assert_blocks_free(tp)
    finally:
        tp.llm_engine.engine_core.shutdown()


def abort_mid_flight(spec: LLM, steps_before: int = 6) -> None:
    """Start REPEATING, run a few steps (drafts verified), abort them all, and check every KV block
    is free once the engine has drained."""
    engine = spec.llm_engine
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(REPEATING):
        engine.add_request(f"abort-{i}", {"prompt_token_ids": prompt}, params)
    for _ in range(steps_before):
        engine.step()
    assert engine.engine_core.scheduler.spec_totals.num_drafts > 0
    engine.abort_request([f"abort-{i}" for i in range(len(REPEATING))])
    while engine.has_unfinished_requests():
        engine.step()
    assert_blocks_free(spec)


def test_aborts_mid_flight_free_every_block(pair):
    abort_mid_flight(pair[1])


def test_requests_with_penalties_are_not_speculated_and_share_steps_unchanged(pair):
    base, spec = pair
    penalised = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, **p) for p in (
        {"presence_penalty": 0.5}, {"frequency_penalty": 0.4}, {"repetition_penalty": 1.3})]
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={5: 2.0})
    prompts = [{"prompt_token_ids": p} for p in REPEATING + [REPEATING[0]]]
    params = penalised + [plain]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    drafts = spec.llm_engine.engine_core.scheduler.spec_totals.num_drafts
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.llm_engine.engine_core.scheduler.spec_totals.num_drafts > drafts  # the plain one speculated
    assert_blocks_free(spec)

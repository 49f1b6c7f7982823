"""Draft-model speculative decoding end to end on tiny random models: greedy outputs are token for
token those without it, whether the draft is the target itself (every proposal accepted) or another
random model (few accepted), under preemption, prefix caching, n > 1 and aborts; the KV blocks are
all free after; sampling keeps the target's distribution; a draft that cannot serve is refused
with a message naming why."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams
from tests.spec_decode.test_ngram_e2e import (
    REPEATING,
    abort_mid_flight,
    assert_blocks_free,
    assert_cached_continuations_exact,
    make_llm,
    steps,
    tokens,
)

OTHERS = [[3, 9, 1, 14, 2], [7] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2]]


def draft_spec(model: str, k: int = 3) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "measure_gain": False}


@pytest.fixture(scope="module")
def base(small_vocab_llama) -> LLM:
    return make_llm(small_vocab_llama, None)


def test_the_target_as_its_own_draft_has_every_proposal_accepted(base, small_vocab_llama):
    spec = make_llm(small_vocab_llama, draft_spec(small_vocab_llama))
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    before_base, before_spec = steps(base), steps(spec)
    prompts = REPEATING + OTHERS
    assert tokens(spec, prompts, params) == tokens(base, prompts, params)
    totals = spec.llm_engine.engine_core.scheduler.spec_totals
    assert totals.num_draft_tokens > 0 and totals.num_accepted_tokens == totals.num_draft_tokens
    assert steps(spec) - before_spec < (steps(base) - before_base) / 2
    assert_blocks_free(spec)


def test_a_draft_that_guesses_wrong_still_gives_greedy_tokens(base, small_vocab_llama, other_small_vocab_llama):
    spec = make_llm(small_vocab_llama, draft_spec(other_small_vocab_llama, k=4))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = REPEATING + OTHERS
    assert tokens(spec, prompts, params) == tokens(base, prompts, params)
    totals = spec.llm_engine.engine_core.scheduler.spec_totals
    assert totals.num_draft_tokens > 0 and totals.num_accepted_tokens < totals.num_draft_tokens
    assert_blocks_free(spec)


def test_preemption_prefix_caching_n_and_stops(base, small_vocab_llama, other_small_vocab_llama):
    """A tight KV cache (preemptions resume requests whose draft KV must be rebuilt), prefix-cache
    hits on blocks both models wrote, n > 1, stop tokens and max_tokens inside accepted runs."""
    block_bytes = base.llm_engine.engine_core.executor.driver.kv_bytes_per_block()
    tight = make_llm(small_vocab_llama, draft_spec(small_vocab_llama, k=4), block_size=8,
                     kv_cache_memory_bytes=2 * block_bytes * 24)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    prompts = REPEATING * 4
    assert tokens(tight, prompts, params) == tokens(base, prompts, params)
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert_blocks_free(tight)

    cached = make_llm(small_vocab_llama, draft_spec(other_small_vocab_llama), block_size=4)
    expected = assert_cached_continuations_exact(cached, base, params)

    for params in (SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, n=3),
                   SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[expected[0][9]]),
                   SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)):
        assert tokens(tight, REPEATING, params) == tokens(base, REPEATING, params)
    assert_blocks_free(cached)
    assert_blocks_free(tight)


def test_aborts_mid_flight_free_every_block(small_vocab_llama):
    spec = make_llm(small_vocab_llama, draft_spec(small_vocab_llama))
    abort_mid_flight(spec, steps_before=5)
    # The rows the aborted requests held serve new ones unchanged.
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    assert tokens(spec, OTHERS, params) == tokens(make_llm(small_vocab_llama, None), OTHERS, params)


def test_a_draft_with_another_vocabulary_or_no_model_is_refused(small_vocab_llama, tiny_llama):
    with pytest.raises(ValueError, match="vocabulary of .* tokens, the target 16"):
        make_llm(small_vocab_llama, draft_spec(tiny_llama))
    with pytest.raises(ValueError, match="needs model"):
        make_llm(small_vocab_llama, {"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        make_llm(small_vocab_llama, draft_spec(small_vocab_llama), tensor_parallel_size=2)


def test_steps_padded_as_cuda_graphs_pad_them_keep_the_tokens(base, small_vocab_llama):
    """On a CPU the dispatcher's padding runs eagerly, so every CI run checks what a GPU replays:
    the target's steps padded to FULL keys of q = 1 and q = 1 + k (requests of k + 1 query tokens
    padded in count) or PIECEWISE sizes, and the draft's steps to its own keys, give the same
    greedy tokens."""
    from compiled_llm.compilation.config import CUDAGraphMode
    from compiled_llm.compilation.cudagraph_dispatcher import CudagraphDispatcher

    k = 3
    spec = make_llm(small_vocab_llama, draft_spec(small_vocab_llama, k))
    runner = spec.llm_engine.engine_core.executor.driver
    sizes, mode = [1, 2, 4, 8, 16, 32, 64], CUDAGraphMode.FULL_AND_PIECEWISE
    runner.dispatcher = CudagraphDispatcher(sizes, mode, max_num_seqs=8, uniform_query_lens=(1, 1 + k))
    runner.drafter.dispatcher = CudagraphDispatcher(sizes, mode, max_num_seqs=8)
    seen = []
    for dispatcher in (runner.dispatcher, runner.drafter.dispatcher):
        dispatch = dispatcher.dispatch

        def recording(*args, dispatch=dispatch, **kwargs):
            seen.append(dispatch(*args, **kwargs))
            return seen[-1]

        dispatcher.dispatch = recording
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = REPEATING + OTHERS
    assert [tokens(spec, [p], params)[0] for p in prompts] == tokens(base, prompts, params)
    assert any(m is CUDAGraphMode.FULL and key.query_len == 1 + k and key.num_reqs == 1 for m, key in seen)
    assert any(m is CUDAGraphMode.FULL and key.query_len == 1 for m, key in seen)
    assert_blocks_free(spec)

"""With temperature > 0, speculation keeps the model's distribution: over many fixed-seed samples
from a tiny model, the tokens at each output position are distributed alike with and without it
(chi-square on the two histograms; the seeds are fixed, so the test is deterministic)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from compiled_llm import LLM, SamplingParams

NUM_SAMPLES = 1500
SEED_PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8]


def sample(llm: LLM, prompt: list[int], **params) -> np.ndarray:
    prompts = [{"prompt_token_ids": prompt}] * NUM_SAMPLES
    many = [SamplingParams(max_tokens=4, ignore_eos=True, seed=seed, **params) for seed in range(NUM_SAMPLES)]
    return np.array([o.outputs[0].token_ids for o in llm.generate(prompts, many, use_tqdm=False)])


@pytest.mark.parametrize("method,async_scheduling", [("ngram", False), ("draft_model", False), ("ngram", True)])
def test_sampled_tokens_follow_the_same_distribution(small_vocab_llama, method, async_scheduling):
    """draft_model: the model is its own draft, proposing its greedy tokens. async_scheduling: the
    runner proposes the n-gram drafts, a step ahead of the scheduler."""
    kwargs = dict(optimization_level=0, max_model_len=128, kv_cache_memory_bytes=32 << 20, max_num_seqs=256)
    base = LLM(small_vocab_llama, **kwargs)
    config = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
               "measure_gain": False}
              if method == "ngram"
              else {"method": "draft_model", "model": small_vocab_llama, "num_speculative_tokens": 3,
                    "measure_gain": False})
    spec = LLM(small_vocab_llama, speculative_config=config, async_scheduling=async_scheduling, **kwargs)
    # The model's own greedy text, which it tends to loop in: proposals from it are often accepted.
    greedy = base.generate([{"prompt_token_ids": SEED_PROMPT}], SamplingParams(max_tokens=40, temperature=0.0,
                                                                               ignore_eos=True), use_tqdm=False)
    prompt = SEED_PROMPT + list(greedy[0].outputs[0].token_ids)
    totals = spec.llm_engine.engine_core.scheduler.spec_totals
    for params in ({"temperature": 0.3}, {"temperature": 1.0, "top_p": 0.8}):
        accepted = totals.num_accepted_tokens
        want, got = sample(base, prompt, **params), sample(spec, prompt, **params)
        assert totals.num_accepted_tokens - accepted > NUM_SAMPLES // 5, "too few drafts were accepted"
        for position in range(4):
            vocab = max(want[:, position].max(), got[:, position].max()) + 1
            table = np.stack([np.bincount(want[:, position], minlength=vocab),
                              np.bincount(got[:, position], minlength=vocab)])
            table = table[:, table.sum(axis=0) > 0]
            assert chi2_contingency(table).pvalue > 1e-3, (params, position, table)
    pool = spec.llm_engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1

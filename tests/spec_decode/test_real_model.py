"""N-gram speculation on the bundled SmolLM2 through the offline `LLM` API: a rewrite of given text
(proposals mostly right) and an open question (mostly none) give greedy's tokens, a stop string
that lands inside an accepted run ends the text where greedy's does (with synchronous and with
asynchronous scheduling); and a request with structured
outputs (never given drafts) shares verification steps with the others unchanged."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams
from compiled_llm.sampling_params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
        "measure_gain": False}  # every step may propose drafts (gain.py has its own tests)
TEXT = ("The old lighthouse stood on the northern cliff, its white paint peeling in the salt wind. Every night "
        "the keeper climbed the spiral stairs and lit the great lamp.")


@pytest.mark.slow
def test_bundled_model_greedy_with_ngram_equals_without(real_model_path):
    kwargs = dict(optimization_level=0, max_model_len=512, kv_cache_memory_bytes=64 << 20)
    base = LLM(real_model_path, **kwargs)
    chats = [[{"role": "user", "content": f"Copy this text exactly, word for word:\n\n{TEXT}"}],
             [{"role": "user", "content": "Name a color."}]]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    want = [o.outputs[0] for o in base.chat(chats, params, use_tqdm=False)]
    # A stop string inside the copied text: it ends inside an accepted run.
    stop = SamplingParams(max_tokens=32, temperature=0.0, stop=["spiral"])
    want_stop = base.chat(chats[:1], stop, use_tqdm=False)[0].outputs[0]
    for async_scheduling in (False, True):  # async: the runner proposes, a step ahead of the scheduler
        spec = LLM(real_model_path, speculative_config=SPEC, async_scheduling=async_scheduling, **kwargs)
        got = [o.outputs[0] for o in spec.chat(chats, params, use_tqdm=False)]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        totals = spec.llm_engine.engine_core.scheduler.spec_totals
        assert totals.num_accepted_tokens >= 10  # the copy was mostly proposed right
        got_stop = spec.chat(chats[:1], stop, use_tqdm=False)[0].outputs[0]
        assert got_stop.text == want_stop.text and got_stop.token_ids == want_stop.token_ids
        assert got_stop.finish_reason == "stop"
        pool = spec.llm_engine.engine_core.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        del spec


def test_structured_outputs_share_verification_steps(tiny_llama):
    kwargs = dict(optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    base = LLM(tiny_llama, **kwargs)
    spec = LLM(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                                     "measure_gain": False},
               **kwargs)
    prompts = [{"prompt_token_ids": [40, 41, 42, 43] * 5}, {"prompt_token_ids": [7, 8, 9] * 4}]
    # A logit bias makes the first request repeat itself (drafts proposed and accepted, the bias applied
    # at every verified position).
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logit_bias={41: 30.0}),
              SamplingParams(max_tokens=20, temperature=0.0,
                             structured_outputs=StructuredOutputsParams(regex="[a-z]{3,12}"))]
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    before = spec.llm_engine.engine_core.scheduler.spec_totals.num_drafts
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    totals = spec.llm_engine.engine_core.scheduler.spec_totals
    assert got == want and totals.num_drafts > before and totals.num_accepted_tokens > 0
    assert want[0] == [41] * 20


def test_constrained_requests_speculate_within_their_grammar(tiny_llama):
    """A request under a grammar gets drafts too: they are cut where the grammar forbids them, and
    its bitmask is applied at every verified position. Here a logit bias makes the output repeat a
    letter (drafts accepted) until the regex allows only the end (drafts cut, then none)."""
    from transformers import AutoTokenizer

    letter = AutoTokenizer.from_pretrained(tiny_llama).convert_tokens_to_ids("a")
    kwargs = dict(optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    spec = LLM(tiny_llama, speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                                                     "measure_gain": False},
               **kwargs)
    prompt = [{"prompt_token_ids": [letter] * 12}]
    for regex in ("a{3,14}", "[a-z]{2,9}b?"):
        params = SamplingParams(max_tokens=30, temperature=0.0, logit_bias={letter: 30.0},
                                structured_outputs=StructuredOutputsParams(regex=regex))
        want = LLM(tiny_llama, **kwargs).generate(prompt, params, use_tqdm=False)[0].outputs[0]
        totals = spec.llm_engine.engine_core.scheduler.spec_totals
        before = (totals.num_drafts, totals.num_accepted_tokens)
        got = spec.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids and got.text == want.text
        assert totals.num_drafts > before[0] and totals.num_accepted_tokens > before[1]
    assert want.text.startswith("a" * 9) and len(want.text) <= 10  # the regex ended the repeat
    pool = spec.llm_engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


@pytest.mark.slow
def test_warm_start_with_speculation_compiles_nothing(real_model_path, warm_compile_cache):
    """Speculation leaves the compiled graph alone: the precompiled entry serves it (zero Inductor
    runs), and the compiled verification forward gives the compiled decode's tokens."""
    kwargs = dict(optimization_level=1, require_cache_hit=True, max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    chats = [[{"role": "user", "content": f"Copy this text exactly, word for word:\n\n{TEXT}"}]]
    params = SamplingParams(max_tokens=32, temperature=0.0)
    spec = LLM(real_model_path, speculative_config=SPEC, **kwargs)
    assert spec.llm_engine.engine_core.executor.driver.compiled_forward.report.inductor_compilations == 0
    got = spec.chat(chats, params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.llm_engine.engine_core.scheduler.spec_totals.num_accepted_tokens >= 10
    del spec
    want = LLM(real_model_path, **kwargs).chat(chats, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


@pytest.mark.slow
def test_bundled_model_as_its_own_draft_warm_start_compiles_nothing_and_every_guess_holds():
    """The draft-model method on the served default (the shipped Q4_1 file) with itself as the
    draft: `precompile` with the speculative config fills the draft's own entry too, a strict warm
    start then runs no Inductor compilation for either model, greedy gives the tokens it gives
    without speculation, and every proposal is accepted."""
    import json
    import subprocess

    from compiled_llm.bundled_model import bundled_gguf_path

    draft = {"method": "draft_model", "model": str(bundled_gguf_path()), "num_speculative_tokens": 4,
             "measure_gain": False}
    settings = dict(max_model_len=1024, kv_cache_memory_bytes=128 << 20)
    out = subprocess.run(["compiled-llm", "precompile", "--max-model-len", "1024", "--speculative-config",
                          json.dumps(draft), "--json"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    spec = LLM(speculative_config=draft, require_cache_hit=True, **settings)
    driver = spec.llm_engine.engine_core.executor.driver
    assert driver.compiled_forward.report.inductor_compilations == 0
    assert driver.drafter.forward.report.inductor_compilations == 0
    chats = [[{"role": "user", "content": f"Copy this text exactly, word for word:\n\n{TEXT}"}],
             [{"role": "user", "content": "Name a color."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    got = [o.outputs[0].token_ids for o in spec.chat(chats, params, use_tqdm=False)]
    totals = spec.llm_engine.engine_core.scheduler.spec_totals
    assert totals.num_draft_tokens >= 10 and totals.num_accepted_tokens == totals.num_draft_tokens
    pool = spec.llm_engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1
    del spec
    want = [o.outputs[0].token_ids for o in LLM(**settings).chat(chats, params, use_tqdm=False)]
    assert got == want

"""Asynchronous scheduling (step N+1 scheduled while step N runs, sampled ids fed to the next step
on the device) gives exactly what synchronous scheduling gives: the same tokens, text, finish
reasons and logprobs, under preemption, stops, aborts, n > 1, seeds, penalties and prefix caching,
and never a token after a stop."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, SamplingParams

PROMPTS = [f"Story {i}: once upon a time" + " there was a fox" * i for i in range(8)]


def mixed_params(stop_token: int) -> list[SamplingParams]:
    """Every knob that async scheduling must get right, spread over the batch."""
    out = []
    for i in range(8):
        knobs: dict = dict(max_tokens=18 + 2 * i, min_tokens=2)
        if i % 2:
            knobs.update(temperature=0.9, top_p=0.95, seed=100 + i)
        else:
            knobs.update(temperature=0.0)
        if i % 4 == 1:
            knobs.update(presence_penalty=0.4, frequency_penalty=0.2)
        if i % 4 == 2:
            knobs.update(repetition_penalty=1.2)
        if i % 3 == 0:
            knobs.update(logprobs=3)
        if i == 5:
            knobs.update(stop=[" the"])  # a stop string found by the frontend
        if i == 6:
            knobs.update(stop_token_ids=[stop_token], ignore_eos=True)
        out.append(SamplingParams(**knobs))
    return out


def run(model: str, async_scheduling: bool, kv_bytes: int, prompts=PROMPTS, params=None, **engine) -> tuple:
    llm = LLM(model, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=kv_bytes, max_num_seqs=8,
              async_scheduling=async_scheduling, **engine)
    if params is None:
        params = mixed_params(llm.get_tokenizer()(" the", add_special_tokens=False)["input_ids"][0])
    outs = llm.generate(prompts, params, use_tqdm=False)
    core = llm.llm_engine.engine_core
    # Logprobs to 2 decimals: a step's batch may hold other requests in the two modes (one that
    # stopped is computed once more before the host knows), which moves float rounding, not tokens.
    result = [
        [(c.token_ids, c.text, c.finish_reason, c.stop_reason,
          [{t: round(lp.logprob, 2) for t, lp in d.items()} for d in (c.logprobs or [])]) for c in o.outputs]
        for o in outs
    ]
    pool = core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1, "blocks leaked"
    assert not core.has_unfinished_requests()
    return result, core.scheduler.num_preemptions, core.scheduler.kv.stats


@pytest.mark.parametrize("kv_mib", [64, 13], ids=["roomy", "preempting"])
def test_async_equals_sync_on_the_bundled_model(real_model_path, kv_mib):
    sync, sync_preemptions, _ = run(real_model_path, False, kv_mib << 20)
    asyn, async_preemptions, _ = run(real_model_path, True, kv_mib << 20)
    assert asyn == sync
    if kv_mib == 13:
        assert sync_preemptions > 0 and async_preemptions > 0
    # The stop string and the stop token ended their requests, with nothing after them.
    assert sync[5][0][2] == "stop" and " the" not in sync[5][0][1]
    assert sync[6][0][2] == "stop" and sync[6][0][3] is not None and sync[6][0][0][-1] == sync[6][0][3]


def test_n_and_prefix_caching_agree(real_model_path):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12)
    shared = "A long shared system prompt that both requests start with, word for word. " * 3
    prompts = [shared + "First question?", shared + "Second question?", shared + "First question?"]
    sync, _, _ = run(real_model_path, False, 64 << 20, prompts, params)
    asyn, _, stats = run(real_model_path, True, 64 << 20, prompts, params)
    assert asyn == sync
    assert len({tuple(c[0]) for c in sync[0]}) > 1  # the children differ


def test_eos_and_max_tokens_end_without_an_extra_token(tiny_llama):
    """A request that stops is never given the token its next (already launched) step made."""
    eos = 2
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 2, 3, 7)]
    params.append(SamplingParams(temperature=0.0, max_tokens=9, stop_token_ids=[eos]))
    prompts = ["a b c", "d e f", "g h i", "j k l", "m n o"]
    sync, _, _ = run(tiny_llama, False, 16 << 20, prompts, params)
    asyn, _, _ = run(tiny_llama, True, 16 << 20, prompts, params)
    assert asyn == sync
    assert [len(o[0][0]) for o in asyn[:4]] == [1, 2, 3, 7]


def test_aborts_mid_flight_free_their_blocks(tiny_llama):
    outputs = {}
    for async_scheduling in (False, True):
        llm = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20,
                  async_scheduling=async_scheduling)
        engine = llm.llm_engine
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        for i in range(4):
            engine.add_request(str(i), f"request {i} says", params)
        seen: dict[str, list[int]] = {str(i): [] for i in range(4)}
        steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id] = out.outputs[0].token_ids
            steps += 1
            if steps == 5:
                engine.abort_request(["1", "3"])  # while (async) a step for them is in flight
        pool = engine.engine_core.scheduler.kv.pool
        assert pool.num_free_blocks == pool.num_blocks - 1
        outputs[async_scheduling] = seen
    # The requests that ran to the end agree; the aborted ones got nothing after the abort.
    for rid in ("0", "2"):
        assert outputs[True][rid] == outputs[False][rid] and len(outputs[True][rid]) == 30
    for rid in ("1", "3"):
        assert len(outputs[True][rid]) < 30 and len(outputs[False][rid]) < 30

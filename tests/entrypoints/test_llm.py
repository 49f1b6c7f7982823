"""The offline API on the real bundled model (and a tiny one where the model does not matter)."""

from __future__ import annotations

import pytest

from compiled_llm import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from compiled_llm.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
KV_BYTES = 256 << 20


@pytest.fixture(scope="module")
def llm(real_model_path):
    return LLM(real_model_path, optimization_level=0, max_model_len=1024, kv_cache_memory_bytes=KV_BYTES)


def test_prompt_forms_and_output_fields(llm):
    tok = llm.get_tokenizer()
    ids = tok("Hello, my name is")["input_ids"]
    single = llm.generate("Hello, my name is", GREEDY, use_tqdm=False)
    many = llm.generate(["The sky is", "Hello, my name is", {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert len(single) == 1 and len(many) == 3
    out = many[1]
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)
    assert out.prompt == "Hello, my name is" and out.prompt_token_ids == ids and out.finished
    c = out.outputs[0]
    assert c.index == 0 and len(c.token_ids) == 24 and c.finish_reason == "length" and c.stop_reason is None
    assert c.text == tok.decode(c.token_ids)
    # Order kept, and batching-invariant:
    assert many[2].outputs[0].token_ids == c.token_ids == single[0].outputs[0].token_ids
    assert many[2].prompt is None


def test_one_sampling_params_per_prompt(llm):
    each = [SamplingParams(max_tokens=2, ignore_eos=True), SamplingParams(max_tokens=5, ignore_eos=True)]
    outs = llm.generate(["a", "b"], each, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()] * 3, use_tqdm=False)


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0].outputs[0]
    text = base.text
    cut = text[len(text) // 3 : len(text) // 3 + 5]
    assert cut and text.find(cut) > 0
    prompt = "The capital of France is"
    cut_params = SamplingParams(temperature=0, max_tokens=24, stop=[cut])
    stopped = llm.generate(prompt, cut_params, use_tqdm=False)[0].outputs[0]
    assert stopped.text == text[: text.find(cut)]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == cut
    keep = SamplingParams(temperature=0, max_tokens=24, stop=[cut], include_stop_str_in_output=True)
    kept = llm.generate(prompt, keep, use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.find(cut) + len(cut)]
    tok_stop = base.token_ids[5]
    by_id_params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[tok_stop])
    by_id = llm.generate(prompt, by_id_params, use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(tok_stop) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tok_stop
    assert by_id.text == llm.get_tokenizer().decode(by_id.token_ids[:-1])  # the stop token's text is left out


def test_eos_and_min_tokens(llm):
    eos = llm.llm_engine.config.model_config.eos_token_ids
    chat = [{"role": "user", "content": "Say hi."}]
    free = llm.chat(chat, SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in eos
    n = len(free.token_ids)
    forced_params = SamplingParams(temperature=0, max_tokens=200, min_tokens=n + 5)
    forced = llm.chat(chat, forced_params, use_tqdm=False)[0].outputs[0]
    assert len(forced.token_ids) >= n + 5
    assert not any(t in eos for t in forced.token_ids[: n + 4])


def test_n_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    texts = [c.text for c in out.outputs]
    assert len(set(texts)) > 1
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == texts  # per-request seeds reproduce
    other = llm.generate("Once upon a time", params.clone(seed=8), use_tqdm=False)[0]
    assert [c.text for c in other.outputs] != texts


def test_logprobs_format(llm):
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate("The sky is", params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    for token, pos in zip(out.token_ids, out.logprobs):
        assert next(iter(pos)) == token  # the sampled token comes first
        assert all(isinstance(lp, Logprob) for lp in pos.values())
        assert pos[token].rank == 1  # greedy
        assert 3 <= len(pos) <= 4
        assert sorted(lp.rank for lp in pos.values()) == [1, 2, 3] or len(pos) == 4
        assert pos[token].decoded_token == llm.get_tokenizer().decode([token])
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


def test_prefix_caching_serves_a_repeated_prefix(llm):
    prefix = "Prefix-cache check: you are a careful assistant. " * 12  # no other test sends it
    prompts = [prefix + "Tell me about cats.", prefix + "Tell me about dogs."]
    first = llm.generate(prompts[0], GREEDY, use_tqdm=False)[0]
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert second[0].num_cached_tokens < len(first.prompt_token_ids)  # never the whole prompt
    assert all(o.num_cached_tokens >= 64 for o in second)
    assert second[0].outputs[0].token_ids == first.outputs[0].token_ids


def test_too_long_prompt_is_rejected_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match=r"1100 tokens.*1024"):
        llm.generate({"prompt_token_ids": [100] * 1100}, GREEDY, use_tqdm=False)
    assert len(llm.generate("Still alive?", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 24


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"top_k": -3}, "top_k"), ({"min_p": 2.0}, "min_p"),
     ({"presence_penalty": 3.0}, "presence_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty")],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_penalties_change_greedy_output(llm):
    base = llm.generate("I like apples. I like apples. I like", GREEDY, use_tqdm=False)[0].outputs[0]
    prompt = "I like apples. I like apples. I like"
    penal = llm.generate(prompt, GREEDY.clone(repetition_penalty=1.8), use_tqdm=False)[0].outputs[0]
    freq_params = GREEDY.clone(frequency_penalty=2.0, presence_penalty=1.0)
    freq = llm.generate(prompt, freq_params, use_tqdm=False)[0].outputs[0]
    assert penal.token_ids != base.token_ids and freq.token_ids != base.token_ids


def test_preemption_under_a_tiny_kv_budget_matches_a_roomy_run(tiny_llama):
    prompts = [f"Story number {i}: once upon a time" for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
    roomy = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=64 << 20)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    block_bytes = roomy.llm_engine.engine_core.executor.driver.kv_bytes_per_block()
    # ~1000 tokens of KV cache:
    tight = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=block_bytes * 64)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert got == expected
    # A seeded request draws the same numbers whether or not it was preempted on the way.
    seeded = [SamplingParams(temperature=1.0, seed=i, max_tokens=160, ignore_eos=True) for i in range(12)]
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, seeded, use_tqdm=False)]
    preemptions = tight.llm_engine.engine_core.scheduler.num_preemptions
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, seeded, use_tqdm=False)]
    assert tight.llm_engine.engine_core.scheduler.num_preemptions > preemptions
    assert got == expected
    pool = tight.llm_engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def test_a_new_request_joins_the_running_batch_at_the_next_step(tiny_llama):
    engine = LLMEngine.from_engine_args(
        __import__("compiled_llm.engine.arg_utils", fromlist=["EngineArgs"]).EngineArgs(
            model=tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20
        )
    )
    engine.add_request("a", "first request", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    scheduler = engine.engine_core.scheduler
    a_done = scheduler.requests["a"].num_output_tokens
    engine.add_request("b", "second request", SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    assert {r.request_id for r in scheduler.running} == {"a", "b"}
    assert scheduler.requests["b"].num_output_tokens == 1  # prefilled and sampled in that very step
    assert scheduler.requests["a"].num_output_tokens == a_done + 1  # a kept decoding in the same batch


def test_priority_scheduling_in_the_offline_api(tiny_llama):
    prompts = [f"prompt number {i}" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    fcfs = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        fcfs.generate(prompts, params, use_tqdm=False, priority=[1, 0, 0, 0])
    expected = [o.outputs[0].token_ids for o in fcfs.generate(prompts, params, use_tqdm=False)]
    # One request at a time: the priorities decide the order they run in, not what they generate.
    prio = LLM(tiny_llama, optimization_level=0, max_model_len=256, kv_cache_memory_bytes=16 << 20,
               max_num_seqs=1, scheduling_policy="priority")
    finished = []
    engine = prio.llm_engine
    for i, (prompt, priority) in enumerate(zip(prompts, [3, 1, 2, 0])):
        engine.add_request(str(i), prompt, params, priority=priority)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.append(out.request_id)
                outputs[out.request_id] = out.outputs[0].token_ids
    assert finished == ["3", "1", "2", "0"]
    assert [outputs[str(i)] for i in range(4)] == expected
    assert [o.outputs[0].token_ids for o in prio.generate(prompts, params, use_tqdm=False, priority=[3, 1, 2, 0])] \
        == expected

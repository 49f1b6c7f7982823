"""The rest of what clients send and read, against the real server: token ids in responses,
cached prompt tokens in usage, usage in every chunk, prompt truncation, chat prefill, the model
route, /tokenize's options, fields nobody implements logged, vLLM's metric families and its
allowed_token_ids."""

from __future__ import annotations

import re

import httpx
import pytest

openai = pytest.importorskip("openai")

TIMEOUT = 600  # generous: CI machines are shared


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_token_ids_in_responses(api_server):
    c = client(api_server)
    prompt_ids = post(api_server, "/tokenize", {"prompt": "The sky is"})["tokens"]
    out = c.completions.create(model="smol", prompt="The sky is", max_tokens=5, temperature=0,
                               extra_body={"return_token_ids": True})
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 5
    assert post(api_server, "/detokenize", {"tokens": choice["token_ids"]})["prompt"] == out.choices[0].text
    chunks = list(c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                            temperature=0, stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] and chunks[1].model_extra.get("prompt_token_ids") is None
    streamed = [t for ch in chunks for t in (ch.choices[0].model_extra.get("token_ids") or [])]
    whole = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                      temperature=0, extra_body={"return_token_ids": True})
    assert streamed == whole.choices[0].model_extra["token_ids"]
    assert whole.model_extra["prompt_token_ids"] == chunks[0].model_extra["prompt_token_ids"]


def test_cached_tokens_and_usage_in_every_chunk(api_server):
    c = client(api_server)
    prompt = "A long shared preamble that the prefix cache can keep. " * 8
    first = c.completions.create(model="smol", prompt=prompt, max_tokens=2)
    again = c.completions.create(model="smol", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16  # at least one full block
    chunks = list(c.completions.create(model="smol", prompt="Count: 1, 2,", max_tokens=5, temperature=0,
                                       stream=True, stream_options={"include_usage": True,
                                                                    "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage is not None for ch in chunks) and counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5


def test_truncate_prompt_tokens(api_server):
    c = client(api_server)
    text = "one two three four five six seven eight nine ten"
    ids = post(api_server, "/tokenize", {"prompt": text})["tokens"]
    cut = c.completions.create(model="smol", prompt=text, max_tokens=4, temperature=0,
                               extra_body={"truncate_prompt_tokens": 3})
    direct = c.completions.create(model="smol", prompt=ids[-3:], max_tokens=4, temperature=0)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == direct.choices[0].text
    chat = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": text}], max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_chat_prefill_continues_the_last_message(api_server):
    c = client(api_server)
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "My favourite fruit is"}]
    rendered = post(api_server, "/tokenize", {"messages": messages, "continue_final_message": True,
                                              "add_generation_prompt": False, "return_token_strs": True})
    fresh = post(api_server, "/tokenize", {"messages": messages[:1]})
    assert rendered["token_strs"][-1] == "Ġis" and rendered["tokens"][: fresh["count"]] == fresh["tokens"]
    out = c.chat.completions.create(model="smol", messages=messages, max_tokens=6, temperature=0,
                                    extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                "return_token_ids": True})
    assert out.model_extra["prompt_token_ids"] == rendered["tokens"]
    echoed = c.chat.completions.create(model="smol", messages=messages, max_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True, "echo": True})
    assert echoed.choices[0].message.content == "My favourite fruit is" + out.choices[0].message.content


def test_model_route_and_tokenize_options(api_server):
    c = client(api_server)
    model = c.models.retrieve("smol")
    assert model.id == "smol" and model.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    tok = post(api_server, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert tok["token_strs"] == ["Hello", "Ġworld"] and tok["count"] == 2
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = post(api_server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "tools": tools,
                                          "add_generation_prompt": False})
    with_prompt = post(api_server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert with_prompt["tokens"][: chat["count"]] == chat["tokens"] and with_prompt["count"] > chat["count"]


def test_unknown_fields_are_logged_and_ignored(api_server):
    out = post(api_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "frobnicate_level": 3})
    assert out["usage"]["completion_tokens"] == 1
    assert "ignored: ['frobnicate_level']" in api_server.read_log()


def _metric_total(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^compiled_llm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def test_vllm_metric_families(api_server):
    before = httpx.get(api_server.url + "/metrics", timeout=TIMEOUT).text
    c = client(api_server)
    c.completions.create(model="smol", prompt="Hello there", max_tokens=3, n=2, extra_body={"ignore_eos": True})
    text = httpx.get(api_server.url + "/metrics", timeout=TIMEOUT).text
    for name in ("iteration_tokens_total", "request_prompt_tokens", "request_generation_tokens",
                 "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "time_per_output_token_seconds",
                 "request_time_per_output_token_seconds", "time_per_prefill_token_request_seconds"):
        assert f"compiled_llm:{name}_bucket{{" in text, name
    # One user request of n=2: n observed once (sum += 2), two samples of 3 tokens each.
    assert _metric_total(text, "request_params_n_sum") - _metric_total(before, "request_params_n_sum") == 2
    generated = _metric_total(text, "request_generation_tokens_sum") - _metric_total(before,
                                                                                      "request_generation_tokens_sum")
    assert generated == 6
    assert _metric_total(text, "request_queue_time_seconds_count") > _metric_total(before,
                                                                                   "request_queue_time_seconds_count")


def test_allowed_token_ids_restrict_what_is_sampled(api_server):
    c = client(api_server)
    allowed = post(api_server, "/tokenize", {"prompt": " yes no maybe"})["tokens"]
    out = c.completions.create(model="smol", prompt="Is the sky blue? Answer:", max_tokens=6, temperature=0,
                               logprobs=1, extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    assert set(out.choices[0].model_extra["token_ids"]) <= set(allowed)
    assert all(lp > float("-inf") for lp in out.choices[0].logprobs.token_logprobs)
    chat = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                     temperature=0.8, seed=1,
                                     extra_body={"allowed_token_ids": allowed[:1], "return_token_ids": True})
    assert set(chat.choices[0].model_extra["token_ids"]) == {allowed[0]}
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        c.completions.create(model="smol", prompt="x", max_tokens=1, extra_body={"allowed_token_ids": [10**9]})
    with pytest.raises(openai.BadRequestError, match="allowed_token_ids"):
        c.completions.create(model="smol", prompt="x", max_tokens=1, extra_body={"allowed_token_ids": []})

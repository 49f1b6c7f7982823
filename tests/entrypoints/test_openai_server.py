"""`compiled-llm serve` as users meet it: a real server process, the official `openai` client.

The bundled SmolLM2 checks what depends on a real model (greedy streams equal to non-streamed
text, stop strings in real text, logprobs); the tiny random model checks the serving machinery
(concurrency, aborts, errors, auth, engine death, shutdown), where the model does not matter.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import psutil
import pytest
from remote_server import RemoteServer

from compiled_llm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

openai = pytest.importorskip("openai")  # absent on the GPU image, where only cuda tests run

ENGINE_FLAGS = ["-O0", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "32"]
# The real model is served compiled, from the compile cache `compiled-llm precompile` filled:
# the start must be warm.
REAL_FLAGS = ["-O1", "--require-cache-hit", *ENGINE_FLAGS[1:]]
TIMEOUT = 60
API_KEY = "test-key"


@pytest.fixture(scope="module")
def real_server(real_model_path, warm_compile_cache):
    server = RemoteServer([real_model_path, *REAL_FLAGS, "--served-model-name", "smol"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_server(tiny_llama):
    server = RemoteServer([tiny_llama, *ENGINE_FLAGS, "--served-model-name", "tiny"], api_key=API_KEY)
    yield server
    server.stop()


def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key or "none", max_retries=0, timeout=TIMEOUT)


def async_client(server: RemoteServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.api_key or "none", max_retries=0,
                              timeout=TIMEOUT)


def metric(server: RemoteServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    match = re.search(rf"^compiled_llm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def wait_until_idle(server: RemoteServer, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(server, "num_requests_running") == 0 and metric(server, "num_requests_waiting") == 0 \
                and metric(server, "kv_cache_usage_perc") == 0:
            return
        time.sleep(0.1)
    raise AssertionError("the engine still holds requests or KV blocks")


# ---- the real model ---------------------------------------------------------------------------
def test_completion_stream_equals_non_stream(real_server):
    c = client(real_server)
    kwargs = dict(model="smol", prompt="The capital of France is", max_tokens=24, temperature=0)
    full = c.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == "smol" and choice.text
    assert full.usage.completion_tokens == 24 or choice.finish_reason == "stop"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_chat_stream_equals_non_stream(real_server):
    c = client(real_server)
    kwargs = dict(model="smol", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24,
                  temperature=0)
    full = c.chat.completions.create(**kwargs)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    assert text
    chunks = list(c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    # max_completion_tokens is the newer spelling of max_tokens.
    short = c.chat.completions.create(model="smol", messages=kwargs["messages"], max_completion_tokens=3,
                                      temperature=0)
    assert short.usage.completion_tokens == 3 and text.startswith(short.choices[0].message.content)


def test_n_and_seed(real_server):
    c = client(real_server)
    kwargs = dict(model="smol", prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3, seed=7,
                  extra_body={"ignore_eos": True})
    first = c.completions.create(**kwargs)
    assert [ch.index for ch in first.choices] == [0, 1, 2]
    assert len({ch.text for ch in first.choices}) > 1  # sampled, different seeds per child
    assert first.usage.completion_tokens == 36
    assert [ch.text for ch in c.completions.create(**kwargs).choices] == [ch.text for ch in first.choices]
    chunks = list(c.completions.create(**kwargs, stream=True))
    streamed = {i: "".join(ch.choices[0].text for ch in chunks if ch.choices[0].index == i) for i in range(3)}
    assert streamed == {ch.index: ch.text for ch in first.choices}
    chat = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=5,
                                     seed=1)
    assert [ch.index for ch in chat.choices] == [0, 1]


def test_completion_logprobs(real_server):
    c = client(real_server)
    out = c.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4 and top[token] == pytest.approx(logprob, abs=1e-6)
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the sampled token is the best
    # logprobs=0 still names the sampled token, and a sampled token below the top k is kept.
    hot = c.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=8, temperature=5.0, seed=1, logprobs=0)
    hot_lp = hot.choices[0].logprobs
    for token, logprob, top in zip(hot_lp.tokens, hot_lp.token_logprobs, hot_lp.top_logprobs):
        assert top == {token: pytest.approx(logprob, abs=1e-6)}


def test_chat_logprobs(real_server):
    c = client(real_server)
    out = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hello."}], max_tokens=5,
                                    temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == out.choices[0].message.content
    for t in content:
        assert t.bytes == list(t.token.encode()) and len(t.top_logprobs) == 2
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob


def test_stop_strings(real_server):
    c = client(real_server)
    kwargs = dict(model="smol", prompt="Here is a list of fruits: apple, banana,", max_tokens=32, temperature=0)
    text = c.completions.create(**kwargs).choices[0].text
    words = re.findall(r"[A-Za-z]{3,}", text)
    assert len(words) >= 2, text
    stop = words[1]
    cut = c.completions.create(**kwargs, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].model_extra["stop_reason"] == stop
    assert cut.usage.completion_tokens < 32
    kept = c.completions.create(**kwargs, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]
    streamed = c.completions.create(**kwargs, stop=[stop], stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut.choices[0].text
    wait_until_idle(real_server)  # the stop string was found here; the engine was told to abort


def test_prompt_forms_and_usage(real_server):
    c = client(real_server)
    ids = httpx.post(real_server.url + "/tokenize", json={"prompt": "The sky is"}, timeout=TIMEOUT).json()["tokens"]
    text = c.completions.create(model="smol", prompt="The sky is", max_tokens=5, temperature=0).choices[0].text
    out = c.completions.create(model="smol", prompt=["The sky is", "Grass is"], max_tokens=5, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1] and out.choices[0].text == text
    assert out.usage.prompt_tokens == len(ids) + c.completions.create(
        model="smol", prompt="Grass is", max_tokens=1).usage.prompt_tokens
    assert out.usage.completion_tokens == 10
    assert c.completions.create(model="smol", prompt=ids, max_tokens=5, temperature=0).choices[0].text == text
    both = c.completions.create(model="smol", prompt=[ids, ids], max_tokens=5, temperature=0)
    assert [ch.text for ch in both.choices] == [text, text] and both.usage.prompt_tokens == 2 * len(ids)


def test_vllm_extras(real_server):
    c = client(real_server)
    out = c.completions.create(model="smol", prompt="Hi", max_tokens=20, temperature=0.8, top_p=0.9, seed=3,
                               presence_penalty=0.5, frequency_penalty=0.5,
                               extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                                           "ignore_eos": True, "min_tokens": 20})
    assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"
    eos = httpx.post(real_server.url + "/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False},
                     timeout=TIMEOUT).json()["tokens"]
    chat = c.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}], max_tokens=40,
                                     temperature=0, extra_body={"stop_token_ids": eos, "skip_special_tokens": True})
    assert chat.choices[0].finish_reason in ("stop", "length")
    # A stop token id ends the completion, is named as the stop reason, and its text is left out.
    base = c.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0).choices[0].text
    ids = httpx.post(real_server.url + "/tokenize", json={"prompt": base, "add_special_tokens": False},
                     timeout=TIMEOUT).json()["tokens"]
    stopped = c.completions.create(model="smol", prompt="1, 2, 3, 4,", max_tokens=6, temperature=0,
                                   extra_body={"stop_token_ids": [ids[2]], "ignore_eos": True})
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == ids[2]
    assert stopped.usage.completion_tokens == 3
    detokenized = httpx.post(real_server.url + "/detokenize", json={"tokens": ids[:2]}, timeout=TIMEOUT)
    assert choice.text == detokenized.json()["prompt"]


def test_models_version_tokenizer_metrics(real_server):
    c = client(real_server)
    models = c.models.list().data
    assert [m.id for m in models] == ["smol"] and models[0].model_extra["max_model_len"] == 1024
    assert httpx.get(real_server.url + "/version", timeout=10).json()["version"]
    tok = httpx.post(real_server.url + "/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    back = httpx.post(real_server.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=10).json()
    assert back["prompt"] == "Hello world"
    chat = httpx.post(real_server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]},
                      timeout=10).json()
    assert chat["count"] > 3
    text = httpx.get(real_server.url + "/metrics", timeout=10).text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_success_total"):
        assert f"compiled_llm:{name}{{" in text, name
    assert metric(real_server, "generation_tokens_total") > 0
    assert metric(real_server, "prefix_cache_hits_total") > 0  # the same prompts were sent again


# ---- the serving machinery (tiny model) -------------------------------------------------------
def test_api_key(tiny_server):
    url = tiny_server.url
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # probes need no key
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(url + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(url + "/v1/models", headers=tiny_server.headers, timeout=10).status_code == 200


def _post(server: RemoteServer, path: str, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=TIMEOUT,
                      headers={**server.headers, "Content-Type": "application/json"})


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
BAD_REQUESTS = [
    ("/v1/completions", "{not json", 400),
    ("/v1/completions", "[1, 2]", 400),
    ("/v1/completions", {"model": "tiny"}, 400),  # no prompt
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400),
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400),
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": "hello"}, 400),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/tokenize", {}, 400),
    ("/tokenize", {"prompt": "hi", "mm_processor_kwargs": {"a": 1}}, 400),
    # logit_bias: token ids as strings, biases in [-100, 100], ids in the vocabulary
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"-5": 1}}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, 400),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, 400),
    # structured outputs: one constraint, valid, by a backend this server has
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "("}}, 400),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "nonsense"}}, 400),
    ("/v1/completions", {"prompt": "hi", "guided_grammar": "root ::= "}, 400),
    ("/v1/completions", {"prompt": "hi", "guided_choice": []}, 400),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, 400),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a"},
                         "response_format": {"type": "json_object"}}, 400),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {}}, 400),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_decoding_backend": "outlines"}, 400),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "structural_tag"}}, 400),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, 400),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "yaml"}}, 400),
    # logprobs within --max-logprobs (-1: the whole vocabulary); prompt logprobs not in streams
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, 400),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, 400),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 2, "stream": True}, 400),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 5000}, 400),
    ("/v1/completions", {"prompt": "hi", "truncate_prompt_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": -1},
     400),
    # tools: tool_choice needs tools, names one of them, auto needs the server's parser
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, "tool_choice": "auto"},
     400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                              "tool_choice": "sometimes"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                              "tool_choice": {"type": "function"}}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "functions": [TOOLS[0]["function"]],
                              "function_call": "required"}, 400),
    # chat prefill: continue the assistant's last message, without a new generation prompt
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True,
                              "add_generation_prompt": True}, 400),
]


@pytest.mark.parametrize("path,body,status", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(tiny_server, path, body, status):
    r = _post(tiny_server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")  # vLLM's names
    assert httpx.get(tiny_server.url + "/health", timeout=10).status_code == 200


# Fields OpenAI or vLLM define that this server does not implement: asking for them is a 400 naming them.
REFUSED = sorted(set(ChatCompletionRequest.REFUSED) | set(CompletionRequest.REFUSED))


@pytest.mark.parametrize("field", REFUSED)
def test_unimplemented_fields_are_refused_by_name(tiny_server, field):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        if field not in (ChatCompletionRequest if "chat" in path else CompletionRequest).REFUSED:
            continue
        r = _post(tiny_server, path, {**body, "max_tokens": 1, field: {"unsupported": 1}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
    # Their no-op values ask for nothing and are served.
    no_op = {"use_beam_search": False, "length_penalty": 1.0, "store": False, "bad_words": []}
    if field in no_op:
        served = _post(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, field: no_op[field]})
        assert served.status_code == 200, served.text


def test_echo_is_served(tiny_server):
    r = _post(tiny_server, "/v1/completions", {"prompt": "hi there", "echo": True, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith("hi there")
    assert r.json()["usage"]["completion_tokens"] == 2
    only = _post(tiny_server, "/v1/completions", {"prompt": "hi there", "echo": True, "max_tokens": 0})
    assert only.status_code == 200 and only.json()["choices"][0]["text"] == "hi there"


def test_too_long_prompt_message_gives_both_lengths(tiny_server):
    count = _post(tiny_server, "/tokenize", {"prompt": "hello " * 1100}).json()["count"]
    r = _post(tiny_server, "/v1/completions", {"prompt": "hello " * 1100})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert f"{count} tokens" in message and "1024 tokens" in message, message
    chat = _post(tiny_server, "/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "hello " * 1100}], "max_tokens": 5})
    assert chat.status_code == 400 and "1024" in chat.json()["error"]["message"]
    # The server keeps serving.
    ok = _post(tiny_server, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_unknown_route_and_method(tiny_server):
    r = httpx.get(tiny_server.url + "/v1/nowhere", headers=tiny_server.headers, timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(tiny_server.url + "/v1/completions", headers=tiny_server.headers, timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_32_concurrent_streams(tiny_server):
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[int, int, int]:
        want = 8 + i % 9
        stream = await c.completions.create(
            model="tiny", prompt=f"Request number {i} says", max_tokens=want, temperature=0.7, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        pieces = 0
        usage = None
        async for chunk in stream:
            if chunk.choices:
                pieces += 1
            usage = chunk.usage or usage
        return want, usage.completion_tokens, pieces

    async def main() -> list[tuple[int, int, int]]:
        c = async_client(tiny_server)
        return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(32))), TIMEOUT * 2)

    results = asyncio.run(main())
    assert len(results) == 32
    for want, got, pieces in results:
        assert got == want and 1 <= pieces <= want
    wait_until_idle(tiny_server)


def test_client_disconnect_aborts(tiny_server):
    body = {"prompt": "Tell me everything", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, headers=tiny_server.headers,
                      timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(5), lines) if line.startswith("data:")) >= 2
        assert metric(tiny_server, "num_requests_running") == 1
        assert metric(tiny_server, "kv_cache_usage_perc") > 0
    wait_until_idle(tiny_server)
    # A non-streaming request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.url + "/v1/completions", headers=tiny_server.headers, timeout=1.5,
                   json={"prompt": "again", "max_tokens": 900, "ignore_eos": True})
    wait_until_idle(tiny_server)
    assert 'finished_reason="abort"' in httpx.get(tiny_server.url + "/metrics", timeout=10).text


def test_sigterm_ends_an_idle_server_and_its_processes_within_3_s(tiny_server):
    """Issue 21: an idle server took 6 s to stop, most of it each process's interpreter tearing
    down its heap (torch and all: seconds of garbage collection); now about 1 s, a client's idle
    keep-alive connection included. The last test of `tiny_server`: it stops it."""
    children = tiny_server.children_alive()
    assert any(p.pid == tiny_server.engine_process().pid for p in children)
    with httpx.Client(base_url=tiny_server.url, headers=tiny_server.headers, timeout=TIMEOUT) as http:
        assert http.get("/v1/models").status_code == 200  # its connection stays open, idle
        started = time.monotonic()
        tiny_server.proc.send_signal(signal.SIGTERM)
        assert tiny_server.wait(timeout=30) == 0
        while tiny_server.children_alive() and time.monotonic() - started < 30:
            time.sleep(0.01)
        elapsed = time.monotonic() - started
    assert tiny_server.children_alive() == []
    assert elapsed < 3, f"the server and its processes took {elapsed:.1f} s to end"


# ---- engine death and shutdown (a server each) ------------------------------------------------
def test_engine_killed_mid_request(tiny_llama):
    server = RemoteServer([tiny_llama, *ENGINE_FLAGS])
    try:
        engine = server.engine_process()
        assert engine.ppid() == server.proc.pid
        body = {"prompt": "Go on", "max_tokens": 900, "ignore_eos": True}

        async def main() -> tuple[list[str], httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as http:
                plain = asyncio.ensure_future(http.post("/v1/completions", json=body))
                events: list[str] = []
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            events.append(line)
                            if len(events) == 3:
                                engine.kill()
                return events, await plain

        events, plain = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][len("data:"):])["error"]
        assert error["code"] == "engine_dead" and "exited unexpectedly" in error["message"]
        assert plain.status_code == 503 and plain.json()["error"]["code"] == "engine_dead"
        try:
            assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        except httpx.TransportError:
            pass  # already gone
        assert server.wait(timeout=20) == 1
        # The render workers and multiprocessing's resource tracker leave once they see the server
        # gone (EOF on their pipes): within moments, not at the same instant.
        gone, alive = psutil.wait_procs(server.children_alive(), timeout=10)
        assert alive == []
    finally:
        server.stop()


@pytest.mark.parametrize("ctrl_c", [False, True], ids=["SIGTERM", "Ctrl-C"])
def test_shutdown_ends_streams_and_leaves_no_process(tiny_llama, ctrl_c):
    server = RemoteServer([tiny_llama, *ENGINE_FLAGS])
    try:
        children = server.children_alive()
        assert any(p.pid == server.engine_process().pid for p in children)
        body = {"prompt": "Go on", "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) == 3:
                        if ctrl_c:  # the terminal sends it to the whole group, the engine included
                            os.killpg(server.proc.pid, signal.SIGINT)
                        else:
                            server.proc.send_signal(signal.SIGTERM)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data:"):])["choices"][0]["finish_reason"] == "abort"
        assert server.wait(timeout=20) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert alive == []
    finally:
        server.stop()


def test_engine_start_failure_is_reported(tiny_llama):
    with pytest.raises(RuntimeError, match="exited with 1") as info:
        RemoteServer([tiny_llama, "-O0", "--kv-cache-memory-bytes", "4096"])
    assert "cannot hold one sequence" in str(info.value)

"""One request must never take the server down: each reproduction of issue 10's findings gets a
clear 4xx (or is served), and the server stays healthy and answers a normal request afterwards.

A fuzz test (Hypothesis) sends request bodies of every shape to both APIs and never sees a 5xx.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from remote_server import RemoteServer

ENGINE_FLAGS = ["-O0", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20), "--max-num-seqs", "32"]
TIMEOUT = 60
INFINITE_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_llama):
    server = RemoteServer([tiny_llama, *ENGINE_FLAGS, "--served-model-name", "tiny"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def permissive_server(tiny_llama):
    """An operator who allows large n and request chat templates."""
    server = RemoteServer([tiny_llama, *ENGINE_FLAGS, "--served-model-name", "tiny", "--max-n", "5000",
                           "--trust-request-chat-template"])
    yield server
    server.stop()


def post(server: RemoteServer, path: str, body, timeout: float = TIMEOUT) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=timeout,
                      headers={**server.headers, "Content-Type": "application/json"})


def assert_still_serving(server: RemoteServer) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    ok = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2, ok.text
    assert server.proc.poll() is None


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    return error


# ---- 1. integers beyond int64 -------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", 2**64 + 1), ("seed", 2**63), ("seed", -(2**63) - 1), ("max_tokens", 2**63),
    ("logprobs", 2**64), ("n", 2**63), ("min_tokens", 2**70), ("best_of", 2**63),
])
def test_integers_beyond_int64_are_a_400(server, field, value):
    body = {"prompt": "Hi", "max_tokens": 2, "temperature": 1, field: value}
    assert_openai_error(post(server, "/v1/completions", body), 400, field)
    assert_still_serving(server)


def test_top_k_of_2_63_reproduction(server):
    raw = '{"prompt":"Hi","max_tokens":2,"temperature":1,"top_k":9223372036854775808}'
    assert_openai_error(post(server, "/v1/completions", raw), 400, "top_k")
    chat = {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**64 + 1, "seed": 2**64}
    assert_openai_error(post(server, "/v1/chat/completions", chat), 400)
    assert_still_serving(server)


def test_int64_extremes_are_served(server):
    """In range is served: a top_k beyond the vocabulary is no top-k, and every int64 seed is a seed."""
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt": "Hi", "max_tokens": 2, "temperature": 1, "top_k": 2**63 - 1, "seed": seed}
        assert post(server, "/v1/completions", body).status_code == 200


# ---- 2. large n ---------------------------------------------------------------------------------
def test_n_over_the_cap_is_a_400(server):
    error = assert_openai_error(post(server, "/v1/completions", {"prompt": "Hi", "n": 2000, "max_tokens": 1}), 400,
                                "128", "--max-n")
    assert error["param"] == "n"
    assert_still_serving(server)


def test_a_burst_of_children_waits_for_room_instead_of_killing_the_engine(permissive_server):
    """2000 children sent back to back fill the engine socket's queue: the sender waits for room."""
    r = post(permissive_server, "/v1/completions", {"prompt": "Hi", "n": 2000, "max_tokens": 1}, timeout=300)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2000 and r.json()["usage"]["completion_tokens"] == 2000
    assert_still_serving(permissive_server)


# ---- 3. request chat templates ------------------------------------------------------------------
def test_request_chat_templates_are_off_by_default(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"}
    error = assert_openai_error(post(server, "/v1/chat/completions", body), 400, "--trust-request-chat-template")
    assert error["param"] == "chat_template"
    tucked = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
    assert_openai_error(post(server, "/v1/chat/completions", tucked), 400, "--trust-request-chat-template")
    assert_still_serving(server)


def test_a_template_that_never_ends_does_not_wedge_the_server(permissive_server):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": INFINITE_TEMPLATE, "max_tokens": 2}

    async def main() -> tuple[httpx.Response, list[float]]:
        async with httpx.AsyncClient(base_url=permissive_server.url, timeout=TIMEOUT) as http:
            stuck = [asyncio.ensure_future(http.post("/v1/chat/completions", json=body))]
            await asyncio.sleep(0.5)
            # Meanwhile other requests keep flowing, chat ones included.
            latencies = []
            for _ in range(3):
                started = time.monotonic()
                ok = await http.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2})
                assert ok.status_code == 200, ok.text
                ok = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert ok.status_code == 200, ok.text
                latencies.append(time.monotonic() - started)
            return (await asyncio.gather(*stuck))[0], latencies

    stuck, latencies = asyncio.run(main())
    assert_openai_error(stuck, 400, "longer than")
    assert max(latencies) < 5, latencies  # the other render worker served them meanwhile
    assert_still_serving(permissive_server)


def test_sigterm_ends_the_server_during_a_stuck_render(tiny_llama):
    server = RemoteServer([tiny_llama, *ENGINE_FLAGS, "--trust-request-chat-template"])
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": INFINITE_TEMPLATE}
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/chat/completions", json=body, timeout=1.0)
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(timeout=20) == 0
    finally:
        server.stop()


# ---- 4. huge bodies and prompts -----------------------------------------------------------------
def test_a_50_mb_prompt_is_refused_at_once_and_stalls_nobody(server):
    huge = json.dumps({"prompt": "word " * 10_000_000, "max_tokens": 1})
    unknown_field = json.dumps({"prompt": "hi", "max_tokens": 1, "padding": "x" * 50_000_000})

    async def main() -> tuple[list[httpx.Response], float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT,
                                     headers={"Content-Type": "application/json"}) as http:
            big = [asyncio.ensure_future(http.post("/v1/completions", content=c)) for c in (huge, unknown_field)]
            started = time.monotonic()
            ok = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200
            return list(await asyncio.gather(*big)), time.monotonic() - started

    started = time.monotonic()
    (too_big, unknown), normal_latency = asyncio.run(main())
    assert time.monotonic() - started < 20
    assert_openai_error(too_big, 413, "--max-request-body-bytes")
    assert_openai_error(unknown, 413)
    assert normal_latency < 10
    assert_still_serving(server)


def test_a_chunked_body_over_the_limit_is_a_413(server):
    def chunks():
        for _ in range(200):
            yield b"x" * (1 << 16)

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=TIMEOUT,
                   headers={"Content-Type": "application/json"})
    assert_openai_error(r, 413)
    assert_still_serving(server)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server):
    """A prompt under the body limit but more bytes than max_model_len tokens can spell."""
    started = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": "a" * 3_000_000, "max_tokens": 1})
    assert_openai_error(r, 400, "bytes long", "1024 tokens")
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a" * 3_000_000}]})
    assert_openai_error(chat, 400, "bytes long")
    tokenize = post(server, "/tokenize", {"prompt": "a" * 3_000_000})
    assert_openai_error(tokenize, 400, "bytes long")
    assert time.monotonic() - started < 15
    assert_still_serving(server)


# ---- 5. strings that are not Unicode ------------------------------------------------------------
@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", '{"prompt": "Hi \\ud800", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": ["ok", "Hi \\udfff"], "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\ud800"], "max_tokens": 2}'),
    ("/v1/completions", '{"model": "\\ud800", "prompt": "Hi"}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user\\udc00", "content": "hi"}]}'),
    ("/tokenize", '{"prompt": "Hi \\ud800"}'),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/detokenize", '{"model": "\\ud800", "tokens": [1]}'),
])
def test_lone_surrogates_are_a_400(server, path, raw):
    error = assert_openai_error(post(server, path, raw), 400, "not valid Unicode")
    assert "\ud800" not in error["message"]
    assert_still_serving(server)


# ---- fuzzing both APIs --------------------------------------------------------------------------
scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                      max_leaves=8)
small_int = st.integers(-3, 4) | st.integers(min_value=-(2**70), max_value=2**70)
# The fields of issue 14 (structured outputs, logit_bias, scoring, tools), mostly well-formed so
# that the engine runs them, with garbage mixed in.
schemas = st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3}, {"type": "nonsense"},
                           {"enum": [1, 2]}, {"type": "array", "items": {"type": "integer"}, "maxItems": 2}]) | values
regexes = st.sampled_from(["a+", "[0-9]{1,3}", "(", "x|y", ".*", ""]) | st.text(max_size=6)
grammars = st.sampled_from(['root ::= "a" | "b"', "root ::= ", "nonsense"]) | st.text(max_size=8)
structured_outputs = st.fixed_dictionaries({}, optional={
    "json": schemas, "regex": regexes, "choice": st.lists(st.text(max_size=4), max_size=3) | values,
    "grammar": grammars, "json_object": st.booleans() | values, "disable_any_whitespace": st.booleans(),
    "whitespace_pattern": values,
}) | values
response_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "structural_tag"]) | values},
    optional={"json_schema": st.fixed_dictionaries({}, optional={"name": st.text(max_size=4), "schema": schemas,
                                                                "strict": st.booleans()}) | values},
) | values
logit_bias = st.dictionaries(st.integers(-3, 60000).map(str) | st.text(max_size=4), st.floats(-150, 150),
                             max_size=3) | values
sampling = {
    "model": st.sampled_from(["tiny", "other"]) | values,
    "logit_bias": logit_bias, "response_format": response_format, "structured_outputs": structured_outputs,
    "guided_json": schemas, "guided_regex": regexes, "guided_grammar": grammars,
    "guided_choice": st.lists(st.text(max_size=4), max_size=3) | values,
    "guided_decoding_backend": st.sampled_from(["xgrammar", "outlines"]) | values,
    "prompt_logprobs": small_int | values, "return_token_ids": st.booleans() | values,
    "truncate_prompt_tokens": small_int | values, "truncation_side": st.sampled_from(["left", "right"]) | values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}) | values,
    "use_beam_search": st.booleans() | values, "return_tokens_as_token_ids": st.booleans() | values,
    "max_tokens": small_int | values, "n": small_int | values, "temperature": st.floats(-1, 3) | values,
    "top_p": st.floats(-0.5, 1.5) | values, "top_k": small_int | values, "min_p": st.floats(-1, 2),
    "seed": small_int, "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=3) | values,
    "stream": st.booleans() | values,
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3), "min_tokens": small_int, "ignore_eos": st.booleans() | values,
    "stop_token_ids": st.lists(small_int, max_size=3) | values,
    "skip_special_tokens": st.booleans() | values, "user": values,
}
completion_bodies = st.fixed_dictionaries({}, optional={
    **sampling,
    "prompt": st.text(max_size=20) | st.lists(st.integers(-5, 60000), max_size=5)
    | st.lists(st.text(max_size=8), max_size=3) | values,
    "logprobs": small_int | values, "echo": st.booleans() | values, "best_of": small_int, "suffix": values,
})
tool_calls = st.lists(st.fixed_dictionaries({"id": st.text(max_size=4), "type": st.just("function"), "function":
                                             st.fixed_dictionaries({"name": st.text(max_size=4),
                                                                    "arguments": st.text(max_size=8) | values})}),
                      max_size=2) | values
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool"]) | values},
                                          optional={"content": st.text(max_size=20) | values, "name": values,
                                                    "tool_calls": tool_calls, "tool_call_id": values}),
                    max_size=3) | values
functions = st.fixed_dictionaries({"name": st.text(min_size=1, max_size=6)},
                                  optional={"parameters": schemas, "description": st.text(max_size=5)}) | values
tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | values, "function": functions}), max_size=2) \
    | values
tool_choice = st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=6)})}) | values
chat_bodies = st.fixed_dictionaries({}, optional={
    **sampling,
    "messages": messages, "logprobs": st.booleans() | values, "top_logprobs": small_int | values,
    "max_completion_tokens": small_int | values, "tools": tools, "tool_choice": tool_choice,
    "parallel_tool_calls": st.booleans() | values, "functions": st.lists(functions, max_size=2) | values,
    "function_call": st.sampled_from(["none", "auto"]) | values, "add_generation_prompt": st.booleans() | values,
    "continue_final_message": st.booleans() | values, "echo": st.booleans() | values,
    "chat_template_kwargs": values, "documents": values,
})


def _never_5xx(server: RemoteServer, path: str, body: dict) -> None:
    for key in ("max_tokens", "max_completion_tokens"):  # keep each served request short
        if isinstance(body.get(key), int) and 5 < body[key] < 10**6:
            body[key] = 5
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        # Without one, a request runs to the end of the context: with n up to 65 samples, or beam
        # search (a step per token for every beam), longer than the client's timeout on a loaded machine.
        body["max_tokens"] = 5
    r = post(server, path, body)
    assert r.status_code < 500, (body, r.status_code, r.text[:500])
    if r.status_code != 200:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=completion_bodies)
def test_fuzzed_completion_bodies_never_get_a_5xx(server, body):
    _never_5xx(server, "/v1/completions", body)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=chat_bodies)
def test_fuzzed_chat_bodies_never_get_a_5xx(server, body):
    _never_5xx(server, "/v1/chat/completions", body)


def test_still_healthy_after_the_fuzzing(server):
    assert_still_serving(server)

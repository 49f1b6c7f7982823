"""Server flags vLLM users pass and what they change, against a real server (a tiny random model:
nothing here depends on what the model says): `--chat-template` with the content format it reads,
GET /tokenizer_info, GET /load, SageMaker's POST /invocations and /ping, and
`--enable-force-include-usage` and `--return-tokens-as-token-ids` (on their own server, as they
change every response)."""

from __future__ import annotations

import time

import httpx
import pytest
from conftest import TINY_CHAT_TEMPLATE as TEMPLATE
from remote_server import RemoteServer

openai = pytest.importorskip("openai")

TIMEOUT = 120
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_api_server):
    return tiny_api_server


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def tokenize(server, body: dict) -> list[int]:
    r = httpx.post(server.url + "/tokenize", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_chat_template_flag_renders_every_chat(server):
    out = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body={"return_prompt_text": True})
    expected = "<|im_start|>user\n[text]Hi<|im_end|>\n<|im_start|>assistant\n"
    assert out.model_extra["prompt_text"] == expected
    # /tokenize renders with the same template; the template's kwargs reach it.
    assert tokenize(server, {"messages": MESSAGES}) == tokenize(server, {"prompt": expected,
                                                                          "add_special_tokens": False})
    no_thinking = client(server).chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1,
        extra_body={"return_prompt_text": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert no_thinking.model_extra["prompt_text"] == expected + "<think>\n\n</think>\n\n"


def test_tokenizer_info(server):
    r = httpx.get(server.url + "/tokenizer_info", timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] and info["chat_template"] == TEMPLATE  # the template the server renders with
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] >= 512
    added = info["added_tokens_decoder"]
    assert added["2"] == {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                          "single_word": False, "special": True}
    assert all(k.isdigit() and isinstance(v["special"], bool) for k, v in added.items())


def test_server_load_counts_requests_in_progress(server):
    def load() -> int:
        return httpx.get(server.url + "/load", timeout=TIMEOUT).json()["server_load"]

    def settles_at_zero() -> bool:
        """The count drops once the server has sent a response's last byte, which its client may
        read a moment before that."""
        deadline = time.monotonic() + 10
        while load() != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        return load() == 0

    assert settles_at_zero()
    # 400 tokens take the tiny model seconds: the stream is still in progress after its first event.
    stream = client(server).completions.create(model="tiny", prompt="Once", max_tokens=400, stream=True,
                                               extra_body={"ignore_eos": True})
    next(iter(stream))
    assert load() == 1
    assert len(list(stream)) > 0
    assert settles_at_zero()
    client(server).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert settles_at_zero()


def test_invocations_dispatches_by_body(server):
    def invoke(body: object) -> httpx.Response:
        return httpx.post(server.url + "/invocations", json=body, timeout=TIMEOUT)

    chat = invoke({"messages": MESSAGES, "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = invoke({"prompt": "Once", "max_tokens": 3})
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    streamed = invoke({"prompt": "Once", "max_tokens": 3, "stream": True})
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    for body in ({"input": "embed me"}, [1, 2]):
        refused = invoke(body)
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == ("Cannot find suitable handler for request. Expected one of: "
                                                      "[ChatCompletionRequest, CompletionRequest]")
    bad_json = httpx.post(server.url + "/invocations", content=b"{", timeout=TIMEOUT)
    assert bad_json.status_code == 400 and "JSON decode error" in bad_json.json()["error"]["message"]
    assert httpx.get(server.url + "/ping", timeout=TIMEOUT).status_code == 200
    assert httpx.post(server.url + "/ping", timeout=TIMEOUT).status_code == 200


@pytest.fixture(scope="module")
def force_usage_server(tiny_llama, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    server = RemoteServer([tiny_llama, "-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
                           "--served-model-name", "tiny", "--chat-template", str(template),
                           "--enable-force-include-usage", "--return-tokens-as-token-ids"])
    yield server
    server.stop()


def test_force_include_usage_puts_usage_in_every_chunk(force_usage_server):
    """vLLM's --enable-force-include-usage: streams that asked for no usage carry it in every chunk
    (running totals), and end with a usage-only chunk, as with include_usage + continuous_usage_stats."""
    c = client(force_usage_server)
    chat = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, stream=True,
                                          extra_body={"ignore_eos": True}))
    text = list(c.completions.create(model="tiny", prompt="Once", max_tokens=4, stream=True,
                                     extra_body={"ignore_eos": True}))
    for chunks in (chat, text):
        assert all(chunk.usage is not None for chunk in chunks)
        assert all(ch.usage.total_tokens == ch.usage.prompt_tokens + ch.usage.completion_tokens for ch in chunks)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        counts = [chunk.usage.completion_tokens for chunk in chunks]
        assert counts == sorted(counts) and counts[0] < 4
    plain = c.completions.create(model="tiny", prompt="Once", max_tokens=2)
    assert plain.usage.completion_tokens == 2


def test_return_tokens_as_token_ids_flag_is_each_requests_default(force_usage_server):
    c = client(force_usage_server)
    out = c.completions.create(model="tiny", prompt="Once", max_tokens=3, logprobs=1,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in out.choices[0].token_ids]
    chat = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, logprobs=True,
                                     extra_body={"ignore_eos": True})
    assert all(entry.token.startswith("token_id:") for entry in chat.choices[0].logprobs.content)
    own = c.completions.create(model="tiny", prompt="Once", max_tokens=3, logprobs=1,
                               extra_body={"ignore_eos": True, "return_tokens_as_token_ids": False})
    assert not any(token.startswith("token_id:") for token in own.choices[0].logprobs.tokens)


@pytest.fixture(scope="module")
def limited_server(tiny_llama):
    server = RemoteServer([tiny_llama, "-O0", "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
                           "--served-model-name", "tiny", "--max-num-queued-reqs", "1",
                           "--metrics-namespace", "vllm"])
    yield server
    server.stop()


def test_a_request_over_the_queue_limit_is_a_503_and_counted(limited_server):
    """vLLM's --max-num-queued-reqs: past the limit a request is refused at once with a 503 in
    OpenAI's shape (a status the openai client retries), counted by reason, under vLLM's metric
    names with --metrics-namespace vllm; once the request in flight ends, requests are admitted."""
    c = client(limited_server)
    stream = c.completions.create(model="tiny", prompt="Once", max_tokens=400, stream=True,
                                  extra_body={"ignore_eos": True})
    next(iter(stream))  # in flight
    with pytest.raises(openai.InternalServerError) as refused:
        c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert refused.value.status_code == 503
    error = refused.value.body
    assert error["code"] == "max_num_queued_reqs" and error["message"].startswith("The engine is currently busy")
    metrics = httpx.get(limited_server.url + "/metrics", timeout=TIMEOUT).text
    assert 'vllm:admission_rejections_total{model_name="tiny",reason="max_num_queued_reqs"} 1.0' in metrics
    assert "vllm:num_requests_running" in metrics and "compiled_llm:" not in metrics
    stream.close()  # the server aborts it on the disconnect
    deadline = time.monotonic() + 30
    while True:
        try:
            out = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
            break
        except openai.InternalServerError:
            assert time.monotonic() < deadline, "the aborted request's place was never freed"
            time.sleep(0.05)
    assert out.usage.completion_tokens <= 2

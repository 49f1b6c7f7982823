"""Where clients and vLLM's own tests match vLLM's exact behaviour: usage without
prompt_tokens_details unless --enable-prompt-tokens-details, streamed chat chunks that carry
`token_ids` and `prompt_token_ids` only where they have them, and error messages and types that
name what vLLM's name (pydantic's error type, every bad logit_bias key, the empty prompt, an id out
of vocabulary)."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

TIMEOUT = 300


@pytest.fixture(scope="module")
def client(tiny_api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_api_server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def bad_request(call, **kwargs) -> str:
    with pytest.raises(openai.BadRequestError) as info:
        call(model="tiny", **kwargs)
    assert info.value.status_code == 400 and info.value.type == "BadRequestError"
    return str(info.value)


def test_usage_has_no_prompt_tokens_details_by_default(client):
    usage = client.completions.create(model="tiny", prompt="Hello", max_tokens=2).usage
    assert usage.prompt_tokens_details is None and usage.total_tokens == usage.prompt_tokens + 2


def test_streamed_chat_token_ids_only_where_carried(client):
    messages = [{"role": "user", "content": "Repeat after me: I love cats 🐱"}]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True}))
    dumps = [chunk.model_dump() for chunk in chunks]
    assert isinstance(dumps[0]["prompt_token_ids"], list) and dumps[0]["prompt_token_ids"]
    assert all("prompt_token_ids" not in d for d in dumps[1:])
    streamed = []
    for d in dumps:
        for choice in d["choices"]:
            if "token_ids" in choice:  # as vLLM's test collects them
                streamed.extend(choice["token_ids"])
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    assert streamed == whole.choices[0].token_ids and len(streamed) == 12


def test_validation_errors_name_pydantics_type(client):
    message = bad_request(client.completions.create, prompt="x", max_tokens=1, seed=2**63)
    assert "less_than_equal" in message and f"input_value={2**63}" in message
    assert "greater_than_equal" in bad_request(client.completions.create, prompt="x", max_tokens=1, seed=-2**63 - 1)


def test_every_bad_logit_bias_key_is_named(client):
    message = bad_request(client.chat.completions.create, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                          logit_bias={"bad1": 50.0, "bad2": 20.0})
    assert "bad1" in message and "bad2" in message and "logit_bias" in message
    message = bad_request(client.chat.completions.create, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                          logit_bias={"1000001": 1.0, "1000002": 1.0})
    assert "1000001" in message and "1000002" in message and "out of vocabulary" in message


def test_empty_and_out_of_vocabulary_prompts(client):
    empty = "Either prompt or prompt_embeds must be provided and non-empty."
    assert empty in bad_request(client.completions.create, prompt="", max_tokens=1)
    assert empty in bad_request(client.completions.create, prompt=[], max_tokens=1)
    assert empty in bad_request(client.completions.create, prompt=None, max_tokens=1,
                                extra_body={"prompt_embeds": []})
    assert "out of vocabulary" in bad_request(client.completions.create, prompt=[10**7], max_tokens=1)


def test_unknown_model_is_vllms_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert info.value.type == "NotFoundError"


def test_logprob_token_ids_return_the_chosen_ids(client):
    """vLLM's logprob_token_ids: the logprobs of these ids in place of the top ones (and of the
    sampled token, where it is not one of them), equal to what the top 20 give for the same ids."""
    def top_logprobs(**extra) -> list[dict[int, float]]:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=3, temperature=0,
            logprobs=True, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True, **extra})
        return [{int(t.token.removeprefix("token_id:")): t.logprob for t in step.top_logprobs}
                for step in reply.choices[0].logprobs.content]

    top = top_logprobs(top_logprobs=20)
    chosen = sorted(top[0])[:3]  # three of the first step's top 20
    picked = top_logprobs(logprob_token_ids=chosen)  # top_logprobs left out: every chosen id
    greedy = max(top[0], key=top[0].get)  # the first step's token
    assert sorted(picked[0]) == sorted({*chosen, greedy}) and all(set(chosen) <= set(step) for step in picked)
    assert all(len(step) <= len(chosen) + 1 for step in picked)
    assert all(abs(picked[0][t] - top[0][t]) < 1e-4 for t in picked[0])
    assert all(lp <= 0 for step in picked for lp in step.values())
    message = bad_request(client.chat.completions.create, messages=[{"role": "user", "content": "x"}],
                          max_tokens=1, logprobs=True, extra_body={"logprob_token_ids": [10**7]})
    assert "out of vocabulary" in message


def test_chat_response_carries_vllms_null_fields(client, tiny_api_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    data = httpx.post(tiny_api_server.url + "/v1/chat/completions", json=body, timeout=TIMEOUT).json()
    assert data["service_tier"] is None and data["system_fingerprint"] is None
    message = data["choices"][0]["message"]
    assert {k: message[k] for k in ("refusal", "annotations", "audio", "function_call")} == dict.fromkeys(
        ("refusal", "annotations", "audio", "function_call"))
    assert "tool_calls" not in message  # vLLM leaves out an empty list
    invoked = httpx.post(tiny_api_server.url + "/invocations", json=body, timeout=TIMEOUT).json()
    assert invoked.keys() == data.keys() and invoked["choices"][0]["message"].keys() == message.keys()

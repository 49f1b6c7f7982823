"""Issue 21, finding 3: a field of the wrong type is a 4xx, never a 500.

`best_of` on chat was not a chat field: pydantic kept the client's raw JSON aside, and the n/best_of
cap compared that list with an int (a 500). Every field of both request models is now typed, and
nothing reads an undeclared one. The sweep below replaces one field of a small valid request at a
time (every field of both models, taken from `model_fields`, so a new field is covered as soon as it
is declared) by values of every JSON type: strings, lists, objects, booleans, null, integers far
beyond int64 either way, floats, and NaN/Infinity as the raw tokens Python's JSON parser accepts.
It sees only 2xx and 4xx in OpenAI's error shape, and the server serves normally afterwards.
"""

from __future__ import annotations

import json
import math
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from compiled_llm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

TIMEOUT = 120
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MODELS = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}
BASES = {
    COMPLETIONS: {"prompt": "Hi", "max_tokens": 1},
    CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
}
# The fields that set how long the reply may be (null: up to the context). Their base request
# forces a first token that stops it, so that whatever value they take is served at once.
LENGTH_FIELDS = {COMPLETIONS: {"max_tokens"}, CHAT: {"max_tokens", "max_completion_tokens"}}
STOP_AT_ONCE = {"logit_bias": {"42": 100}, "stop_token_ids": [42]}
# A field the API does not declare is only logged: its base request is refused by the last check
# before the engine (a reply longer than the context), so that every check before meets the field
# but the engine does not run for it.
REFUSED_LATE = {"max_tokens": 10**6}
ERROR_KEYS = {"message", "type", "param", "code"}


# Every field of both request models, as a client spells it, sent to both APIs: a field only the
# other API serves (best_of on chat, before it was declared there) is where an untyped read hides.
ALL_FIELDS = list(dict.fromkeys(info.alias or name for model in MODELS.values()
                                for name, info in model.model_fields.items()))
FIELDS = {path: ALL_FIELDS for path in MODELS}


_client = httpx.Client(timeout=TIMEOUT, limits=httpx.Limits(max_connections=32))  # kept alive: no connect per post


def post(server, path: str, body) -> httpx.Response:
    # json.dumps writes NaN and Infinity as the bare tokens (not JSON, but Python's parser takes them).
    content = body if isinstance(body, str) else json.dumps(body)
    return _client.post(server.url + path, content=content,
                        headers={**server.headers, "Content-Type": "application/json"})


def assert_openai_error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "BadRequestError", error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]
    return error


# ---- the exact reproduction ---------------------------------------------------------------------
def test_best_of_of_the_wrong_type_on_chat_is_a_400(api_server):
    raw = '{"messages":[{"role":"user","content":"x"}],"max_tokens":3,"best_of":["a","b"]}'
    assert_openai_error(post(api_server, CHAT, raw), 400, "best_of", "best_of")


def test_best_of_on_chat_is_typed_and_refused_as_on_completions(api_server):
    """Chat declares best_of as completions does: n's value is served, another is refused."""
    for path, base in BASES.items():
        assert post(api_server, path, {**base, "best_of": 1}).status_code == 200
        assert_openai_error(post(api_server, path, {**base, "best_of": 2}), 400, None, "best_of other than n")
        assert_openai_error(post(api_server, path, {**base, "best_of": 2**64}), 400, "best_of")


@pytest.mark.parametrize("path,field,raw,param", [
    (COMPLETIONS, "temperature", "NaN", "temperature"),
    (CHAT, "top_p", "Infinity", "top_p"),
    (CHAT, "repetition_penalty", "-Infinity", "repetition_penalty"),
    (COMPLETIONS, "temperature", "1e39", "temperature"),  # infinity in the sampler's float32
    (COMPLETIONS, "logit_bias", '{"\\u00b2": 1}', "logit_bias"),  # "²".isdigit(), but not an int
    (CHAT, "logit_bias", '{"5": NaN}', "logit_bias.5"),
    # a schema goes to the engine core, whose wire format (msgspec) holds 64-bit integers only
    (COMPLETIONS, "guided_json", '{"LPT1": {"a": -118059162071741130342400}}', "guided_json"),
    (CHAT, "response_format", '{"type": "json_schema", "json_schema": {"schema": {"maxLength": 18446744073709551616}}}',
     "response_format.json_schema.schema"),
    (CHAT, "tools", '[{"type": "function", "function": {"name": "f", "parameters": {"x": [NaN]}}}]',
     "tools.0.function.parameters"),
    (CHAT, "chat_template_kwargs", '{"messages": []}', "chat_template_kwargs"),
    (CHAT, "chat_template_kwargs", '{"add_generation_prompt": 1}', "chat_template_kwargs"),
    (CHAT, "chat_template_kwargs", '{"chat_template": 3}', "chat_template"),  # not the server's to take
])
def test_absurd_values_are_a_400(api_server, path, field, raw, param):
    base = json.dumps(BASES[path])
    assert_openai_error(post(api_server, path, f'{base[:-1]}, "{field}": {raw}}}'), 400, param)


def test_chat_template_kwargs_may_set_the_generation_prompt(api_server):
    """As in vLLM, chat_template_kwargs' add_generation_prompt is the generation prompt's switch."""
    messages = [{"role": "user", "content": "Hi"}]
    on = post(api_server, "/tokenize", {"messages": messages}).json()["count"]
    off = post(api_server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["count"]
    r = post(api_server, CHAT, {**BASES[CHAT], "chat_template_kwargs": {"add_generation_prompt": False}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == off < on


def test_undeclared_fields_are_never_read_as_attributes():
    """pydantic would hand out an undeclared field's raw JSON as an attribute: it is kept aside only."""
    request = ChatCompletionRequest.model_validate({"messages": [], "frobnicate": ["a"], "bad_words": ["b"]})
    assert getattr(request, "frobnicate", None) is None and request.model_extra["frobnicate"] == ["a"]
    with pytest.raises(AttributeError, match="not declared"):
        request.bad_words  # noqa: B018
    assert request.refused_field() == "bad_words" and request.ignored_fields() == ["frobnicate"]


# ---- every field, every JSON type ----------------------------------------------------------------
# Seeded draws, not Hypothesis: one value of each JSON type for each of ~65 fields is ~650 recursive
# draws an example, and Hypothesis took 20 s to generate two examples (and more to replay them)
# where this takes milliseconds; the values are of the same kinds, and fixed by the seed.
def json_value(rng: random.Random, depth: int = 0):
    """Any JSON value (NaN and the infinities included), nested up to two levels."""
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-(2**70), 2**70)
    if kind == 3:
        return rng.choice([rng.uniform(-1e6, 1e6), math.nan, math.inf, -math.inf, 1e308, -0.0])
    if kind == 4:
        return text(rng, 6)
    if kind == 5:
        return [json_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {text(rng, 6): json_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def text(rng: random.Random, longest: int) -> str:
    alphabet = "ab xyz09_-{}[]\"\\\u00e9\u00b2\u4e2d\U0001f600\x00\n"
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(longest + 1)))


def one_of_each_type(rng: random.Random) -> list:
    """A string, a list, an object, a boolean, null, integers beyond int64 and int32 either way,
    a small integer, a finite float and one of NaN and the infinities."""
    return [
        text(rng, 12),
        [json_value(rng, 1) for _ in range(rng.randrange(4))],
        {text(rng, 8): json_value(rng, 1) for _ in range(rng.randrange(4))},
        rng.random() < 0.5,
        None,
        rng.choice([rng.randint(2**63, 2**80), rng.randint(2**31, 2**63 - 1)]),
        rng.choice([rng.randint(-(2**80), -(2**63) - 1), rng.randint(-(2**63), -1)]),
        rng.randint(-2, 40),
        rng.uniform(-1e9, 1e9),
        rng.choice([math.nan, math.inf, -math.inf]),
    ]


# What every field meets besides the drawn values: the reproduction's shape and the absurd.
FIXED_VALUES = ["auto", ["a", "b"], [1, 2**70], {"a": [1]}, {"5": math.nan}, True, None, 2**64 + 1, -(2**63) - 1,
                -1, 1e308, 1e-320, math.nan, -math.inf]


@pytest.fixture(scope="module")
def bases(api_server) -> dict[str, dict[str, dict]]:
    """The base request of each field: BASES, for LENGTH_FIELDS one that stops at its first token,
    for a field of the other API only one refused late."""
    result: dict[str, dict[str, dict]] = {}
    for path, model in MODELS.items():
        r = post(api_server, path, {**BASES[path], **STOP_AT_ONCE, "max_tokens": None})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
        assert_openai_error(post(api_server, path, {**BASES[path], **REFUSED_LATE}), 400, "max_tokens", "context")
        declared = {info.alias or name for name, info in model.model_fields.items()}
        result[path] = {field: {**BASES[path], **STOP_AT_ONCE} if field in LENGTH_FIELDS[path]
                        else BASES[path] if field in declared else {**BASES[path], **REFUSED_LATE}
                        for field in FIELDS[path]}
    return result


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(32) as pool:
        yield pool


def post_all(server, pool, path: str, bodies: list) -> list[httpx.Response]:
    """At once: the engine serves the accepted ones in a batch instead of one step each."""
    return list(pool.map(lambda body: post(server, path, body), bodies))


def server_error_in(response: httpx.Response) -> str | None:
    """What is wrong with a response to a request the server may refuse: None if nothing."""
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        error = response.json().get("error")
        if not isinstance(error, dict) or set(error) != ERROR_KEYS or not isinstance(error["message"], str):
            return f"{response.status_code} not in OpenAI's error shape: {response.text[:300]}"
    elif (response.headers.get("content-type", "").startswith("text/event-stream")
          and "InternalServerError" in response.text):
        return f"a stream that ended in a server error: {response.text[-300:]}"
    return None


def post_one_field_at_a_time(server, pool, bases, path: str, values: dict[str, list]) -> None:
    """Each value of each field in the base request (that one field replaced), all at once so that
    the engine serves the accepted ones in batches: only 2xx, and 4xx in OpenAI's shape."""
    cases = [(field, value) for field, field_values in values.items()
             for value in {json.dumps(v): v for v in field_values}.values()]
    bodies = [{**bases[path][field], field: value} for field, value in cases]
    responses = post_all(server, pool, path, bodies)
    problems = [(field, value, problem) for (field, value), response in zip(cases, responses)
                if (problem := server_error_in(response))]
    assert not problems, problems[:20]


@pytest.mark.parametrize("path", MODELS, ids=["completions", "chat"])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_field_with_every_json_type_is_never_a_5xx(api_server, bases, pool, path, seed):
    rng = random.Random(f"{path} {seed}")
    post_one_field_at_a_time(api_server, pool, bases, path, {field: one_of_each_type(rng) for field in FIELDS[path]})


@pytest.mark.parametrize("path", MODELS, ids=["completions", "chat"])
def test_every_field_with_the_reproductions_shape_and_absurd_values(api_server, bases, pool, path):
    post_one_field_at_a_time(api_server, pool, bases, path, {field: FIXED_VALUES for field in FIELDS[path]})


def test_fields_refused_by_name_are_a_400_whatever_their_type(api_server, pool):
    """The fields OpenAI or vLLM define that this server does not implement are never read, only
    compared with their no-op values: anything else, of any type, is a 400 naming them."""
    for path, model in MODELS.items():
        cases = [(name, value) for name in sorted(model.REFUSED)
                 for value in (["a", "b"], {"x": math.nan}, 2**70, -math.inf, "x", 0.5)]
        responses = post_all(api_server, pool, path, [{**BASES[path], name: value} for name, value in cases])
        for (name, value), response in zip(cases, responses):
            assert response.status_code == 400, (name, value, response.text)
            assert response.json()["error"]["param"] == name, (name, value, response.text)


def test_still_serving_after_the_sweep(api_server):
    assert httpx.get(api_server.url + "/health", timeout=10).status_code == 200
    r = post(api_server, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    r = post(api_server, CHAT, {**BASES[CHAT], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text

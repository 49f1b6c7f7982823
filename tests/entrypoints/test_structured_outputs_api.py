"""Structured outputs and logit_bias through the OpenAI API, with the official client against the
real server and model: every constrained output parses and validates, streamed or not, whichever
spelling asked for it (`response_format`, vLLM's `structured_outputs`, the older `guided_*`)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any, Literal

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

TIMEOUT = 600  # generous: CI machines are shared
QUESTION = "Describe the city of Paris."

# Bounded schemas: a 135M model writes an unbounded integer or string until max_tokens otherwise.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 100000000}},
     "required": ["name", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"type": "boolean"},
                                      "confidence": {"type": "string", "enum": ["low", "medium", "high"]}},
     "required": ["answer", "confidence"]},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "rainy"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": 0, "maximum": 10}},
     "required": ["city", "tags", "score"]},
]
REGEXES = [r"\d{3}-\d{4}", r"(yes|no), because [a-z ]{3,20}\.", r"[A-Z][a-z]{2,8} is [a-z]{2,10}"]
CHOICES = [["red", "green", "blue"], ["Paris", "London", "Rome"], ["yes", "no", "maybe"]]
GRAMMAR = 'root ::= "The answer is " ("yes" | "no") "."'


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def _json_checker(schema: dict[str, Any]):
    def check(text: str) -> None:
        jsonschema.validate(json.loads(text), schema)
    return check


def _regex_checker(pattern: str):
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), (pattern, text)
    return check


def _choice_checker(choices: list[str]):
    def check(text: str) -> None:
        assert text in choices, (choices, text)
    return check


def _cases() -> list[tuple[str, dict[str, Any], Any]]:
    """(api, request kwargs, check): each constraint once, the spellings, both APIs, greedy and
    sampled, streamed and not spread over them."""
    spellings = [
        lambda schema, i: ("chat", {"response_format": {"type": "json_schema", "json_schema": {
            "name": f"schema{i}", "schema": schema, "strict": True}}}),
        lambda schema, i: ("completions", {"extra_body": {"structured_outputs": {"json": schema}}}),
        lambda schema, i: ("chat", {"extra_body": {"guided_json": schema}}),
    ]
    cases: list[tuple[str, dict[str, Any], Any]] = []
    for i, schema in enumerate(SCHEMAS):
        api, kwargs = spellings[i % len(spellings)](schema, i)
        kwargs.update(stream=i % 2 == 1, temperature=0.7 if i % 2 else 0.0, seed=i)
        cases.append((api, kwargs, _json_checker(schema)))
    # Any object: the question asks for a short one (free JSON from a small model can ramble on).
    cases.append(("chat", {"response_format": {"type": "json_object"}, "stream": True,
                           "question": "Reply with a JSON object with the key answer: is the sky blue?"},
                  lambda text: json.loads(text)))
    for i, pattern in enumerate(REGEXES):
        api, field = [("completions", "structured_outputs"), ("chat", "guided_regex")][i % 2]
        body = {"structured_outputs": {"regex": pattern}} if field == "structured_outputs" else {field: pattern}
        cases.append((api, {"extra_body": body, "temperature": 1.0, "seed": i, "stream": i == 2, "max_tokens": 30},
                      _regex_checker(pattern)))
    for i, choices in enumerate(CHOICES):
        api, field = [("completions", "guided_choice"), ("chat", "structured_outputs")][i % 2]
        body = {"structured_outputs": {"choice": choices}} if field == "structured_outputs" else {field: choices}
        cases.append((api, {"extra_body": body, "temperature": 1.0, "seed": i, "stream": i == 0, "max_tokens": 10},
                      _choice_checker(choices)))
    grammar_check = _regex_checker(r"The answer is (yes|no)\.")
    cases.append(("completions", {"extra_body": {"structured_outputs": {"grammar": GRAMMAR}}, "max_tokens": 20},
                  grammar_check))
    cases.append(("chat", {"extra_body": {"guided_grammar": GRAMMAR}, "stream": True, "max_tokens": 20},
                  grammar_check))
    return cases


async def _run(c: openai.AsyncOpenAI, api: str, kwargs: dict[str, Any]) -> tuple[str, str | None]:
    kwargs = {"model": "smol", "max_tokens": 100, "temperature": 0, **kwargs}
    question = kwargs.pop("question", QUESTION)
    stream = kwargs.get("stream", False)
    if api == "chat":
        out = await c.chat.completions.create(messages=[{"role": "user", "content": question}], **kwargs)
        if not stream:
            return out.choices[0].message.content, out.choices[0].finish_reason
        text, reason = "", None
        async for chunk in out:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason
    out = await c.completions.create(prompt=f"{question} Answer:", **kwargs)
    if not stream:
        return out.choices[0].text, out.choices[0].finish_reason
    chunks = [chunk async for chunk in out]
    return "".join(ch.choices[0].text for ch in chunks), chunks[-1].choices[0].finish_reason


def test_constrained_outputs_parse_and_validate(api_server):
    cases = _cases()

    async def main() -> list[tuple[str, str | None]]:
        c = async_client(api_server)
        return await asyncio.gather(*(_run(c, api, kwargs) for api, kwargs, _ in cases))

    results = asyncio.run(main())
    for (api, kwargs, check), (text, reason) in zip(cases, results):
        assert reason == "stop", (api, kwargs, text)  # the grammar ended the output, not max_tokens
        check(text)


class City(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(max_length=20)]
    population: Annotated[int, pydantic.Field(ge=0, le=100_000_000)]
    size: Literal["small", "big"]


def test_sdk_parse_with_a_pydantic_model(api_server):
    c = client(api_server)
    out = c.chat.completions.parse(model="smol", messages=[{"role": "user", "content": QUESTION}],
                                   response_format=City, max_tokens=100, temperature=0)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed == City.model_validate_json(out.choices[0].message.content)


def _token_id(server, text: str) -> int:
    import httpx

    ids = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30).json()
    assert len(ids["tokens"]) == 1, ids
    return ids["tokens"][0]


def test_logit_bias_forces_and_bans_tokens(api_server):
    c = client(api_server)
    banana = _token_id(api_server, " banana")
    kwargs = dict(model="smol", prompt="My favourite colour is", max_tokens=6, extra_body={"return_token_ids": True})
    for temperature in (0.0, 1.0):
        forced = c.completions.create(**kwargs, temperature=temperature, seed=1, logit_bias={str(banana): 100})
        assert forced.choices[0].model_extra["token_ids"] == [banana] * 6
    base = c.completions.create(**kwargs, temperature=0).choices[0].model_extra["token_ids"]

    async def both() -> list:
        ac = async_client(api_server)
        return await asyncio.gather(
            ac.completions.create(**kwargs, temperature=0, logit_bias={str(t): -100 for t in set(base)}),
            ac.completions.create(**kwargs, temperature=0),  # in the same batch, unbiased
        )

    banned, unbiased = asyncio.run(both())
    banned_ids = banned.choices[0].model_extra["token_ids"]
    assert not set(banned_ids) & set(base), (base, banned_ids)
    assert unbiased.choices[0].model_extra["token_ids"] == base  # one request's bias is its own

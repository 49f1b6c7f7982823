"""Tool calling through the OpenAI API with the official client, against the real server and
model: `required` and a named function always give calls whose arguments parse and validate
against the function's schema (the output is constrained), `auto` parses the model's text with
the server's Hermes parser (here a crafted text: the model is made to write it with a regex),
streamed in OpenAI's shape (id, type and name first, then the arguments in pieces)."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TIMEOUT = 600  # generous: CI machines are shared
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
       "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 plus 3?"}]


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


async def _create(c: openai.AsyncOpenAI, **kwargs: Any) -> dict[str, Any]:
    """One choice's message as a dict, and its finish reason, whether streamed or not (a stream's
    tool-call deltas put together as a client does)."""
    kwargs = {"model": "smol", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 80, "temperature": 0, **kwargs}
    if not kwargs.get("stream"):
        out = await c.chat.completions.create(**kwargs)
        message = out.choices[0].message
        calls = [{"id": t.id, "name": t.function.name, "arguments": t.function.arguments}
                 for t in message.tool_calls or []]
        return {"content": message.content, "calls": calls, "finish_reason": out.choices[0].finish_reason}
    content, calls, reason = "", [], None
    async for chunk in await c.chat.completions.create(**kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        reason = choice.finish_reason or reason
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: id, type and name
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": delta.function.arguments})
            else:
                assert delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
    return {"content": content or None, "calls": calls, "finish_reason": reason}


def _check_calls(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_required_and_named_calls_always_parse(api_server):
    named = {"type": "function", "function": {"name": "add"}}
    cases = [
        {"tool_choice": "required"},
        {"tool_choice": "required", "stream": True, "temperature": 1.0, "seed": 3},
        {"tool_choice": "required", "parallel_tool_calls": False, "temperature": 1.0, "seed": 5},
        {"tool_choice": named},
        {"tool_choice": named, "stream": True, "temperature": 1.0, "seed": 7},
    ]

    async def main() -> list[dict[str, Any]]:
        c = async_client(api_server)
        return await asyncio.gather(*(_create(c, **kwargs) for kwargs in cases))

    for kwargs, result in zip(cases, asyncio.run(main())):
        _check_calls(result["calls"])
        assert not result["content"], result  # "" when not streamed (as vLLM), nothing when streamed
        if kwargs["tool_choice"] == "required":
            assert result["finish_reason"] == "tool_calls"
        else:  # OpenAI ends a named function's call with "stop"
            assert result["finish_reason"] == "stop" and [c["name"] for c in result["calls"]] == ["add"]
        if kwargs.get("parallel_tool_calls") is False:
            assert len(result["calls"]) == 1


def _forced(text: str) -> dict[str, Any]:
    """A regex that makes the model write exactly `text` (auto tool choice still parses it)."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def test_auto_parses_hermes_calls(api_server):
    call = {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
    text = "Let me check.\n<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    plain = "The weather is fine."

    async def main() -> list[dict[str, Any]]:
        c = async_client(api_server)
        return await asyncio.gather(
            _create(c, tool_choice="auto", extra_body=_forced(text)),
            _create(c, tool_choice="auto", extra_body=_forced(text), stream=True),
            _create(c, extra_body=_forced(plain), stream=True),  # auto is the default with tools
            _create(c, tool_choice="none", extra_body=_forced(text)),
        )

    whole, streamed, no_call, none = asyncio.run(main())
    for result in (whole, streamed):
        assert result["content"] == "Let me check.\n" and result["finish_reason"] == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for c in result["calls"]] == [
            ("get_weather", call["arguments"])]
    assert no_call == {"content": plain, "calls": [], "finish_reason": "stop"}
    assert none == {"content": text, "calls": [], "finish_reason": "stop"}  # tool_choice none: text, unparsed


def test_legacy_functions_and_tool_messages(api_server):
    c = client(api_server)
    out = c.chat.completions.create(
        model="smol", messages=MESSAGES, functions=[t["function"] for t in TOOLS], function_call={"name": "add"},
        max_tokens=40, temperature=0,
    )
    message = out.choices[0].message
    assert message.function_call.name == "add" and not message.tool_calls
    jsonschema.validate(json.loads(message.function_call.arguments), ADD)
    # A conversation that went through a call: the assistant's call and the tool's answer reach the template.
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    answer = c.chat.completions.create(model="smol", messages=history, tools=TOOLS, tool_choice="none",
                                       max_tokens=8, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


# ---- the shape of streamed and cut-short calls (a tiny random model: the grammar decides the shape) ----
# Enums and booleans only, so that the random model's calls end within a few tokens; a `$ref` into
# the parameters' own `$defs`, as vLLM's tests send.
OPTIONS = {"type": "object", "properties": {"fast": {"type": "boolean"}}, "required": ["fast"],
           "additionalProperties": False}
FORECAST = {"type": "object", "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                                             "options": {"$ref": "#/$defs/Options"}},
            "required": ["unit", "options"], "additionalProperties": False, "$defs": {"Options": OPTIONS}}
SMALL_TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": FORECAST}}]
NAMED = {"type": "function", "function": {"name": "forecast"}}


def _streamed(c: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A streamed reply put together as a client does, checking each delta's shape on the way."""
    content, calls, reasons = "", [], []
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        if choice.finish_reason is not None:
            reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: id, type and name
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                calls.append({"name": delta.function.name, "arguments": delta.function.arguments or ""})
            else:
                assert delta.function.name is None and delta.function.arguments
                calls[delta.index]["arguments"] += delta.function.arguments
    assert len(reasons) == 1  # the finish reason comes once, in the last chunk
    return {"content": content, "calls": calls, "finish_reason": reasons[0]}


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_streamed_constrained_calls_add_up_to_the_whole_reply(tiny_api_server, tool_choice):
    c = client(tiny_api_server)
    kwargs = {"model": "tiny", "messages": MESSAGES, "tools": SMALL_TOOLS, "tool_choice": tool_choice,
              "max_tokens": 60, "temperature": 0, "parallel_tool_calls": False}
    whole = c.chat.completions.create(**kwargs).choices[0]
    streamed = _streamed(c, **kwargs)
    calls = [{"name": t.function.name, "arguments": t.function.arguments} for t in whole.message.tool_calls]
    assert len(calls) == 1 and streamed["calls"] == calls
    jsonschema.validate(json.loads(calls[0]["arguments"]), FORECAST)
    assert whole.message.content == "" and streamed["content"] == ""  # a string, as vLLM (clients take its len)
    reason = "tool_calls" if tool_choice == "required" else "stop"
    assert whole.finish_reason == streamed["finish_reason"] == reason


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_call_cut_short_by_max_tokens_is_no_call(tiny_api_server, tool_choice):
    c = client(tiny_api_server)
    kwargs = {"model": "tiny", "messages": MESSAGES, "tools": SMALL_TOOLS, "tool_choice": tool_choice,
              "max_completion_tokens": 3, "temperature": 0}
    whole = c.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length" and whole.message.tool_calls is None and whole.message.content == ""
    streamed = _streamed(c, **kwargs)
    assert streamed["finish_reason"] == "length" and streamed["content"] == ""  # its JSON is never content
    # A stream cannot take back what it sent: a named call's name went out first (as vLLM streams it),
    # and the finish reason says its arguments were cut short.
    for call in streamed["calls"]:
        with pytest.raises(ValueError):
            json.loads(call["arguments"])

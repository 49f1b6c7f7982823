"""`--reasoning-parser qwen3` through the server, with the official client. The tiny random model
does not think: a regex (structured outputs) makes it write a `<think>` block, so what this shows
is the serving layer's part (reasoning split off into `reasoning` and `reasoning_content`, streamed
as its own deltas, tool calls parsed from what follows), not a model's thinking."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

openai = pytest.importorskip("openai")

TIMEOUT = 120
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "I should check the weather."
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def forced(text: str, **extra: Any) -> dict[str, Any]:
    """Request arguments that make the model write exactly `text`."""
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 100, "temperature": 0,
            "extra_body": {"structured_outputs": {"regex": re.escape(text)}, **extra}}


def streamed(c: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    reasoning, alias, content, calls = "", "", "", []
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning"):
            assert not delta.content and not delta.tool_calls  # reasoning comes in deltas of its own
        reasoning += extra.get("reasoning") or ""
        alias += extra.get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                calls.append({"name": call.function.name, "arguments": call.function.arguments or ""})
            else:
                calls[call.index]["arguments"] += call.function.arguments
    assert alias == reasoning
    return {"reasoning": reasoning, "content": content, "calls": calls}


def test_reasoning_is_split_from_the_content(tiny_api_server):
    c = client(tiny_api_server)
    text = f"<think>{THOUGHT}</think>\n\nIt is sunny."
    message = c.chat.completions.create(**forced(text)).choices[0].message
    assert message.reasoning == message.reasoning_content == THOUGHT
    assert message.content == "\n\nIt is sunny."
    assert streamed(c, **forced(text)) == {"reasoning": THOUGHT, "content": "\n\nIt is sunny.", "calls": []}
    # include_reasoning false: the reasoning is left out, the content is the same.
    hidden = c.chat.completions.create(**forced(text, include_reasoning=False)).choices[0].message
    assert hidden.reasoning is None and hidden.content == "\n\nIt is sunny."
    assert streamed(c, **forced(text, include_reasoning=False))["reasoning"] == ""


def test_an_output_without_a_think_block_is_all_content(tiny_api_server):
    c = client(tiny_api_server)
    message = c.chat.completions.create(**forced("It is sunny.")).choices[0].message
    assert message.reasoning is None and message.content == "It is sunny."  # the field is there, empty
    assert streamed(c, **forced("It is sunny.")) == {"reasoning": "", "content": "It is sunny.", "calls": []}


def test_free_text_is_reasoning_until_the_block_closes(tiny_api_server):
    """As vLLM 0.32 reads Qwen3 (whose newer templates open the block in the prompt): free text is
    reasoning from its start; the tiny model never closes the block, so all it writes is reasoning,
    in chat and in the Responses API. With thinking off (enable_thinking false, or reasoning effort
    "none") it is all content."""
    c = client(tiny_api_server)
    base = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    thought = c.chat.completions.create(**base, extra_body={"ignore_eos": True}).choices[0].message
    assert thought.reasoning and not thought.content
    assert streamed(c, **base, extra_body={"ignore_eos": True}) == {"reasoning": thought.reasoning, "content": "",
                                                                    "calls": []}
    # As vLLM, the usage counts the reasoning's tokens, hidden or not, whole or streamed.
    hidden = c.chat.completions.create(**base, extra_body={"ignore_eos": True, "include_reasoning": False})
    assert hidden.choices[0].message.reasoning is None
    assert hidden.usage.completion_tokens_details.reasoning_tokens > 0
    last = list(c.chat.completions.create(**base, stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True}))[-1]
    counted = hidden.usage.completion_tokens_details.reasoning_tokens
    assert last.usage.completion_tokens_details.reasoning_tokens == counted
    off = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
    answered = c.chat.completions.create(**base, extra_body=off)
    answer = answered.choices[0].message
    assert answer.reasoning is None and answer.content
    assert answered.usage.completion_tokens_details.reasoning_tokens == 0
    response = c.responses.create(model="tiny", input=MESSAGES[0]["content"], max_output_tokens=8, temperature=0)
    assert [item.type for item in response.output] == ["reasoning"] and response.output_text == ""
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with c.responses.stream(model="tiny", input=MESSAGES[0]["content"], max_output_tokens=8, temperature=0) as stream:
        streamed_response = stream.get_final_response()
    assert [item.type for item in streamed_response.output] == ["reasoning"]
    assert streamed_response.output[0].content[0].text == response.output[0].content[0].text
    answered = c.responses.create(model="tiny", input=MESSAGES[0]["content"], max_output_tokens=8, temperature=0,
                                  reasoning={"effort": "none"})
    assert answered.output_text and not any(item.type == "reasoning" for item in answered.output)


def test_tool_calls_are_parsed_after_the_reasoning(tiny_api_server):
    c = client(tiny_api_server)
    # A <tool_call> inside the reasoning is thought, not a call; the one after it is the call.
    text = f"<think>{THOUGHT} <tool_call></think><tool_call>\n{json.dumps(CALL)}\n</tool_call>"
    kwargs = forced(text)
    kwargs.update(tools=TOOLS, tool_choice="auto")
    choice = c.chat.completions.create(**kwargs).choices[0]
    assert choice.message.reasoning == f"{THOUGHT} <tool_call>" and choice.finish_reason == "tool_calls"
    assert not choice.message.content
    assert [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls] == \
        [("get_weather", CALL["arguments"])]
    got = streamed(c, **kwargs)
    assert got["reasoning"] == f"{THOUGHT} <tool_call>" and got["content"] == ""
    assert [(t["name"], json.loads(t["arguments"])) for t in got["calls"]] == [("get_weather", CALL["arguments"])]


def test_constrained_tool_calls_have_no_reasoning(tiny_api_server):
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"],
        "additionalProperties": False}}}]
    out = client(tiny_api_server).chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice={"type": "function", "function": {"name": "pick"}},
        max_tokens=20, temperature=0)
    message = out.choices[0].message
    assert message.reasoning is None and message.content == "" and message.tool_calls[0].function.name == "pick"

"""The Responses API (`POST /v1/responses`) with the official `openai` client against real servers:
the bundled model (greedy text equal to chat completions' on the same messages, streamed events in
order adding up to the whole text, JSON output, function calls and their outputs, the 400s, the
store off by default) and the tiny random model with the store on (`previous_response_id`, GET,
DELETE)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from compiled_llm.entrypoints.openai.responses_protocol import OutputMessage, OutputText, ResponsesResponse
from compiled_llm.entrypoints.openai.responses_store import ResponsesStore
from compiled_llm.entrypoints.openai.serving_responses import StreamedOutput

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

TIMEOUT = 600  # generous: CI machines are shared
QUESTION = "Name three colours."
INSTRUCTIONS = "Answer in one short sentence."
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 1000},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 1000}},
       "required": ["a", "b"]}
TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers.", "parameters": ADD}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def test_text_equals_chat_completions(api_server):
    """Greedy: the same words as chat completions on the same messages, whichever way the input
    and the instructions are spelled; usage counts the same tokens."""
    system = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    as_items = [{"type": "message", "role": "developer", "content": INSTRUCTIONS},
                {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]

    async def main() -> tuple[Any, ...]:
        c = async_client(api_server)
        common = {"model": "smol", "temperature": 0}
        return await asyncio.gather(
            c.responses.create(input=QUESTION, max_output_tokens=24, metadata={"k": "v"},
                               include=["reasoning.encrypted_content"], **common),
            c.chat.completions.create(messages=[{"role": "user", "content": QUESTION}], max_tokens=24, **common),
            c.responses.create(input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=24, **common),
            c.responses.create(input=as_items, max_output_tokens=24, **common),
            c.chat.completions.create(messages=system, max_tokens=24, **common),
        )

    plain, chat_plain, instructed, items, chat_system = asyncio.run(main())
    for response, chat in ((plain, chat_plain), (instructed, chat_system), (items, chat_system)):
        assert response.object == "response" and response.id.startswith("resp_") and response.model == "smol"
        assert response.output_text == chat.choices[0].message.content
        assert [o.type for o in response.output] == ["message"]
        incomplete = chat.choices[0].finish_reason == "length"
        assert response.status == ("incomplete" if incomplete else "completed")
        assert response.output[0].status == response.status
        usage = response.usage
        assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert usage.output_tokens_details.reasoning_tokens == 0
    assert plain.metadata == {"k": "v"} and instructed.instructions == INSTRUCTIONS
    assert plain.output_text != instructed.output_text or plain.usage.input_tokens != instructed.usage.input_tokens


def _collect(events: list[Any]) -> dict[str, Any]:
    """The event types, and the text and arguments the deltas add up to."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    return {"types": [e.type for e in events], "text": text, "arguments": arguments, "last": events[-1]}


def test_streamed_events(api_server):
    c = client(api_server)
    kwargs = {"model": "smol", "input": QUESTION, "instructions": INSTRUCTIONS, "temperature": 0}
    whole = c.responses.create(max_output_tokens=40, **kwargs)
    streamed = _collect(list(c.responses.create(stream=True, max_output_tokens=40, **kwargs)))
    deltas = streamed["types"].count("response.output_text.delta")
    assert deltas >= 2
    assert streamed["types"] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]
    final = streamed["last"].response
    assert streamed["text"] == final.output_text == whole.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens

    with c.responses.stream(max_output_tokens=3, **kwargs) as stream:  # the client's own accumulation
        done = [e for e in stream if e.type == "response.output_text.done"]
        cut = stream.get_final_response()
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 3 and cut.output[0].status == "incomplete"
    assert done[0].text == cut.output_text and cut.output_text


def test_json_output(api_server):
    async def main() -> list[Any]:
        c = async_client(api_server)
        common = {"model": "smol", "input": "Invent a person.", "temperature": 0, "max_output_tokens": 80}
        return await asyncio.gather(
            c.responses.create(text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                "strict": True}}, **common),
            c.responses.create(text={"format": {"type": "json_object"}}, **common),
        )

    schema, anything = asyncio.run(main())
    jsonschema.validate(json.loads(schema.output_text), PERSON)
    assert schema.text.format.type == "json_schema" and schema.text.format.schema_ == PERSON
    # Any object: SmolLM2 may still be inside a string value when the budget runs out.
    assert anything.output_text.startswith("{")
    assert anything.status == "incomplete" or isinstance(json.loads(anything.output_text), dict)


def test_function_call_and_its_output(api_server):
    c = client(api_server)
    common = {"model": "smol", "tools": TOOLS, "temperature": 0, "max_output_tokens": 60}
    question = {"role": "user", "content": "What is 2 plus 3?"}
    called = c.responses.create(input=[question], tool_choice="required", parallel_tool_calls=False, **common)
    assert [o.type for o in called.output] == ["function_call"]
    call = called.output[0]
    assert call.name == "add" and call.call_id.startswith("call_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD)

    named = {"type": "function", "name": "add"}
    streamed = _collect(list(c.responses.create(input=[question], tool_choice=named, stream=True, **common)))
    assert streamed["types"][2] == "response.output_item.added" and streamed["types"][-3:] == [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    streamed_call = streamed["last"].response.output[0]
    assert streamed_call.type == "function_call" and streamed_call.arguments == streamed["arguments"]
    jsonschema.validate(json.loads(streamed["arguments"]), ADD)

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    answered = c.responses.create(input=[question, call.model_dump(exclude_none=True), result], tool_choice="none",
                                  **common)
    assert [o.type for o in answered.output] == ["message"] and answered.output_text
    assert answered.usage.input_tokens > called.usage.input_tokens  # the call and its result are in the prompt


def _error(call) -> tuple[int, dict[str, Any]]:
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value.status_code, e.value.body


@pytest.mark.parametrize("fields,param", [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [*TOOLS, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
    ({"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://x"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["message.output_text.logprobs", "file_search_call.results"]}, "include"),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 10**6}, "top_logprobs"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),  # past the context
    ({"tools": TOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"tools": [{"type": "function", "parameters": ADD}]}, "tools[0].name"),
])
def test_what_is_not_served_is_a_400(api_server, fields, param):
    c = client(api_server)
    status, body = _error(lambda: c.responses.create(**{"model": "smol", "input": "hi", **fields}))
    assert status == 400 and body["param"] == param and body["message"], body


def test_store_is_off_by_default(api_server):
    """As vLLM: `store: true` is accepted and nothing is kept."""
    c = client(api_server)
    response = c.responses.create(model="smol", input="hi", max_output_tokens=2, store=True)
    assert response.store is False
    for call in (lambda: c.responses.retrieve(response.id), lambda: c.responses.delete(response.id),
                 lambda: c.responses.create(model="smol", input="hi", previous_response_id=response.id)):
        status, body = _error(call)
        assert status == 404 and response.id in body["message"]
    assert body["param"] == "previous_response_id"


def test_previous_response_get_and_delete(tiny_api_server):
    c = client(tiny_api_server)
    plain = {"effort": "none"}  # no thinking: the tiny model's words are the message (the server parses qwen3)
    first = c.responses.create(model="tiny", input="Hello", instructions="Be kind.", max_output_tokens=5,
                               temperature=0, reasoning=plain)
    assert first.store is True
    assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = c.responses.create(model="tiny", input="Again", previous_response_id=first.id, max_output_tokens=5,
                                temperature=0, reasoning=plain)
    assert second.previous_response_id == first.id
    # The prompt: the first input and output, then the new input; the old instructions are not kept.
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Again"}]
    tokenized = httpx.post(tiny_api_server.url + "/tokenize", timeout=TIMEOUT, json={
        "model": "tiny", "messages": messages, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert second.usage.input_tokens == tokenized["count"]

    with c.responses.stream(model="tiny", input="Once more", previous_response_id=second.id,
                            max_output_tokens=5) as stream:
        third = stream.get_final_response()
    assert c.responses.retrieve(third.id).output_text == third.output_text
    status, body = _error(lambda: c.responses.cancel(first.id))  # as vLLM: only a background one can be
    assert status == 400 and body["message"] == "Cannot cancel a synchronous response."
    c.responses.delete(first.id)
    for call in (lambda: c.responses.retrieve(first.id), lambda: c.responses.delete(first.id),
                 lambda: c.responses.cancel(first.id)):
        assert _error(call)[0] == 404
    # Each response keeps its whole conversation: a continuation outlives the responses before it.
    fourth = c.responses.create(model="tiny", input="And?", previous_response_id=second.id, max_output_tokens=2)
    assert fourth.usage.input_tokens > second.usage.input_tokens
    unstored = c.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    assert unstored.store is False and _error(lambda: c.responses.retrieve(unstored.id))[0] == 404


def test_input_items_list_the_conversation(tiny_api_server):
    """`input_items` of a stored response: every item it was generated from, earlier turns' inputs and
    outputs included, in OpenAI's item shapes, newest first unless asked; ids that stay the same from
    call to call, so the official client's pages (cursor `after`) and `before` walk them."""
    c = client(tiny_api_server)
    first = c.responses.create(model="tiny", input="Hello", instructions="Be kind.", max_output_tokens=3)
    [hello] = c.responses.input_items.list(first.id).data
    assert (hello.type, hello.role, hello.status) == ("message", "user", "completed")
    assert [(part.type, part.text) for part in hello.content] == [("input_text", "Hello")]
    assert hello.id.startswith("msg_")  # the instructions are no item

    second = c.responses.create(model="tiny", max_output_tokens=3, previous_response_id=first.id, input=[
        {"role": "user", "content": "Again"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Briefly."}]}])
    oldest_first = c.responses.input_items.list(second.id, order="asc").data
    assert [item.id for item in oldest_first] == [hello.id, *(item.id for item in first.output),
                                                  *(item.id for item in oldest_first[-2:])]
    assert [(item.type, getattr(item, "role", None)) for item in oldest_first[-2:]] == [("message", "user"),
                                                                                        ("message", "developer")]
    assert oldest_first[-1].content[0].text == "Briefly."
    newest_first = c.responses.input_items.list(second.id).data  # OpenAI's default order: desc
    assert [item.id for item in newest_first] == [item.id for item in reversed(oldest_first)]
    assert newest_first == c.responses.input_items.list(second.id).data  # the same ids every call

    page = c.responses.input_items.list(second.id, order="asc", limit=1)
    assert page.has_more and [item.id for item in page.data] == [hello.id]
    walked = [item.id for item in c.responses.input_items.list(second.id, order="asc", limit=1)]
    assert walked == [item.id for item in oldest_first]  # the client follows `after` page by page
    before = httpx.get(f"{tiny_api_server.url}/v1/responses/{second.id}/input_items", timeout=TIMEOUT,
                       params={"order": "asc", "before": oldest_first[2].id}).json()
    assert [item["id"] for item in before["data"]] == [item.id for item in oldest_first[:2]]
    assert before["first_id"] == hello.id and before["has_more"] is False

    for kwargs, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "sideways"}, "order"),
                          ({"after": "msg_nowhere"}, "after"), ({"include": ["file_search_call.results"]}, "include")):
        status, body = _error(lambda kwargs=kwargs: c.responses.input_items.list(second.id, **kwargs))
        assert status == 400 and body["param"] == param, (kwargs, body)
    assert _error(lambda: c.responses.input_items.list("resp_nowhere"))[0] == 404


def test_output_logprobs_and_response_messages(tiny_api_server):
    """include message.output_text.logprobs with top_logprobs: each output token's logprob and its
    alternatives, the same as chat's, whole and streamed (each delta with its own tokens'); vLLM's
    enable_response_messages: the prompt and the output as the model saw and wrote them."""
    c = client(tiny_api_server)
    # Thinking off (the server's qwen3 parser would read the tiny model's words as reasoning): as
    # vLLM, reasoning effort "none" is the template's enable_thinking false, which chat is given.
    kwargs = {"model": "tiny", "input": "Hello", "max_output_tokens": 6, "temperature": 0,
              "include": ["message.output_text.logprobs"], "top_logprobs": 3, "reasoning": {"effort": "none"}}
    whole = c.responses.create(**kwargs, extra_body={"enable_response_messages": True})
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
                                     temperature=0, logprobs=True, top_logprobs=3,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    logprobs = whole.output[0].content[0].logprobs
    expected = chat.choices[0].logprobs.content
    assert [lp.token for lp in logprobs] == [lp.token for lp in expected]
    assert len(logprobs) == whole.usage.output_tokens
    for got, want in zip(logprobs, expected):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4) and got.bytes == want.bytes
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]
        assert len(got.top_logprobs) == 3
    raw_in, raw_out = whole.input_messages[0], whole.output_messages[0]
    assert raw_in["type"] == raw_out["type"] == "raw_message_tokens"
    assert raw_in["message"].endswith("assistant\n<think>\n\n</think>\n\n")
    assert len(raw_in["tokens"]) == whole.usage.input_tokens
    assert len(raw_out["tokens"]) == whole.usage.output_tokens and raw_out["message"]
    events = list(c.responses.create(stream=True, **kwargs))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in logprobs]
    assert all(e.logprobs for e in deltas)
    final = events[-1].response
    assert [lp.token for lp in final.output[0].content[0].logprobs] == [lp.token for lp in logprobs]
    assert final.input_messages is None
    plain = c.responses.create(model="tiny", input="Hello", max_output_tokens=2, top_logprobs=3,
                               reasoning={"effort": "none"})
    assert plain.output[0].content[0].logprobs is None  # not asked for by `include`


def test_store_evicts_least_recently_used():
    def response(i: int) -> ResponsesResponse:
        message = OutputMessage(content=[OutputText(text="x" * 100)])
        return ResponsesResponse(id=f"resp_{i}", model="m", output=[message])

    one = len(response(0).model_dump_json())
    store = ResponsesStore(max_bytes=3 * one)
    for i in range(3):
        assert store.put(response(i), [])
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(response(3), [])
    assert store.get("resp_1") is None and store.get("resp_0") is not None and len(store) == 3
    assert store.size <= store.max_bytes
    assert not store.put(response(4), [{"text": "y" * 4 * one}])  # alone over the limit: not kept
    assert store.get("resp_4") is None


def test_reasoning_and_calls_stream_as_the_client_reads_them():
    """The events of a reasoning item, a message and a function call, as a stream with a reasoning
    parser and tools builds them, through the official client's own accumulation (the servers'
    models do not think: the tiny one's words are random, and the bundled one has no parser)."""
    from openai._models import construct_type
    from openai._types import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    state = StreamedOutput()
    events = [state.lifecycle("response.created", ResponsesResponse(id="resp_1", model="m"))]
    for step in (state.reasoning_delta("Let me "), state.reasoning_delta("think."), state.text_delta("Hi"),
                 state.text_delta(" there."), state.call_delta(0, "add", '{"a": 1'), state.call_delta(0, None, "}"),
                 state.call_delta(1, "add", '{"a": 2}'), state.close("completed")):
        events += step
    final = ResponsesResponse(id="resp_1", model="m", status="completed", output=state.output)
    events.append(state.lifecycle("response.completed", final))
    parsed = [construct_type(type_=ResponseStreamEvent, value=json.loads(e.removeprefix("data: "))) for e in events]
    assert [e.sequence_number for e in parsed] == list(range(len(parsed)))
    reader = ResponseStreamState(input_tools=omit, text_format=omit)
    seen = [e for raw in parsed for e in reader.handle_event(raw)]
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert [e.type for e in seen] == [
        "response.created", *item, "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", *done, *item, "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", *done, "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed",
    ]
    response = seen[-1].response
    assert [o.type for o in response.output] == ["reasoning", "message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "Let me think." and response.output_text == "Hi there."
    assert [json.loads(o.arguments) for o in response.output[2:]] == [{"a": 1}, {"a": 2}]
    assert all(o.status == "completed" for o in response.output)

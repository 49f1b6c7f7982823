"""POST /v1/responses (OpenAI's Responses API), GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items, and POST /v1/responses/{id}/cancel (a 400: no response served here
runs in the background).

A Responses request is served as the chat completion it amounts to: its `instructions` become a
system message, its input items chat messages (`developer` is `system`; a `function_call` item an
assistant tool call; a `function_call_output` a tool message), its flat function tools chat tools
and `text.format` a response format. So the chat template, tool parsing, reasoning parsing and
structured outputs are chat's own, and greedy text equals chat's on the same messages. The output
comes back as typed items: reasoning (with a `--reasoning-parser`), the message, the function calls.

Streamed, a response is OpenAI's sequence of typed events, numbered from 0: `response.created`,
`response.in_progress`, then for each output item `output_item.added`, its part's `added`, its
deltas, its `done` events, and last `response.completed`. As vLLM, a response cut short by
`max_output_tokens` also ends with `response.completed`, its status `incomplete` (OpenAI's own
server sends `response.incomplete`, which the official client's `get_final_response` refuses).

What is not served is a 400 naming the field: background mode, built-in tools (web search, file
search, code interpreter, computer use, MCP, ...), items or content parts other than text.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from compiled_llm.engine.async_llm import RequestStream
from compiled_llm.entrypoints.openai.chat_tools import ToolPlan, plan_tools
from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.logprobs import chat_logprobs
from compiled_llm.entrypoints.openai.protocol import ChatCompletionRequest
from compiled_llm.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReasoningStreamer,
    request_reasoning_parser,
)
from compiled_llm.entrypoints.openai.responses_protocol import (
    ContentPartEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionToolCall,
    IncompleteDetails,
    InputItemList,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTextDoneEvent,
    OutputTokensDetails,
    RawMessage,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDoneEvent,
    ResponseDeleted,
    ResponseLifecycleEvent,
    ResponsesRequest,
    ResponsesResponse,
    ResponseTextConfig,
    ResponseUsage,
    arguments_delta_event,
    reasoning_delta_event,
    text_delta_event,
)
from compiled_llm.entrypoints.openai.responses_store import ResponsesStore, store_enabled
from compiled_llm.entrypoints.openai.serving_chat import OpenAIServingChat
from compiled_llm.entrypoints.openai.serving_engine import event_stream, final_output, json_response, sse
from compiled_llm.entrypoints.openai.stream_events import event
from compiled_llm.entrypoints.openai.structured_outputs import requested_structured_outputs
from compiled_llm.logger import init_logger
from compiled_llm.outputs import CompletionOutput, Logprob
from compiled_llm.utils import random_uuid

logger = init_logger(__name__)

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# What `include` may name: reasoning is never encrypted here, so there is nothing to add for it;
# the output text's logprobs are.
_INCLUDABLE = ("reasoning.encrypted_content", "message.output_text.logprobs")


def _not_found(response_id: str, param: str = "response_id") -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", 404, param=param)


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(f"{param}.{key} must be a string.", param=f"{param}.{key}")
    return value


def _content(content: Any, param: str) -> str | list[dict[str, str]]:
    """A message's content as a chat message holds it: a string, or text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(f"{param} must be a string or a list of content parts.", param=param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in (*_TEXT_PARTS, "refusal"):
            raise OpenAIError(f"Content part type {kind!r} is not supported by this server: it serves text parts "
                              f"({', '.join(_TEXT_PARTS[:2])}) only.", param=f"{param}[{j}].type")
        parts.append({"type": "text", "text": _string(part, "refusal" if kind == "refusal" else "text",
                                                       f"{param}[{j}]")})
    return parts


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": request.input}]
    return list(request.input)


# The id prefix OpenAI gives each kind of input item; an item the client sent without an id gets one
# when its response is stored, so that a listing's cursors stay the same from call to call.
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def identified(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `items`, each with an `id` (its own, or a new one)."""
    out = []
    for item in items:
        if isinstance(item, dict) and "id" not in item:
            kind = item.get("type", "message" if "role" in item else None)
            item = {**item, "id": f"{_ITEM_ID_PREFIXES.get(kind, 'item')}_{random_uuid()}"}
        out.append(item)
    return out


def listed_item(item: dict[str, Any]) -> dict[str, Any]:
    """An item of the conversation as `input_items` lists it (OpenAI's item shapes): a message's
    content as typed parts (`input_text`, or `output_text` for the assistant's), a status on each."""
    item = {**item, "status": item.get("status") or "completed"}
    kind = item.setdefault("type", "message" if "role" in item else None)
    if kind == "message":
        text_type = "output_text" if item.get("role") == "assistant" else "input_text"
        content = item.get("content")
        parts = [{"type": text_type, "text": content}] if isinstance(content, str) else list(content or [])
        item["content"] = [{**part, "type": text_type} if part.get("type") == "text" else part for part in parts]
        if text_type == "output_text":
            item["content"] = [{"annotations": [], **part} for part in item["content"]]
    return item


def item_page(items: list[dict[str, Any]], order: str, limit: int, after: str | None,
              before: str | None) -> InputItemList:
    """One page of `items` (oldest first) in `order`: after the item `after` and before the item
    `before` (ids; each a 400 when no item has it), at most `limit` items."""
    if order not in ("asc", "desc"):
        raise OpenAIError(f"order must be 'asc' or 'desc', got {order!r}.", param="order")
    if not 1 <= limit <= 100:
        raise OpenAIError(f"limit must be between 1 and 100, got {limit}.", param="limit")
    ordered = items if order == "asc" else items[::-1]
    ids = [item.get("id") for item in ordered]
    start, end = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is None:
            continue
        if cursor not in ids:
            raise OpenAIError(f"{name}: no input item of this response has the id {cursor!r}.", param=name)
        if name == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    window = ordered[start:max(start, end)]
    data = window[:limit]
    return InputItemList(data=data, first_id=data[0].get("id") if data else None,
                         last_id=data[-1].get("id") if data else None, has_more=len(window) > limit)


def chat_messages(items: list[dict[str, Any]], first_index: int = 0) -> list[dict[str, Any]]:
    """Input items (and the output items of earlier responses) as chat messages; `first_index`: the
    position of `items[0]` in the request's `input`, for the 400s' `param`."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items, first_index):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise OpenAIError(f"{param} must be an object (an input item).", param=param)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise OpenAIError(f"{param}.role must be one of {', '.join(_ROLES)}, got {item.get('role')!r}.",
                                  param=f"{param}.role")
            messages.append({"role": role, "content": _content(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function",
                    "function": {"name": _string(item, "name", param), "arguments": _string(item, "arguments", param)}}
            if messages and messages[-1]["role"] == "assistant":  # the same turn: one message, its calls
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _content(output, f"{param}.output")})
        elif kind == "reasoning":
            continue  # earlier turns' reasoning: chat templates (Qwen3's) leave it out of the prompt too
        else:
            raise OpenAIError(f"Input item type {kind!r} is not supported by this server: it serves message, "
                              "function_call, function_call_output and reasoning items.", param=f"{param}.type")
    return messages


def _chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flat function tools in chat's shape; any other tool is a 400 naming it."""
    chat_tools = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise OpenAIError(f"Tool type {kind!r} is not supported by this server: it serves function tools only "
                              "(no built-in tools such as web_search, file_search, code_interpreter, computer_use "
                              "or mcp).", param=f"tools[{i}].type")
        chat_tools.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}})
    return chat_tools


def _chat_tool_choice(request: ResponsesRequest) -> str | dict[str, Any] | None:
    choice = request.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise OpenAIError(f"tool_choice of type {choice.get('type')!r} is not supported by this server: use "
                              '"none", "auto", "required" or {"type": "function", "name": ...}.', param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    if choice in ("auto", "none") and not request.tools:
        return None
    return choice


def _response_format(text: ResponseTextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise OpenAIError("text.format of type json_schema needs its `schema`.", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.json_schema,
                                                   "strict": fmt.strict}}


def _validation_error(e: pydantic.ValidationError) -> OpenAIError:
    """A field of the chat request named as the Responses request spells it (`tools[0].name`)."""
    first = e.errors()[0]
    loc = ""
    for part in first.get("loc", ()):
        if isinstance(part, int):
            loc += f"[{part}]"
        elif part != "function":  # chat nests a tool's fields; Responses' tools are flat
            loc += f".{part}"
    loc = loc.lstrip(".")
    return OpenAIError(f"Invalid request: {loc}: {first.get('msg')}", param=loc or None)


def template_kwargs(request: ResponsesRequest) -> dict[str, Any] | None:
    """The chat template's keyword arguments: the request's own, and vLLM's reading of
    `reasoning.effort` (as `reasoning_effort`, and thinking on unless it is "none")."""
    kwargs = dict(request.chat_template_kwargs or {})
    effort = (request.reasoning or {}).get("effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
        kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs or None


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request that `request` amounts to."""
    body = {
        "messages": messages, "max_tokens": request.max_output_tokens, "temperature": request.temperature,
        "top_p": request.top_p, "tools": _chat_tools(request.tools) or None, "tool_choice": _chat_tool_choice(request),
        "parallel_tool_calls": request.parallel_tool_calls, "response_format": _response_format(request.text),
        "stream": request.stream, "seed": request.seed, "top_k": request.top_k, "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty, "stop": request.stop, "ignore_eos": request.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens, "priority": request.priority,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "chat_template_kwargs": template_kwargs(request),
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except pydantic.ValidationError as e:
        raise _validation_error(e) from e


@dataclass
class _Turn:
    """What the response to one request needs to know."""

    request: ResponsesRequest
    response_id: str
    tools: ToolPlan
    reasoning_parser: Callable[[], ReasoningParser] | None
    prompt_token_ids: list[int]
    conversation: list[dict[str, Any]]  # earlier turns' items and this input: what a continuation prepends
    created_at: int
    prompt_text: str
    num_top: int | None  # the output text's logprobs, this many alternatives each (None: not asked)

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]]) -> list[dict[str, Any]] | None:
        """OpenAI's output-text logprobs of these tokens (chat's entries: token, logprob, bytes, top_logprobs)."""
        if self.num_top is None:
            return None
        entries = chat_logprobs(CompletionOutput(0, "", token_ids, logprobs=logprobs), self.num_top).content
        return [entry.model_dump() for entry in entries or []]


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponsesStore | None = None) -> None:
        """`chat`: the chat handler this API renders, checks and samples with. `store`: where finished
        responses are kept; by default one when the environment turns it on, else none."""
        self.chat = chat
        self.engine = chat.engine
        self.store = store if store is not None else (ResponsesStore() if store_enabled() else None)

    async def create_response(self, request: ResponsesRequest, raw_request: Request) -> Response:
        chat = self.chat
        chat.check_fields(request, request.model)
        if request.background:
            raise OpenAIError("background mode is not supported by this server: send the request without "
                              "`background` (or with it false).", param="background")
        unserved = [name for name in request.include or [] if name not in _INCLUDABLE]
        if unserved:
            raise OpenAIError(f"include {unserved[0]!r} is not supported by this server (it can include: "
                              f"{', '.join(_INCLUDABLE)}).", param="include")
        if request.max_output_tokens is not None and request.max_output_tokens < 1:
            raise OpenAIError(f"max_output_tokens must be at least 1, got {request.max_output_tokens}.",
                              param="max_output_tokens")
        items = input_items(request)
        if not items:
            raise OpenAIError("input must hold at least one item.", param="input")
        conversation: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id) if self.store is not None else None
            if previous is None:
                raise _not_found(request.previous_response_id, "previous_response_id")
            conversation = [*previous.conversation,
                            *(item.model_dump() for item in previous.response.output)]
        messages = chat_messages(conversation) + chat_messages(items)
        if request.instructions:
            messages.insert(0, {"role": "system", "content": request.instructions})
        creq = chat_request(request, messages)
        chat.check_request(creq)
        tools = plan_tools(creq, chat.server_args.enable_auto_tool_choice, chat.server_args.tool_call_parser)
        structured = requested_structured_outputs(creq)
        if structured is not None and tools.constrains_output:
            raise OpenAIError(f"Give text.format or tool_choice {tools.mode}, not both: both constrain the output.",
                              param="tool_choice")
        reasoning_parser = request_reasoning_parser(chat.server_args.reasoning_parser, tools.constrains_output,
                                                    structured is not None, creq.chat_template_kwargs)
        structured = structured or tools.structured_outputs()
        text, ids = await chat.render(creq.messages, True, None, chat.template_kwargs(creq, tools.template_tools))
        try:
            chat.check_length(len(ids), creq.max_tokens)
        except OpenAIError as e:  # named as chat names it
            e.param = "max_output_tokens"
            raise
        num_top = chat.logprobs_count(request.top_logprobs or 0, "top_logprobs") if request.wants_logprobs() else None
        params = chat.sampling_params(creq, creq.max_tokens, num_top, None, structured)
        request_id = f"resp_{request.request_id or random_uuid()}"
        stream = await chat.add_request(request_id, {"prompt": text, "prompt_token_ids": ids}, params, creq.priority,
                                        chat.lora_request(request.model))
        turn = _Turn(request, request_id, tools, reasoning_parser, ids, conversation + identified(items),
                     int(time.time()), text, num_top)
        if request.stream:
            return event_stream(self._events(turn, stream), [request_id], self.engine)
        return await json_response(raw_request, self._respond(turn, stream), [request_id], self.engine)

    def retrieve(self, response_id: str) -> JSONResponse:
        entry = self.store.get(response_id) if self.store is not None else None
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(entry.response.model_dump())

    def list_input_items(self, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None,
                         before: str | None = None, include: list[str] | None = None) -> JSONResponse:
        """The items a stored response was generated from, earlier turns' inputs and outputs
        included (as OpenAI lists them), newest first by default; the instructions are no item."""
        entry = self.store.get(response_id) if self.store is not None else None
        if entry is None:
            raise _not_found(response_id)
        unserved = [name for name in include or [] if name not in _INCLUDABLE]
        if unserved:
            raise OpenAIError(f"include {unserved[0]!r} is not supported by this server (it can include: "
                              f"{', '.join(_INCLUDABLE)}).", param="include")
        items = [listed_item(item) for item in entry.conversation]
        return JSONResponse(item_page(items, order, limit, after, before).model_dump())

    def cancel(self, response_id: str) -> JSONResponse:
        """vLLM's cancel: only a background response can be, and none is served here, so a kept
        response is a 400 (it is finished) and any other id a 404."""
        if self.store is None or self.store.get(response_id) is None:
            raise _not_found(response_id)
        raise OpenAIError("Cannot cancel a synchronous response.", param="response_id")

    def delete(self, response_id: str) -> JSONResponse:
        if self.store is None or not self.store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse(ResponseDeleted(id=response_id).model_dump())

    async def _finish(self, turn: _Turn, output: list[OutputItem], truncated: bool, output_tokens: int,
                      cached_tokens: int, raw_output: tuple[str, list[int]]) -> ResponsesResponse:
        """The finished response, stored when asked and the store is on; `raw_output`: the text
        and token ids the model wrote (for enable_response_messages)."""
        reasoning_tokens = 0
        for item in output:
            if isinstance(item, ReasoningItem) and item.content:
                reasoning_tokens += len(await self.engine.tokenize(item.content[0].text, False))
        input_tokens = len(turn.prompt_token_ids)
        usage = ResponseUsage(
            input_tokens=input_tokens, input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
            output_tokens=output_tokens, output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
            total_tokens=input_tokens + output_tokens,
        )
        response = self._response(turn, "incomplete" if truncated else "completed", output, usage)
        if turn.request.enable_response_messages:
            response.input_messages = [RawMessage(message=turn.prompt_text, tokens=turn.prompt_token_ids)]
            response.output_messages = [RawMessage(message=raw_output[0], tokens=raw_output[1])]
        if response.store:
            assert self.store is not None
            self.store.put(response, turn.conversation)
        return response

    def _response(self, turn: _Turn, status: str, output: list[OutputItem],
                  usage: ResponseUsage | None = None) -> ResponsesResponse:
        r = turn.request
        return ResponsesResponse(
            id=turn.response_id, created_at=turn.created_at, status=status, model=self.chat.model_name(r.model),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=r.instructions, output=output, parallel_tool_calls=r.parallel_tool_calls,
            tool_choice=r.tool_choice, tools=r.tools, temperature=r.temperature, top_p=r.top_p,
            max_output_tokens=r.max_output_tokens, previous_response_id=r.previous_response_id,
            reasoning=r.reasoning, text=r.text or ResponseTextConfig(), metadata=r.metadata,
            store=r.store and self.store is not None, user=r.user, usage=usage,
        )

    async def _respond(self, turn: _Turn, stream: RequestStream) -> ResponsesResponse:
        out = await final_output(stream)
        c = out.outputs[0]
        text, reasoning = c.text, None
        if turn.reasoning_parser is not None:  # tool calls are parsed from what follows the reasoning
            split = turn.reasoning_parser().split(c.text, final=True)
            text, reasoning = split.content, split.reasoning
        truncated = c.finish_reason == "length"
        output: list[OutputItem] = []
        if reasoning:
            output.append(ReasoningItem(content=[ReasoningText(text=reasoning)]))
        calls: list[OutputItem] = []
        extracted = turn.tools.extract(text)
        if extracted is not None and (extracted.calls or turn.tools.constrains_output):
            text = extracted.content or ""  # constrained output cut short: no call, no content
        if extracted is not None:
            calls = [FunctionToolCall(name=f.name, arguments=f.arguments) for f in extracted.calls]
        # A message when there are words, or nothing else to show (as vLLM: every output token's
        # logprob is the message's); a thought cut short before any answer is a reasoning item alone.
        if text or not (calls or reasoning):
            output.append(OutputMessage(status="incomplete" if truncated else "completed",
                                        content=[OutputText(text=text,
                                                            logprobs=turn.logprobs(c.token_ids, c.logprobs or []))]))
        output.extend(calls)
        return await self._finish(turn, output, truncated, len(c.token_ids), out.num_cached_tokens,
                                  (c.text, list(c.token_ids)))

    async def _events(self, turn: _Turn, stream: RequestStream) -> AsyncIterator[str]:
        state = StreamedOutput(with_logprobs=turn.num_top is not None)
        yield state.lifecycle("response.created", self._response(turn, "in_progress", []))
        yield state.lifecycle("response.in_progress", self._response(turn, "in_progress", []))
        reasoning = ReasoningStreamer(turn.reasoning_parser()) if turn.reasoning_parser is not None else None
        tool_streamer = turn.tools.new_streamer()
        text, content_sent, output_tokens, cached, truncated = "", "", 0, 0, False
        token_ids: list[int] = []
        pending: tuple[list[int], list[dict[int, Logprob]]] = ([], [])  # tokens whose text is not yet sent
        async for out in stream:
            cached = out.num_cached_tokens
            c = out.outputs[0]
            text += c.text
            output_tokens += len(c.token_ids)
            token_ids += c.token_ids
            if turn.num_top is not None:
                pending[0].extend(c.token_ids)
                pending[1].extend(c.logprobs or [])
            final = c.finish_reason is not None
            truncated = c.finish_reason == "length"
            new_reasoning, content_text = reasoning.update(text, final) if reasoning is not None else ("", text)
            if new_reasoning:
                for e in state.reasoning_delta(new_reasoning):
                    yield e
            if tool_streamer is None:
                content, calls = content_text[len(content_sent):], []
                content_sent = content_text
            else:
                content, calls = tool_streamer.update(content_text, final)
            if content:
                for e in state.text_delta(content, turn.logprobs(*pending)):
                    yield e
                pending = ([], [])
            for d in calls:
                for e in state.call_delta(d.index, d.name if d.id is not None else None, d.arguments):
                    yield e
        if not any(isinstance(item, (OutputMessage, FunctionToolCall, ReasoningItem)) for item in state.output):
            for e in state.open_message():  # nothing at all: an empty message, as when not streamed
                yield e
        for e in state.close("incomplete" if truncated else "completed"):
            yield e
        response = await self._finish(turn, state.output, truncated, output_tokens, cached, (text, token_ids))
        yield state.lifecycle("response.completed", response)


@dataclass
class StreamedOutput:
    """The output items of one streamed response, the last one open (taking deltas), and the next
    sequence number."""

    output: list[OutputItem] = field(default_factory=list)
    text: str = ""  # the open message's or reasoning item's text
    calls: dict[int, int] = field(default_factory=dict)  # the tool-call streamer's index -> the call's output index
    open: bool = False
    numbers: Iterator[int] = field(default_factory=itertools.count)
    with_logprobs: bool = False
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # the open message's, when asked

    def lifecycle(self, kind: Any, response: ResponsesResponse) -> str:
        return sse(ResponseLifecycleEvent(type=kind, sequence_number=next(self.numbers), response=response))

    def _add(self, item: OutputItem) -> list[str]:
        events = self.close("completed")
        self.output.append(item)
        self.open, self.text, self.logprobs = True, "", []
        index = len(self.output) - 1
        events.append(sse(OutputItemEvent(type="response.output_item.added", sequence_number=next(self.numbers),
                                          output_index=index, item=item)))
        if isinstance(item, (OutputMessage, ReasoningItem)):
            part = OutputText(text="") if isinstance(item, OutputMessage) else ReasoningText(text="")
            events.append(sse(ContentPartEvent(type="response.content_part.added", sequence_number=next(self.numbers),
                                               item_id=item.id, output_index=index, content_index=0, part=part)))
        return events

    def _current(self, kind: type) -> OutputItem | None:
        return self.output[-1] if self.open and isinstance(self.output[-1], kind) else None

    def open_message(self) -> list[str]:
        return [] if self._current(OutputMessage) else self._add(OutputMessage(status="in_progress"))

    def text_delta(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        events = self.open_message()
        self.text += delta
        self.logprobs += logprobs or []
        events.append(event(text_delta_event(next(self.numbers), self.output[-1].id, len(self.output) - 1, delta,
                                             logprobs)))
        return events

    def reasoning_delta(self, delta: str) -> list[str]:
        events = [] if self._current(ReasoningItem) else self._add(ReasoningItem(status="in_progress"))
        self.text += delta
        events.append(event(reasoning_delta_event(next(self.numbers), self.output[-1].id, len(self.output) - 1,
                                                  delta)))
        return events

    def call_delta(self, index: int, name: str | None, arguments: str) -> list[str]:
        events: list[str] = []
        if name is not None:  # a call's first delta
            events = self._add(FunctionToolCall(name=name, status="in_progress"))
            self.calls[index] = len(self.output) - 1
        position = self.calls[index]
        call = self.output[position]
        assert isinstance(call, FunctionToolCall)
        if arguments:
            call.arguments += arguments
            events.append(event(arguments_delta_event(next(self.numbers), call.id, position, arguments)))
        return events

    def close(self, status: str) -> list[str]:
        """The done events of the open item, which ends with `status`."""
        if not self.open:
            return []
        self.open = False
        index = len(self.output) - 1
        item = self.output[-1]
        item.status = status  # type: ignore[assignment]
        events = []
        if isinstance(item, OutputMessage):
            part: OutputText | ReasoningText = OutputText(text=self.text,
                                                          logprobs=self.logprobs if self.with_logprobs else None)
            item.content = [part]
            events.append(sse(OutputTextDoneEvent(sequence_number=next(self.numbers), item_id=item.id,
                                                  output_index=index, text=self.text, logprobs=self.logprobs)))
        elif isinstance(item, ReasoningItem):
            part = ReasoningText(text=self.text)
            item.content = [part]
            events.append(sse(ReasoningTextDoneEvent(sequence_number=next(self.numbers), item_id=item.id,
                                                     output_index=index, text=self.text)))
        else:
            events.append(sse(FunctionCallArgumentsDoneEvent(sequence_number=next(self.numbers), item_id=item.id,
                                                             output_index=index, name=item.name,
                                                             arguments=item.arguments)))
        if not isinstance(item, FunctionToolCall):
            events.append(sse(ContentPartEvent(type="response.content_part.done", sequence_number=next(self.numbers),
                                               item_id=item.id, output_index=index, content_index=0, part=part)))
        events.append(sse(OutputItemEvent(type="response.output_item.done", sequence_number=next(self.numbers),
                                          output_index=index, item=item)))
        return events

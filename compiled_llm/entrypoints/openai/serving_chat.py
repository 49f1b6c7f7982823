"""POST /v1/chat/completions: the conversation is rendered with the model's chat template (with
the request's tools), and the reply may come back as tool calls (see `chat_tools.py`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import Response

from compiled_llm.engine.async_llm import RequestStream
from compiled_llm.engine.chat_templates import ChatTemplateError
from compiled_llm.entrypoints.chat_utils import ChatTemplateContentFormat, format_content, resolve_content_format
from compiled_llm.entrypoints.openai.chat_tools import ToolPlan, plan_tools
from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_out
from compiled_llm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatMessage,
    ChatResponseMessage,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
)
from compiled_llm.entrypoints.openai.reasoning_parsers import (
    ReasoningParser,
    ReasoningStreamer,
    request_reasoning_parser,
)
from compiled_llm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    event_stream,
    final_output,
    json_response,
)
from compiled_llm.entrypoints.openai.stream_events import chat_choice, chat_chunk, content_delta, reasoning_delta
from compiled_llm.entrypoints.openai.structured_outputs import requested_structured_outputs
from compiled_llm.entrypoints.openai.tool_parsers import ToolCallDelta
from compiled_llm.entrypoints.openai.tool_parsers.streaming import make_tool_call_id
from compiled_llm.logger import init_logger
from compiled_llm.outputs import CompletionOutput, Logprob

logger = init_logger(__name__)


def message_text(message: ChatMessage) -> str:
    """A message's text; content parts are joined (text parts only)."""
    return str(_content(message, "string"))


def _content(message: ChatMessage, content_format: ChatTemplateContentFormat) -> str | list[dict[str, str]]:
    try:
        return format_content(message.content, content_format)
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from e


def _arguments_as_object(tool_calls: Any) -> Any:
    """Assistant tool calls with their JSON-text arguments parsed: chat templates (Qwen's, Llama's)
    write `arguments | tojson` and expect an object, as vLLM gives them."""
    if not isinstance(tool_calls, list):
        return tool_calls
    result = []
    for call in tool_calls:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function = {**function, "arguments": json.loads(function["arguments"])}
            except ValueError:
                pass
            call = {**call, "function": function}
        result.append(call)
    return result


def message_dict(message: ChatMessage, content_format: ChatTemplateContentFormat = "string") -> dict[str, Any]:
    """A message as the chat template expects it, its content a string or a list of parts."""
    extra = dict(message.model_extra or {})
    if "tool_calls" in extra:
        extra["tool_calls"] = _arguments_as_object(extra["tool_calls"])
    return {**extra, "role": message.role, "content": _content(message, content_format)}


@dataclass
class _ChoiceStream:
    """One choice of a streamed reply: its text so far, its reasoning and tool-call streamers, and
    the tokens not yet sent (their text may be held back while it could still be a tag)."""

    streamer: Any = None
    reasoning: ReasoningStreamer | None = None
    content_sent: str = ""  # (with reasoning, without tools) the content streamed so far
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


class OpenAIServingChat(OpenAIServing):
    async def render(
        self, messages: list[ChatMessage], add_generation_prompt: bool, chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None, add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """The conversation rendered and tokenized with the request's template (if the operator
        allows one), else the server's --chat-template, else the model's; its messages' content in
        the shape that template reads (--chat-template-content-format). A 400 for a template that
        fails or a text too long."""
        template_kwargs = dict(template_kwargs or {})
        if (chat_template is not None or "chat_template" in template_kwargs) and \
                not self.server_args.trust_request_chat_template:
            raise OpenAIError(
                "This server does not take chat templates from requests (a template is code); its operator can "
                "allow them with --trust-request-chat-template.", param="chat_template",
            )
        template_kwargs.pop("tokenize", None)
        # Keys that name this call's own arguments: as vLLM, chat_template_kwargs may set the
        # template and the generation prompt; the conversation and the tokenizer's options not.
        reserved = sorted(set(template_kwargs) & {"messages", "conversation", "add_special_tokens", "self"})
        if reserved:
            raise OpenAIError(f"chat_template_kwargs cannot set `{reserved[0]}`.", param="chat_template_kwargs")
        if "add_generation_prompt" in template_kwargs:
            add_generation_prompt = template_kwargs.pop("add_generation_prompt")
            if not isinstance(add_generation_prompt, bool):
                raise OpenAIError("chat_template_kwargs.add_generation_prompt must be a boolean.",
                                  param="chat_template_kwargs")
        if "chat_template" in template_kwargs:
            given = template_kwargs.pop("chat_template")
            if not isinstance(given, str) or chat_template is not None:
                raise OpenAIError("Give the chat template once, as a string: `chat_template` or "
                                  "chat_template_kwargs.chat_template.", param="chat_template_kwargs")
            chat_template = given
        if template_kwargs.get("continue_final_message"):
            add_generation_prompt = False
        chat_template = chat_template or self.chat_template
        content_format = resolve_content_format(self.server_args.chat_template_content_format,
                                                chat_template or self.engine.tokenizer.chat_template)
        rendered = [message_dict(m, content_format) for m in messages]
        try:
            return await self.engine.apply_chat_template(
                rendered, add_generation_prompt, chat_template, add_special_tokens=add_special_tokens,
                **template_kwargs,
            )
        except ChatTemplateError as e:  # the template rejected the conversation (roles, missing template, ...)
            raise OpenAIError(f"Could not apply the chat template: {e}", param="messages") from e
        except ValueError as e:  # rendered, but too long to fit
            raise OpenAIError(str(e), param="messages") from e

    @staticmethod
    def template_kwargs(request: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        kwargs = dict(request.chat_template_kwargs or {})
        if tools:
            kwargs["tools"] = tools
        if request.documents:
            kwargs["documents"] = request.documents
        if request.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        tools = plan_tools(request, self.server_args.enable_auto_tool_choice, self.server_args.tool_call_parser)
        structured = requested_structured_outputs(request)
        if structured is not None and tools.constrains_output:
            raise OpenAIError("You can only either use constraints for structured outputs or tools, not both: "
                              f"tool_choice {tools.mode} constrains the output already.", param="tool_choice")
        reasoning = self.server_args.reasoning_parser
        reasoning_parser = request_reasoning_parser(reasoning, tools.constrains_output, structured is not None,
                                                    request.chat_template_kwargs)
        structured = structured or tools.structured_outputs()
        text, ids = await self.render(request.messages, request.generation_prompt, request.chat_template,
                                      self.template_kwargs(request, tools.template_tools), request.add_special_tokens)
        cut = self.truncate(ids, request)
        if len(cut) != len(ids):
            ids, text = cut, await self.engine.detokenize(cut)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        self.check_length(len(ids), max_tokens)
        # With logprob_token_ids and no top_logprobs: every chosen id's logprob.
        top = request.top_logprobs or len(request.logprob_token_ids or ())
        num_top = self.logprobs_count(top, "top_logprobs") if request.logprobs else None
        prompt_logprobs = self.logprobs_count(request.prompt_logprobs, "prompt_logprobs", "prompt")
        params = self.sampling_params(request, max_tokens, num_top, prompt_logprobs, structured)
        request_id = f"chatcmpl-{self.base_request_id(request)}"
        engine_prompt = {"prompt": text, "prompt_token_ids": ids}
        if request.use_beam_search:  # streamed too (as vLLM): the beams' texts come when the search ends
            stream = self.beam_search_streams(request_id, [engine_prompt], request, max_tokens, num_top, structured)[0]
        else:
            stream = await self.add_request(request_id, engine_prompt, params, request.priority,
                                            self.lora_request(request.model))
        echo = message_text(request.messages[-1]) if request.echo and request.messages[-1].role == "assistant" else ""
        reply = _Reply(request, request_id, tools, ids, text, num_top or 0, echo, reasoning_parser, bool(reasoning))
        if request.stream:
            return event_stream(self._events(reply, stream), [request_id], self.engine)
        return await json_response(raw_request, self._respond(reply, stream), [request_id], self.engine)

    async def _respond(self, reply: _Reply, stream: RequestStream) -> ChatCompletionResponse:
        request = reply.request
        out = await final_output(stream)
        choices = []
        for c in out.outputs:
            text, reasoning = c.text, None
            if reply.reasoning_parser is not None:  # tool calls are parsed from what follows the reasoning
                split = reply.reasoning_parser().split(c.text, final=True)
                text, reasoning = split.content, split.reasoning
            if reply.shows_reasoning:
                shown = reasoning if request.include_reasoning else None
                message = ChatResponseMessage(content=(text or None) if reasoning is not None else text,
                                              reasoning=shown, reasoning_content=shown)
            else:
                message = ChatResponseMessage(content=text)
            called = False
            extracted = reply.tools.extract(text)
            if extracted is not None and (extracted.calls or reply.tools.constrains_output):
                message.content = extracted.content  # constrained output cut short: no call, no content
            if extracted is not None and extracted.calls:
                called = True
                if reply.tools.legacy:
                    first = extracted.calls[0]
                    message.function_call = FunctionCall(name=first.name, arguments=first.arguments)
                else:
                    message.tool_calls = [
                        ToolCall(id=make_tool_call_id(), function=FunctionCall(name=f.name, arguments=f.arguments))
                        for f in extracted.calls
                    ]
            if reply.echo:
                message.content = reply.echo + (message.content or "")
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=message,
                logprobs=chat_logprobs(c, reply.num_top, bool(request.return_tokens_as_token_ids),
                                       request.logprob_token_ids)
                if request.logprobs else None,
                finish_reason=reply.tools.finish_reason(c.finish_reason, called), stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if request.return_token_ids else None,
            ))
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        usage = self.usage_info(len(reply.prompt_token_ids), completion_tokens, out.num_cached_tokens)
        await self._count_reasoning(reply, usage, [c.text for c in out.outputs])
        return ChatCompletionResponse(
            id=reply.request_id, model=self.model_name(request.model), choices=choices,
            usage=usage,
            prompt_logprobs=prompt_logprobs_out(out.prompt_logprobs) if request.prompt_logprobs is not None else None,
            prompt_token_ids=reply.prompt_token_ids if request.return_token_ids else None,
            prompt_text=reply.prompt_text if request.return_prompt_text else None,
        )

    async def _events(self, reply: _Reply, stream: RequestStream) -> AsyncIterator[str]:
        request = reply.request
        created = int(time.time())
        model = self.model_name(request.model)  # once a stream, not once a chunk
        completion_tokens = cached = 0

        def chunk(choices: list[dict[str, Any]], usage: UsageInfo | None = None, first: bool = False) -> str:
            return chat_chunk(
                reply.request_id, created, model, choices, usage,
                prompt_token_ids=reply.prompt_token_ids if first and request.return_token_ids else None,
                prompt_text=reply.prompt_text if first and request.return_prompt_text else None,
            )

        def usage_now() -> UsageInfo | None:
            if not request.usage_in_every_chunk:
                return None
            return self.usage_info(len(reply.prompt_token_ids), completion_tokens, cached)

        choices = {index: _ChoiceStream(reply.tools.new_streamer(), reply.new_reasoning_streamer())
                   for index in range(request.n or 1)}
        for index in choices:
            yield chunk([chat_choice(index, content_delta("", role="assistant"))], usage_now(), first=index == 0)
            if reply.echo:
                yield chunk([chat_choice(index, content_delta(reply.echo))], usage_now())
        async for out in stream:
            cached = out.num_cached_tokens
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                completion_tokens += len(c.token_ids)
                state = choices[c.index]
                state.text += c.text
                state.token_ids.extend(c.token_ids)
                state.logprobs.extend(c.logprobs or [])
                delta = self._delta(reply, state, c)
                if delta is None:
                    continue  # held back: it may still turn out to be a tool call
                logprobs = None
                if request.logprobs:
                    pending = CompletionOutput(c.index, "", state.token_ids, logprobs=state.logprobs)
                    logprobs = chat_logprobs(pending, reply.num_top, bool(request.return_tokens_as_token_ids),
                                               request.logprob_token_ids)
                called = state.streamer is not None and state.streamer.called
                yield chunk([chat_choice(
                    c.index, delta, logprobs, reply.tools.finish_reason(c.finish_reason, called), c.stop_reason,
                    state.token_ids if request.return_token_ids else None,
                )], usage_now())
                state.token_ids, state.logprobs = [], []
        if request.usage_in_stream:
            usage = self.usage_info(len(reply.prompt_token_ids), completion_tokens, cached)
            await self._count_reasoning(reply, usage, [state.text for state in choices.values()])
            yield chunk([], usage)

    async def _count_reasoning(self, reply: _Reply, usage: UsageInfo, texts: list[str]) -> None:
        """As vLLM, a server with a reasoning parser gives usage.completion_tokens_details with the
        reasoning's tokens (the reasoning text tokenized again), hidden by include_reasoning or not."""
        if not reply.shows_reasoning:
            return
        count = 0
        if reply.reasoning_parser is not None:
            for text in texts:
                reasoning = reply.reasoning_parser().split(text, final=True).reasoning
                count += len(await self.engine.tokenize(reasoning, False)) if reasoning else 0
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=count)

    @staticmethod
    def _delta(reply: _Reply, state: _ChoiceStream, c: CompletionOutput) -> dict[str, Any] | DeltaMessage | None:
        """What this output adds to the choice's message, or None if nothing is ready to send."""
        finished = c.finish_reason is not None
        if state.streamer is None and state.reasoning is None:
            return content_delta(c.text)
        reasoning, text = "", state.text
        if state.reasoning is not None:  # what follows the reasoning is the content (and the tool calls)
            reasoning, text = state.reasoning.update(state.text, finished)
            reasoning = reasoning if reply.request.include_reasoning else ""
        if state.streamer is None:
            content, calls = text[len(state.content_sent):], []
            state.content_sent = text
        else:
            content, calls = state.streamer.update(text, finished)
        if not reasoning and not content and not calls and not finished:
            return None
        if reasoning and not content and not calls:
            return reasoning_delta(reasoning)
        delta = DeltaMessage(content=content or None, reasoning=reasoning or None, reasoning_content=reasoning or None)
        if calls and reply.tools.legacy:
            first = [d for d in calls if d.index == 0]
            if first:
                delta.function_call = DeltaFunctionCall(name=first[0].name, arguments=first[0].arguments)
        elif calls:
            delta.tool_calls = [_delta_tool_call(d) for d in calls]
        return delta


def _delta_tool_call(d: ToolCallDelta) -> DeltaToolCall:
    if d.id is not None:  # a call's first delta: OpenAI's shape names it
        return DeltaToolCall(index=d.index, id=d.id, type="function",
                             function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
    return DeltaToolCall(index=d.index, function=DeltaFunctionCall(arguments=d.arguments))


@dataclass
class _Reply:
    """What the response of one chat request needs to know."""

    request: ChatCompletionRequest
    request_id: str
    tools: ToolPlan
    prompt_token_ids: list[int]
    prompt_text: str
    num_top: int
    echo: str  # the assistant message it continues, repeated in front of the reply (vLLM's echo)
    reasoning_parser: Callable[[], ReasoningParser] | None = None  # None: no reasoning to split off
    shows_reasoning: bool = False  # the server has a reasoning parser: messages carry `reasoning`

    def new_reasoning_streamer(self) -> ReasoningStreamer | None:
        return ReasoningStreamer(self.reasoning_parser()) if self.reasoning_parser is not None else None

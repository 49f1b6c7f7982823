"""POST /v1/chat/completions: the conversation is rendered with the model's chat template."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from compiled_llm.engine.async_llm import RequestStream
from compiled_llm.engine.chat_templates import ChatTemplateError
from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatLogProbsTop,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from compiled_llm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    event_stream,
    final_output,
    json_response,
    sse,
    usage_counts,
)
from compiled_llm.logger import init_logger
from compiled_llm.outputs import CompletionOutput
from compiled_llm.utils import random_uuid

logger = init_logger(__name__)


def chat_logprobs(output: CompletionOutput, num_top: int) -> ChatLogProbs:
    content = []
    for token_id, entry in zip(output.token_ids, output.logprobs or []):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        top = [
            ChatLogProbsTop(token=lp.decoded_token or "", logprob=max(lp.logprob, -9999.0),
                            bytes=list((lp.decoded_token or "").encode()))
            for lp in sorted(entry.values(), key=lambda lp: lp.rank or 0)
            if lp.rank is not None and lp.rank <= num_top
        ]
        content.append(ChatLogProbsContent(
            token=token, logprob=max(sampled.logprob, -9999.0), bytes=list(token.encode()), top_logprobs=top
        ))
    return ChatLogProbs(content=content)


def message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template expects it; content parts are joined (text only)."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(f"Only text content parts are supported, got type {part.get('type')!r}.",
                                  param="messages")
            texts.append(part["text"])
        content = "\n".join(texts)
    return {**(message.model_extra or {}), "role": message.role, "content": content or ""}


class OpenAIServingChat(OpenAIServing):
    async def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The conversation rendered and tokenized; a 400 for a template that fails or a text too long."""
        template_kwargs = dict(template_kwargs or {})
        if (chat_template is not None or "chat_template" in template_kwargs) and \
                not self.options.trust_request_chat_template:
            raise OpenAIError(
                "This server does not take chat templates from requests (a template is code); its operator can "
                "allow them with --trust-request-chat-template.", param="chat_template",
            )
        template_kwargs.pop("tokenize", None)
        try:
            return await self.engine.apply_chat_template(
                messages, add_generation_prompt, chat_template, **template_kwargs
            )
        except ChatTemplateError as e:  # the template rejected the conversation (roles, missing template, ...)
            raise OpenAIError(f"Could not apply the chat template: {e}", param="messages") from e
        except ValueError as e:  # rendered, but too long to fit
            raise OpenAIError(str(e), param="messages") from e

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        messages = [message_dict(m) for m in request.messages]
        text, ids = await self.render(messages, request.add_generation_prompt, request.chat_template,
                                      request.chat_template_kwargs)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        self.check_length(len(ids), max_tokens)
        num_top = request.top_logprobs or 0
        params = self.sampling_params(request, max_tokens, num_top if request.logprobs else None)
        request_id = f"chatcmpl-{random_uuid()}"
        stream = await self.add_request(request_id, {"prompt": text, "prompt_token_ids": ids}, params, request.priority)
        if request.stream:
            return event_stream(self._events(request, request_id, stream, len(ids)), [request_id], self.engine)
        return await json_response(raw_request, self._respond(request, request_id, stream, len(ids)), [request_id],
                                   self.engine)

    async def _respond(
        self, request: ChatCompletionRequest, request_id: str, stream: RequestStream, prompt_len: int
    ) -> ChatCompletionResponse:
        out = await final_output(stream)
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=chat_logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in out.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices,
            usage=UsageInfo(**usage_counts([prompt_len], completion_tokens)),
        )

    async def _events(
        self, request: ChatCompletionRequest, request_id: str, stream: RequestStream, prompt_len: int
    ) -> AsyncIterator[str]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created, model=self.served_model_name,
                                           choices=choices, usage=usage))

        completion_tokens = 0
        for index in range(request.n or 1):
            yield chunk([ChatCompletionStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for out in stream:
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                completion_tokens += len(c.token_ids)
                logprobs = chat_logprobs(c, request.top_logprobs or 0) if request.logprobs else None
                yield chunk([ChatCompletionStreamChoice(
                    index=c.index, delta=DeltaMessage(content=c.text), logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                )])
        if request.stream_options and request.stream_options.include_usage:
            yield chunk([], UsageInfo(**usage_counts([prompt_len], completion_tokens)))

"""POST /v1/completions: prompts as text, a list of texts, token ids or a list of token-id lists."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from compiled_llm.engine.async_llm import RequestStream
from compiled_llm.engine.processor import PromptType
from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
)
from compiled_llm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    event_stream,
    final_output,
    json_response,
    merge_streams,
    sse,
    usage_counts,
)
from compiled_llm.logger import init_logger
from compiled_llm.outputs import CompletionOutput
from compiled_llm.utils import random_uuid

logger = init_logger(__name__)


def completion_logprobs(output: CompletionOutput, num_top: int, text_offset: int) -> CompletionLogProbs:
    """OpenAI's legacy logprobs for the tokens of `output` (a delta or the whole completion)."""
    result = CompletionLogProbs()
    for token_id, entry in zip(output.token_ids, output.logprobs or []):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        result.tokens.append(token)
        result.token_logprobs.append(max(sampled.logprob, -9999.0))
        result.text_offset.append(text_offset)
        text_offset += len(token)
        # As vLLM: the sampled token first, then the `num_top` best (so up to num_top + 1 entries,
        # and the sampled token even where it ranks below them).
        top = {
            (lp.decoded_token or ""): max(lp.logprob, -9999.0)
            for lp in list(entry.values())[: num_top + 1]
        }
        result.top_logprobs.append(top)
    return result


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        prompts, prompt_lens = await self._prompts(request)
        params = self.sampling_params(request, request.max_tokens, request.logprobs)
        request_id = f"cmpl-{random_uuid()}"
        streams = await self.add_requests(request_id, prompts, params, request.priority)
        ids = [s.request_id for s in streams]
        if request.stream:
            return event_stream(self._events(request, request_id, streams, prompt_lens), ids, self.engine)
        return await json_response(raw_request, self._respond(request, request_id, streams, prompt_lens), ids,
                                   self.engine)

    async def _prompts(self, request: CompletionRequest) -> tuple[list[PromptType], list[int]]:
        raw = request.prompt
        if isinstance(raw, str):
            items: list = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise OpenAIError("prompt must not be empty.", param="prompt")
        prompts: list[PromptType] = []
        lens: list[int] = []
        for item in items:
            if isinstance(item, str):
                ids = await self.tokenize(item, request.add_special_tokens)
                prompts.append({"prompt": item, "prompt_token_ids": ids})
            else:
                ids = list(item)
                prompts.append({"prompt_token_ids": ids})
            self.check_length(len(ids), request.max_tokens)
            lens.append(len(ids))
        return prompts, lens

    async def _respond(
        self, request: CompletionRequest, request_id: str, streams: list[RequestStream], prompt_lens: list[int]
    ) -> CompletionResponse:
        finals = await asyncio.gather(*(final_output(s) for s in streams))
        n = request.n or 1
        choices = []
        completion_tokens = 0
        for i, out in enumerate(finals):
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = completion_logprobs(c, request.logprobs, 0) if request.logprobs is not None else None
                choices.append(CompletionResponseChoice(
                    index=i * n + c.index, text=c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                ))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=request_id, model=self.served_model_name, choices=choices,
            usage=UsageInfo(**usage_counts(prompt_lens, completion_tokens)),
        )

    async def _events(
        self, request: CompletionRequest, request_id: str, streams: list[RequestStream], prompt_lens: list[int]
    ) -> AsyncIterator[str]:
        n = request.n or 1
        created = int(time.time())
        offsets: dict[int, int] = {}
        completion_tokens = 0
        async for i, out in merge_streams(streams):
            for c in out.outputs:
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                index = i * n + c.index
                completion_tokens += len(c.token_ids)
                logprobs = None
                if request.logprobs is not None:
                    logprobs = completion_logprobs(c, request.logprobs, offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + len(c.text)
                yield sse(CompletionResponse(
                    id=request_id, created=created, model=self.served_model_name,
                    choices=[CompletionResponseChoice(
                        index=index, text=c.text, logprobs=logprobs,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    )],
                ))
        if request.stream_options and request.stream_options.include_usage:
            yield sse(CompletionResponse(
                id=request_id, created=created, model=self.served_model_name, choices=[],
                usage=UsageInfo(**usage_counts(prompt_lens, completion_tokens)),
            ))

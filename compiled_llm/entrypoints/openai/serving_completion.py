"""POST /v1/completions: prompts as text, a list of texts, token ids or a list of token-id lists.

`echo` puts the prompt in front of each choice's text; with `logprobs` the prompt's tokens get
their logprobs too, from the engine's prompt logprobs (the first token has none). `echo` with
`max_tokens: 0` is lm-eval's way of scoring a text: the prompt comes back, nothing is generated.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from compiled_llm.engine.async_llm import RequestStream
from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.logprobs import completion_logprobs, echo_logprobs, prompt_logprobs_out
from compiled_llm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from compiled_llm.entrypoints.openai.serving_engine import (
    DONE,
    OpenAIServing,
    event_stream,
    final_output,
    json_response,
    merge_streams,
    sse,
)
from compiled_llm.entrypoints.openai.stream_events import completion_choice, completion_chunk
from compiled_llm.entrypoints.openai.structured_outputs import requested_structured_outputs
from compiled_llm.logger import init_logger
from compiled_llm.outputs import CompletionOutput, RequestOutput
from compiled_llm.sampling_params import SamplingParams

logger = init_logger(__name__)


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # None when given as token ids or cut: decoded only if echoed


@dataclass
class CompletionPlan:
    """What one completion request asks of the engine and of the response."""

    request: CompletionRequest
    request_id: str
    prompts: list[Prompt]
    params: SamplingParams
    num_top: int | None  # logprobs per token, None without logprobs

    @property
    def n(self) -> int:
        return self.request.n or 1

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)


# vLLM's words, which its clients and tests match.
EMPTY_PROMPT = "Either prompt or prompt_embeds must be provided and non-empty."


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        structured = requested_structured_outputs(request)
        prompts = await self._prompts(request)
        num_top = self.logprobs_count(request.logprobs, "logprobs")
        prompt_logprobs = self.logprobs_count(request.prompt_logprobs, "prompt_logprobs", "prompt")
        if prompt_logprobs is None and request.echo and num_top is not None:
            prompt_logprobs = num_top  # as vLLM: echoed logprobs are the prompt's
        max_tokens = request.max_tokens
        if request.echo_without_generation:
            if prompt_logprobs is None:  # nothing for the engine to compute
                return await self._echo_only(request, prompts)
        for prompt in prompts:
            self.check_length(len(prompt.token_ids), max_tokens)
        params = self.sampling_params(request, max_tokens, num_top, prompt_logprobs, structured)
        plan = CompletionPlan(request, f"cmpl-{self.base_request_id(request)}", prompts, params, num_top)
        for prompt in prompts:
            if request.echo and prompt.text is None:
                prompt.text = await self.engine.detokenize(prompt.token_ids)
        engine_prompts = [{"prompt": p.text, "prompt_token_ids": p.token_ids} for p in prompts]
        if request.use_beam_search:
            streams = self.beam_search_streams(plan.request_id, engine_prompts, request, max_tokens, num_top,
                                               structured)
        else:
            streams = await self.add_requests(plan.request_id, engine_prompts, params, request.priority,
                                              self.lora_request(request.model))
        ids = [s.request_id for s in streams]
        if request.stream:
            return event_stream(self._events(plan, streams), ids, self.engine)
        return await json_response(raw_request, self._respond(plan, streams), ids, self.engine)

    async def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        raw = request.prompt
        if raw is None:
            raise OpenAIError(EMPTY_PROMPT, param="prompt")
        if isinstance(raw, str):
            items: list = [raw]
        elif raw and all(isinstance(t, int) for t in raw):
            items = [raw]
        else:
            items = list(raw)
        if not items:
            raise OpenAIError(EMPTY_PROMPT, param="prompt")
        prompts: list[Prompt] = []
        for item in items:
            if isinstance(item, str):
                ids = await self.tokenize(item, request.add_special_tokens)
                text: str | None = item
            else:
                ids, text = list(item), None
            if not ids:
                raise OpenAIError(EMPTY_PROMPT, param="prompt")
            cut = self.truncate(ids, request)
            prompts.append(Prompt(cut, text if len(cut) == len(ids) else None))
        return prompts

    # ---- responses -----------------------------------------------------------------------------
    def _choice_logprobs(self, plan: CompletionPlan, out: RequestOutput, c: CompletionOutput, prompt: Prompt,
                         echoing: bool, offset: int) -> CompletionLogProbs | None:
        if plan.num_top is None:
            return None
        as_ids = bool(plan.request.return_tokens_as_token_ids)
        result = None
        if echoing:
            result = echo_logprobs(prompt.token_ids, out.prompt_logprobs, plan.num_top, self.token_text, as_ids)
            offset = len(prompt.text or "")
        # With logprob_token_ids: every one of them beside the sampled token (vLLM), whatever `logprobs` says.
        num_top = len(plan.request.logprob_token_ids) if plan.request.logprob_token_ids else plan.num_top
        return completion_logprobs(c, num_top, offset, as_ids, result)

    def _choice_fields(self, plan: CompletionPlan, i: int, out: RequestOutput, c: CompletionOutput, echoing: bool,
                       offset: int = 0, first: bool = True) -> dict[str, Any]:
        """The fields of the choice `c` (of prompt `i`): a streamed event's choice as they are."""
        request = plan.request
        prompt = plan.prompts[i]
        text = (prompt.text or "") + c.text if echoing else c.text
        return completion_choice(
            i * plan.n + c.index, text, self._choice_logprobs(plan, out, c, prompt, echoing, offset),
            c.finish_reason, c.stop_reason,
            token_ids=list(c.token_ids) if request.return_token_ids else None,
            prompt_token_ids=prompt.token_ids if request.return_token_ids and first else None,
            prompt_logprobs=prompt_logprobs_out(out.prompt_logprobs) if request.prompt_logprobs is not None and first
            else None,
        )

    def _choice(self, plan: CompletionPlan, i: int, out: RequestOutput, c: CompletionOutput,
                echoing: bool) -> CompletionResponseChoice:
        return CompletionResponseChoice(**self._choice_fields(plan, i, out, c, echoing))

    async def _respond(self, plan: CompletionPlan, streams: list[RequestStream]) -> CompletionResponse:
        finals = await asyncio.gather(*(final_output(s) for s in streams))
        choices = []
        completion_tokens = cached = 0
        for i, out in enumerate(finals):
            cached += out.num_cached_tokens
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(self._choice(plan, i, out, c, bool(plan.request.echo)))
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=plan.request_id, model=self.model_name(plan.request.model), choices=choices,
            usage=self.usage_info(plan.num_prompt_tokens, completion_tokens, cached),
        )

    async def _echo_only(self, request: CompletionRequest, prompts: list[Prompt]) -> Response:
        """`echo` with `max_tokens: 0` and no logprobs: the prompts back, without the engine."""
        n = request.n or 1
        choices = []
        for i, prompt in enumerate(prompts):
            text = prompt.text if prompt.text is not None else await self.engine.detokenize(prompt.token_ids)
            for j in range(n):
                choices.append(CompletionResponseChoice(
                    index=i * n + j, text=text, finish_reason="length",
                    token_ids=[] if request.return_token_ids else None,
                    prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
                ))
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        response = CompletionResponse(id=f"cmpl-{self.base_request_id(request)}", model=self.model_name(request.model),
                                      choices=choices, usage=self.usage_info(num_prompt_tokens, 0))
        if not request.stream:
            return JSONResponse(response.model_dump())

        async def events() -> AsyncIterator[str]:
            for choice in choices:
                yield sse(response.model_copy(update={"choices": [choice], "usage": None}))
            if request.usage_in_stream:
                yield sse(response.model_copy(update={"choices": []}))
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _events(self, plan: CompletionPlan, streams: list[RequestStream]) -> AsyncIterator[str]:
        request = plan.request
        created = int(time.time())
        model = self.model_name(request.model)  # once a stream, not once a chunk
        offsets: dict[int, int] = {}
        started: set[int] = set()
        completion_tokens = cached = 0
        cached_seen: dict[int, int] = {}
        async for i, out in merge_streams(streams):
            cached_seen[i] = out.num_cached_tokens
            cached = sum(cached_seen.values())
            for c in out.outputs:
                index = i * plan.n + c.index
                first = index not in started
                if not c.text and not c.token_ids and c.finish_reason is None and not (first and request.echo):
                    continue
                started.add(index)
                completion_tokens += len(c.token_ids)
                echoing = first and bool(request.echo)
                choice = self._choice_fields(plan, i, out, c, echoing, offsets.get(index, 0), first)
                offsets[index] = offsets.get(index, 0) + len(choice["text"])
                usage = None
                if request.usage_in_every_chunk:
                    usage = self.usage_info(plan.num_prompt_tokens, completion_tokens, cached)
                yield completion_chunk(plan.request_id, created, model, [choice], usage)
        if request.usage_in_stream:
            yield completion_chunk(plan.request_id, created, model, [],
                                   self.usage_info(plan.num_prompt_tokens, completion_tokens, cached))

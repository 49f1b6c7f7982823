"""What the completion and chat handlers share: model and length checks, turning the engine's
ValueErrors into 400s, server-sent events, and aborting requests whose client went away."""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from compiled_llm.engine.async_llm import AsyncLLM, RequestStream
from compiled_llm.engine.core_client import EngineDeadError
from compiled_llm.engine.processor import PromptType
from compiled_llm.engine.tokenizer import TokenTexts
from compiled_llm.entrypoints.beam_search import BeamSearch, BeamSearchStream
from compiled_llm.entrypoints.chat_utils import load_chat_template
from compiled_llm.entrypoints.openai.errors import OpenAIError, engine_dead_message, error_body
from compiled_llm.entrypoints.openai.protocol import (
    PromptTokensDetails,
    RequestModel,
    SamplingRequest,
    StreamOptions,
    UsageInfo,
)
from compiled_llm.entrypoints.openai.server_args import ServerArgs
from compiled_llm.entrypoints.openai.serving_models import ServedModels
from compiled_llm.logger import init_logger
from compiled_llm.lora.request import LoRARequest
from compiled_llm.outputs import RequestOutput
from compiled_llm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from compiled_llm.utils import random_uuid

T = TypeVar("T")
logger = init_logger(__name__)

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def sse_error(error: BaseException) -> str:
    """The event a stream ends with when it cannot finish (then `[DONE]`)."""
    if isinstance(error, EngineDeadError):
        body = error_body(engine_dead_message(error), 503, code="engine_dead")
    elif isinstance(error, ValueError):  # the engine refused the request
        body = error_body(str(error), 400)
    else:
        body = error_body(f"Internal server error: {type(error).__name__}: {error}", 500)
    return f"data: {json.dumps(body.model_dump())}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_name: str, server_args: ServerArgs | None = None) -> None:
        """`server_args`: what the operator allows a request to ask for (`--max-n`, a request's own
        chat template, automatic tool choice)."""
        self.engine = engine
        self.served_model_name = served_model_name
        self.server_args = server_args or ServerArgs()
        self.chat_template = load_chat_template(self.server_args.chat_template)  # None: the model's own
        self.max_model_len = engine.model_config.max_model_len
        self.token_text = TokenTexts(engine.tokenizer)
        # The names a request may give (the server shares one with its LoRA adapters among its APIs).
        self.models = ServedModels(engine, served_model_name)

    def usage_info(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return usage_info(prompt_tokens, completion_tokens, cached_tokens,
                          details=self.server_args.enable_prompt_tokens_details)

    def check_model(self, model: str | None) -> None:
        """The base model or one of its LoRA adapters; another name is a 404."""
        self.models.lora_request(model)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        return self.models.lora_request(model)

    def model_name(self, model: str | None) -> str:
        """The `model` a response names: the adapter a request ran with, else the base model (as vLLM)."""
        return model if model is not None and model in self.models.adapters else self.served_model_name

    def check_fields(self, request: RequestModel, model: str | None) -> None:
        """The model is this server's, no field it does not implement is set, and the fields no
        API defines are logged (then ignored, as vLLM does)."""
        self.check_model(model)
        refused = request.refused_field()
        if refused is not None:
            raise OpenAIError(f"`{refused}` is not supported by this server.", param=refused)
        ignored = request.ignored_fields()
        if ignored:
            logger.warning("The following fields were present in the request but ignored: %s", ignored[:20])

    def check_request(self, request: SamplingRequest) -> None:
        self.check_fields(request, request.model)
        problem = request.unsupported()
        if problem is not None:
            raise OpenAIError(problem)
        if request.use_beam_search and self.lora_request(request.model) is not None:
            raise OpenAIError("use_beam_search is not supported with a LoRA adapter.", param="use_beam_search")
        for name, value in (("n", request.n), ("best_of", request.best_of)):
            if value is not None and value > self.server_args.max_n:
                raise OpenAIError(
                    f"{name} must be at most {self.server_args.max_n} (the server's --max-n), got {value}.", param=name
                )
        bad = [t for t in (request.logit_bias_ids() or {}) if t >= self.engine.processor.vocab_size]
        if bad:
            raise OpenAIError(f"logit_bias names token{'s' if len(bad) > 1 else ''} {', '.join(map(str, bad))}, "
                              f"out of vocabulary (size {self.engine.processor.vocab_size}).", param="logit_bias")
        if request.return_tokens_as_token_ids is None:
            request.return_tokens_as_token_ids = self.server_args.return_tokens_as_token_ids
        if self.server_args.enable_force_include_usage and request.stream:
            request.stream_options = StreamOptions(include_usage=True, continuous_usage_stats=True)

    def logprobs_count(self, value: int | None, param: str, kind: str = "sample") -> int | None:
        """A request's logprobs count, -1 read as the whole vocabulary (vLLM's meaning), within the
        server's --max-logprobs (-1 there: no limit but the vocabulary)."""
        if value is None:
            return None
        vocab = self.engine.processor.vocab_size
        limit = self.engine.model_config.max_logprobs
        limit = vocab if limit == -1 else limit
        count = vocab if value == -1 else value
        if count > limit:
            raise OpenAIError(f"Requested {kind} logprobs of {count}, which is greater than max allowed: {limit} "
                              "(the server's --max-logprobs).", param=param)
        return count

    def truncate(self, ids: list[int], request: SamplingRequest) -> list[int]:
        """`truncate_prompt_tokens`: the last k tokens (the first k with truncation_side right)."""
        k = request.truncate_prompt_tokens
        if k is None:
            return ids
        k = self.max_model_len if k == -1 else k
        if k > self.max_model_len:
            raise OpenAIError(f"truncate_prompt_tokens ({k}) is greater than max_model_len ({self.max_model_len}): "
                              "choose a smaller truncation size.", param="truncate_prompt_tokens")
        return ids[:k] if request.truncation_side == "right" else ids[-k:]

    async def tokenize(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        try:
            return await self.engine.tokenize(text, add_special_tokens)
        except ValueError as e:
            raise OpenAIError(str(e), param=param) from e

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """A prompt that fits, asking for more tokens than fit after it, is a 400 (as in vLLM).
        A prompt that does not fit at all is the Processor's 400, with its own message."""
        if max_tokens is None or num_prompt_tokens > self.max_model_len:
            return
        if num_prompt_tokens + max_tokens > self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or of the completion.",
                param="max_tokens", code="context_length_exceeded",
            )

    @staticmethod
    def sampling_params(
        request: SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The engine's params for `request` (a 400 for out-of-range values)."""
        try:
            return SamplingParams(
                n=1 if request.n is None else request.n,
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=0 if request.top_k is None else request.top_k,
                min_p=0.0 if request.min_p is None else request.min_p,
                presence_penalty=request.presence_penalty or 0.0,
                frequency_penalty=request.frequency_penalty or 0.0,
                repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
                seed=request.seed,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=request.logit_bias_ids(),
                logprob_token_ids=request.logprob_token_ids,
                allowed_token_ids=request.allowed_token_ids,
                structured_outputs=structured_outputs,
                skip_special_tokens=request.skip_special_tokens,
                spaces_between_special_tokens=request.spaces_between_special_tokens,
                include_stop_str_in_output=request.include_stop_str_in_output,
                output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as e:
            raise OpenAIError(str(e)) from e

    @staticmethod
    def base_request_id(request: SamplingRequest) -> str:
        """vLLM's: the client's `request_id` if it gave one, else a fresh one."""
        return request.request_id or random_uuid()

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        try:
            return await self.engine.add_request(request_id, prompt, params, priority, lora_request)
        except ValueError as e:
            raise OpenAIError(str(e)) from e

    async def add_requests(
        self, request_id: str, prompts: list[PromptType], params: SamplingParams, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestStream]:
        """All or nothing: if one prompt is refused, the ones already sent are aborted."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await self.add_request(f"{request_id}-{i}", prompt, params, priority, lora_request))
        except BaseException:
            await self.engine.abort([s.request_id for s in streams])
            raise
        return streams

    def beam_search_streams(
        self, request_id: str, prompts: list[dict], request: SamplingRequest, max_tokens: int | None,
        num_logprobs: int | None, structured_outputs: StructuredOutputsParams | None,
    ) -> list[BeamSearchStream]:
        """vLLM's `use_beam_search`: a search n beams wide per prompt (each prompt's room in the
        context when `max_tokens` is None); a 400 for what beam search cannot do."""
        if structured_outputs is not None:
            raise OpenAIError("Structured outputs (response_format, structured_outputs, a tool_choice that forces a "
                              "call) are not supported with use_beam_search.", param="use_beam_search")
        streams = []
        for i, prompt in enumerate(prompts):
            ids = prompt["prompt_token_ids"]
            room = self.max_model_len - len(ids)
            try:
                params = request.to_beam_search_params(room if max_tokens is None else max_tokens)
                search = BeamSearch(ids, params, self.engine.model_config, num_logprobs or 0)
            except ValueError as e:
                raise OpenAIError(str(e)) from e
            streams.append(BeamSearchStream(self.engine, f"{request_id}-{i}", prompt.get("prompt"), search,
                                            request.priority))
        return streams


def event_stream(events: AsyncIterator[str], request_ids: list[str], engine: AsyncLLM) -> StreamingResponse:
    """A streaming response: the server-sent `events`, then `[DONE]`. An error mid-way ends it with
    an error event first; however it ends (the client gone included), its requests are aborted."""

    async def body() -> AsyncIterator[str]:
        try:
            try:
                async for event in events:
                    yield event
            except Exception as e:
                logger.error("Stream %s failed: %s", request_ids[0] if request_ids else "?", e)
                yield sse_error(e)
            yield DONE
        finally:
            await engine.abort(request_ids)

    return StreamingResponse(body(), media_type="text/event-stream")


async def json_response(raw_request: Request, work: Awaitable[BaseModel | Response], request_ids: list[str],
                        engine: AsyncLLM) -> Response:
    """A whole response, computed unless the client goes away first (then 499 and its requests
    aborted rather than generated for nobody); a body the work built itself (binary) as it is."""
    try:
        response = await unless_disconnected(raw_request, work)
    finally:
        await engine.abort(request_ids)
    if response is None:
        return Response(status_code=499)
    if isinstance(response, Response):
        return response
    return JSONResponse(response.model_dump())


async def final_output(stream: RequestStream) -> RequestOutput:
    last = None
    try:
        async for output in stream:
            last = output
    except EngineDeadError:
        raise
    except ValueError as e:  # the engine refused the request
        raise OpenAIError(str(e)) from e
    assert last is not None
    return last


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                i = pending.pop(future)
                try:
                    output = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for future in pending:
            future.cancel()


async def _client_gone(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(raw_request: Request, work: Awaitable[T]) -> T | None:
    """Run `work` (a non-streaming response) but cancel it if the client disconnects first, so
    its requests are aborted rather than generated for nobody. None: the client is gone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_client_gone(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return None


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, *,
               details: bool = False) -> UsageInfo:
    """`details`: add prompt_tokens_details (the server's --enable-prompt-tokens-details)."""
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens) if details else None)

"""POST /v1/embeddings, and what every pooling route shares: turning the input (texts, token ids,
or a conversation) into prompts, sending them to a pooling engine as one batch, and encoding the
vectors (`float`, or `base64` of little-endian float32 values, as OpenAI's clients decode them).

A pooling route on a server that generates (or a generating route on a pooling server) is a 400
naming the flag that serves it.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.pooling_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingBaseRequest,
)
from compiled_llm.entrypoints.openai.protocol import RequestModel, UsageInfo
from compiled_llm.entrypoints.openai.server_args import ServerArgs
from compiled_llm.entrypoints.openai.serving_chat import OpenAIServingChat
from compiled_llm.entrypoints.openai.serving_engine import OpenAIServing, final_output, json_response
from compiled_llm.outputs import PoolingRequestOutput
from compiled_llm.pooling_params import PoolingParams
from compiled_llm.utils import random_uuid

NOT_POOLING = ("This model is served to generate text; the pooling APIs (embeddings, pooling, score, rerank) "
               "need a server started with --runner pooling --convert embed.")


def encode_vector(values: Any, encoding_format: str) -> list[float] | str:
    """A vector as JSON floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return values.tolist()


def pooling_usage(num_prompt_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)


class OpenAIServingPoolingBase(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_name: str, server_args: ServerArgs | None = None) -> None:
        super().__init__(engine, served_model_name, server_args)
        self.chat = OpenAIServingChat(engine, served_model_name, server_args)  # renders chat-style input

    def check_pooling(self, request: RequestModel, model: str | None) -> None:
        self.check_fields(request, model)
        if self.engine.model_config.runner != "pooling":
            raise OpenAIError(NOT_POOLING)
        if self.lora_request(model) is not None:
            raise OpenAIError(f"The model `{model}` is a LoRA adapter: pooling with adapters is not supported.",
                              param="model")

    def pooling_params(self, task: str, dimensions: int | None = None, normalize: bool | None = None) -> PoolingParams:
        """The request's params, checked against the model (`dimensions` where it allows them): a 400 if not."""
        try:
            params = PoolingParams(task=task, dimensions=dimensions, normalize=normalize)
            params.verify(self.engine.model_config.hf_config.hidden_size, self.engine.model_config.hf_config)
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions" if dimensions is not None else None) from e
        return params

    async def prompts(self, request: PoolingBaseRequest) -> list[list[int]]:
        """The request's prompts as token ids, truncated as it asks."""
        if request.messages is not None:
            kwargs = dict(request.chat_template_kwargs or {})
            if request.continue_final_message:
                kwargs["continue_final_message"] = True
            _, ids = await self.chat.render(request.messages, request.add_generation_prompt, request.chat_template,
                                            kwargs, bool(request.add_special_tokens))
            return [self.truncate(ids, request)]  # type: ignore[arg-type]
        value = request.input
        if isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], int)):
            value = [value]  # type: ignore[list-item]
        if not value:
            raise OpenAIError("input must not be empty.", param="input")
        special = True if request.add_special_tokens is None else request.add_special_tokens
        prompts = []
        for item in value:  # type: ignore[union-attr]
            ids = await self.tokenize(item, special, "input") if isinstance(item, str) else list(item)
            if not ids:
                raise OpenAIError("input must not hold an empty text or token list.", param="input")
            prompts.append(self.truncate(ids, request))  # type: ignore[arg-type]
        return prompts

    async def pool(self, request_id: str, prompts: list[list[int]], params: PoolingParams,
                   priority: int = 0) -> list[PoolingRequestOutput]:
        """Every prompt's output, in order (sent together: the engine batches them)."""
        streams = await self.add_requests(request_id, prompts, params, priority)  # type: ignore[arg-type]
        try:
            return list(await asyncio.gather(*(final_output(s) for s in streams)))  # type: ignore[arg-type]
        finally:
            await self.engine.abort([s.request_id for s in streams])

    async def respond(self, raw_request: Request, work: Any) -> Response:
        """A JSON response, abandoned (and its requests aborted by `pool`) if the client goes away."""
        return await json_response(raw_request, work, [], self.engine)


class OpenAIServingEmbedding(OpenAIServingPoolingBase):
    async def create_embedding(self, request: EmbeddingRequest, raw_request: Request) -> Response:
        self.check_pooling(request, request.model)
        params = self.pooling_params("embed", request.dimensions, request.normalize)
        prompts = await self.prompts(request)
        request_id = f"embd-{request.request_id or random_uuid()}"

        async def work() -> EmbeddingResponse:
            outputs = await self.pool(request_id, prompts, params, request.priority)
            data = [EmbeddingResponseData(index=i, embedding=encode_vector(o.outputs.data.numpy(),
                                                                           request.encoding_format))
                    for i, o in enumerate(outputs)]
            return EmbeddingResponse(id=request_id, model=self.served_model_name, data=data,
                                     usage=pooling_usage(sum(len(p) for p in prompts)))

        return await self.respond(raw_request, work())

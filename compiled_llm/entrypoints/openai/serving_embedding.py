"""POST /v1/embeddings, and what every pooling route shares: turning the input (texts, token ids,
or a conversation) into prompts, sending them to a pooling engine as one batch, and encoding the
vectors as vLLM does: `float` (JSON), `base64` of the binary vector, or the binary vectors as the
body (`bytes`, their layout in a `metadata` header, or `bytes_only`); binary in the request's
`embed_dtype` and `endianness` (float32, native: what OpenAI's clients decode).

A pooling route on a server that generates (or a generating route on a pooling server) is a 400
naming the flag that serves it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from typing import Any

import torch
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


_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_UINT_DTYPES = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}


def vector_bytes(values: torch.Tensor, embed_dtype: str = "float32", endianness: str = "native") -> bytes:
    """A vector's values cast to `embed_dtype`, in the byte order asked (native: this machine's)."""
    cast = values.to(_TORCH_DTYPES[embed_dtype]).flatten()
    array = cast.view(_UINT_DTYPES[cast.element_size()]).numpy()  # numpy has no bfloat16 / fp8
    if endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return array.tobytes()


def encode_vector(values: torch.Tensor, request: PoolingBaseRequest) -> list[float] | str:
    """A vector as JSON floats, or base64 of its bytes (the JSON encodings; bytes: `bytes_response`)."""
    if request.encoding_format == "base64":
        return base64.b64encode(vector_bytes(values, request.embed_dtype, request.endianness)).decode("ascii")
    return values.tolist()


def bytes_response(request_id: str, model: str, outputs: list[PoolingRequestOutput],
                   request: PoolingBaseRequest) -> Response:
    """vLLM's binary answer: the vectors' bytes end to end as the body; for `bytes`, a `metadata`
    header (JSON) says where each one lies, its dtype, byte order and shape, and the usage."""
    chunks, items = [], []
    for i, output in enumerate(outputs):
        data = vector_bytes(output.outputs.data, request.embed_dtype, request.endianness)
        start = sum(len(c) for c in chunks)
        items.append({"index": i, "embed_dtype": request.embed_dtype, "endianness": request.endianness,
                      "start": start, "end": start + len(data), "shape": list(output.outputs.data.shape)})
        chunks.append(data)
    headers = None
    if request.encoding_format == "bytes":
        tokens = sum(len(o.prompt_token_ids) for o in outputs)
        headers = {"metadata": json.dumps({"id": request_id, "created": int(time.time()), "model": model,
                                           "data": items, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})}
    return Response(b"".join(chunks), headers=headers, media_type="application/octet-stream")


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
        params = self.pooling_params("embed", request.dimensions, request.normalize_asked())
        prompts = await self.prompts(request)
        request_id = f"embd-{request.request_id or random_uuid()}"

        async def work() -> EmbeddingResponse | Response:
            outputs = await self.pool(request_id, prompts, params, request.priority)
            if request.encoding_format in ("bytes", "bytes_only"):
                return bytes_response(request_id, self.served_model_name, outputs, request)
            data = [EmbeddingResponseData(index=i, embedding=encode_vector(o.outputs.data, request))
                    for i, o in enumerate(outputs)]
            return EmbeddingResponse(id=request_id, model=self.served_model_name, data=data,
                                     usage=pooling_usage(sum(len(p) for p in prompts)))

        return await self.respond(raw_request, work())

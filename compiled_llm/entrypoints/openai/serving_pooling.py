"""vLLM's other pooling routes: `/pooling` (the pooled hidden state), `/score` and `/rerank` (for
an embed model, as vLLM: the cosine similarity of the two texts' embeddings; rerank orders the
documents by it, Jina/Cohere shape) and `/classify` (a 400 here: no model served here has a
classification head)."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from compiled_llm.entrypoints.openai.errors import OpenAIError
from compiled_llm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from compiled_llm.entrypoints.openai.serving_embedding import (
    OpenAIServingPoolingBase,
    bytes_response,
    encode_vector,
    pooling_usage,
)
from compiled_llm.entrypoints.score_utils import cosine_score, pair_up
from compiled_llm.outputs import PoolingRequestOutput
from compiled_llm.utils import random_uuid

# /pooling's tasks here: `encode` (the pooled hidden state; the default), `embed`, and `token_embed`
# (an embedding per prompt token). vLLM's token_classify and classify need a head no model here has.
POOLING_ROUTE_TASKS = ("embed", "encode", "token_embed")


class OpenAIServingPooling(OpenAIServingPoolingBase):
    async def create_pooling(self, request: PoolingRequest, raw_request: Request) -> Response:
        self.check_pooling(request, request.model)
        task = request.task or "encode"
        if task not in POOLING_ROUTE_TASKS:
            raise OpenAIError(f"Unsupported task: {task!r} Supported tasks: {list(POOLING_ROUTE_TASKS)}",
                              param="task")
        params = self.pooling_params(task, request.dimensions, request.normalize_asked())
        prompts = await self.prompts(request)
        request_id = f"pool-{request.request_id or random_uuid()}"

        async def work() -> PoolingResponse | Response:
            outputs = await self.pool(request_id, prompts, params, request.priority)
            if request.encoding_format in ("bytes", "bytes_only"):
                return bytes_response(request_id, self.served_model_name, outputs, request)
            data = [PoolingResponseData(index=i, data=encode_vector(o.outputs.data, request))
                    for i, o in enumerate(outputs)]
            return PoolingResponse(id=request_id, model=self.served_model_name, data=data,
                                   usage=pooling_usage(sum(len(p) for p in prompts)))

        return await self.respond(raw_request, work())

    async def _embed_texts(self, request_id: str, texts: list[str], request: ScoreRequest | RerankRequest,
                           param: str) -> dict[str, PoolingRequestOutput]:
        """Each distinct text's embedding (a text on both sides is embedded once)."""
        distinct = list(dict.fromkeys(texts))
        prompts = []
        for text in distinct:
            ids = await self.tokenize(text, True, param)
            if not ids:
                raise OpenAIError(f"{param} must not hold an empty text.", param=param)
            prompts.append(self.truncate(ids, request))  # type: ignore[arg-type]
        outputs = await self.pool(request_id, prompts, self.pooling_params("embed"), request.priority)
        return dict(zip(distinct, outputs))

    async def create_score(self, request: ScoreRequest, raw_request: Request) -> Response:
        self.check_pooling(request, request.model)
        try:
            pairs = pair_up(request.text_1, request.text_2)
        except ValueError as e:
            raise OpenAIError(str(e), param="text_2") from e
        request_id = f"score-{request.request_id or random_uuid()}"

        async def work() -> ScoreResponse:
            embedded = await self._embed_texts(request_id, [t for pair in pairs for t in pair], request, "text_1")
            data = [ScoreResponseData(index=i, score=cosine_score(embedded[a].outputs.data, embedded[b].outputs.data))
                    for i, (a, b) in enumerate(pairs)]
            tokens = sum(len(embedded[a].prompt_token_ids) + len(embedded[b].prompt_token_ids) for a, b in pairs)
            return ScoreResponse(id=request_id, model=self.served_model_name, data=data, usage=pooling_usage(tokens))

        return await self.respond(raw_request, work())

    async def do_rerank(self, request: RerankRequest, raw_request: Request) -> Response:
        self.check_pooling(request, request.model)
        documents = request.document_texts()
        if not documents:
            raise OpenAIError("documents must hold at least one document.", param="documents")
        request_id = f"rerank-{request.request_id or random_uuid()}"

        async def work() -> RerankResponse:
            embedded = await self._embed_texts(request_id, [request.query, *documents], request, "documents")
            query = embedded[request.query]
            scores = [cosine_score(query.outputs.data, embedded[d].outputs.data) for d in documents]
            order = sorted(range(len(documents)), key=lambda i: -scores[i])
            if request.top_n:
                order = order[: request.top_n]
            results = [RerankResult(index=i, relevance_score=scores[i],
                                    document=RerankDocument(text=documents[i]) if request.return_documents else None)
                       for i in order]
            tokens = sum(len(query.prompt_token_ids) + len(embedded[d].prompt_token_ids) for d in documents)
            return RerankResponse(id=request_id, model=self.served_model_name, usage=RerankUsage(total_tokens=tokens),
                                  results=results)

        return await self.respond(raw_request, work())

    async def create_classify(self, request: ClassificationRequest, raw_request: Request) -> Response:
        self.check_pooling(request, request.model)
        architecture = self.engine.model_config.architecture
        raise OpenAIError(f"Classification needs a model with a classification head; {architecture} has none (it is "
                          "served converted to an embedder): use /v1/embeddings, /score or /rerank.")

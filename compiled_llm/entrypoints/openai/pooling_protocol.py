"""Request and response bodies of the pooling APIs (vLLM's names and fields): `/v1/embeddings`
(OpenAI's, with vLLM's extras), `/pooling`, `/score`, `/rerank` (Jina/Cohere shape) and
`/classify`. Kept apart from protocol.py, which holds the generating APIs."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal, Union

from pydantic import Field, model_validator

from compiled_llm.entrypoints.openai.protocol import (
    INT64_MAX,
    ChatMessage,
    LogprobsCount,
    OpenAIBaseModel,
    RequestModel,
    TokenId,
    UsageInfo,
)

# `input`: a text, texts, token ids, or lists of token ids (OpenAI's four forms).
EmbeddingInput = Union[str, list[str], list[TokenId], list[list[TokenId]]]
# vLLM's output encodings: JSON floats, base64 of the binary vector, or the binary vectors as the
# body (`bytes`: their layout in a `metadata` header; `bytes_only`: none, the client knows it).
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]


class PoolingBaseRequest(RequestModel):
    """What the embedding and pooling requests share: the input (completion style) or chat
    `messages` rendered with the chat template (vLLM's chat-style embedding request), the output's
    encoding and vLLM's extras."""

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {"mm_processor_kwargs": (), "cache_salt": (),
                                                     "softmax": (), "activation": ()}

    model: str | None = None
    input: EmbeddingInput | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"  # of base64 and bytes (float32: what OpenAI's client decodes)
    endianness: Endianness = "native"
    dimensions: int | None = Field(default=None, ge=1, le=INT64_MAX)
    user: str | None = None
    truncate_prompt_tokens: LogprobsCount | None = None  # keep the last k prompt tokens; -1: max_model_len
    truncation_side: Literal["left", "right"] | None = None
    # Completion style: the tokenizer's special tokens (BOS) in front (vLLM: on); chat style: off
    # (the template writes them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    normalize: bool | None = None  # None: the pooler config's (embeddings), off (pooling)
    use_activation: bool | None = None  # vLLM's newer name for `normalize`; wins over it
    priority: int = Field(default=0, ge=-(2**63), le=INT64_MAX)
    request_id: str | None = None

    @model_validator(mode="after")
    def _one_input(self) -> PoolingBaseRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of input (texts or token ids) and messages (a conversation)")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's context) or at least 1")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self

    def normalize_asked(self) -> bool | None:
        return self.use_activation if self.use_activation is not None else self.normalize


class EmbeddingRequest(PoolingBaseRequest):
    pass


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # a string: base64 of little-endian float32 values


class EmbeddingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


class PoolingRequest(PoolingBaseRequest):
    """vLLM's /pooling: the pooled hidden state as it is, unless `normalize` asks; `task: embed`
    pools as /v1/embeddings does. Any other task is a 400 naming the ones served (a string, not a
    literal: vLLM's message names the task refused)."""

    task: str | None = None


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    data: list[list[float]] | list[float] | str  # token_embed: a vector per token


class PoolingResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ScoreRequest(RequestModel):
    """vLLM's /score: `text_1` against each of `text_2` (1:N), or pairwise (N:N)."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: LogprobsCount | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = Field(default=0, ge=-(2**63), le=INT64_MAX)
    request_id: str | None = None


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIBaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankRequest(RequestModel):
    """vLLM's /rerank (Jina's and Cohere's shape): `documents` ordered by their score against `query`."""

    model: str | None = None
    query: str
    documents: list[str] | list[RerankDocument]
    top_n: int = Field(default=0, ge=0, le=INT64_MAX)  # 0: every document
    return_documents: bool = True
    truncate_prompt_tokens: LogprobsCount | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = Field(default=0, ge=-(2**63), le=INT64_MAX)
    request_id: str | None = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationRequest(RequestModel):
    model: str | None = None
    input: EmbeddingInput

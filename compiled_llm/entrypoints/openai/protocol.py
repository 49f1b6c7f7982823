"""Request and response bodies of the OpenAI API (pydantic), with vLLM's extra sampling fields.

Unknown fields are ignored, as OpenAI's clients send some we have no use for (`user`, ...);
fields we know but do not support are refused with a 400 rather than silently dropped.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from compiled_llm.sampling_params import RequestOutputKind, SamplingParams
from compiled_llm.utils import random_uuid

# Every integer a client sends must fit the int64 the engine stores it in: a bigger one would
# overflow there (and kill the engine) instead of being refused here.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


def first_unencodable(value: Any, path: str = "") -> str | None:
    """The path of the first string in `value` that is not valid Unicode (a lone surrogate, which
    JSON's \\uXXXX escapes can express): no tokenizer or UTF-8 encoder can take it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = first_unencodable(key, path) or first_unencodable(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = first_unencodable(item, f"{path}[{i}]")
            if found:
                return found
    return None


class OpenAIBaseModel(BaseModel):
    # Finite floats only: NaN and Infinity (which Python's JSON parser accepts) are no sampling knob.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _only_valid_unicode(cls, data: Any) -> Any:
        bad = first_unencodable(data)
        if bad is not None:
            raise ValueError(f"{bad} holds a string that is not valid Unicode (a lone UTF-16 surrogate)")
        return data


# ---- errors -----------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared pieces ----------------------------------------------------------------------------
class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat share: OpenAI's sampling knobs and vLLM's extras."""

    model: str | None = None
    n: NonNegInt64 | None = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[TokenId] | None = None
    priority: Int64 = 0  # lower first, under --scheduling-policy priority

    def unsupported(self) -> str | None:
        """A field we refuse, with why; None when the request is fine."""
        if self.logit_bias:
            return "logit_bias is not supported."
        if self.stream_options is not None and not self.stream:
            return "stream_options can only be set when stream is true."
        return None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, stream: bool) -> SamplingParams:
        """Raises ValueError (-> 400) for out-of-range values."""
        return SamplingParams(
            n=1 if self.n is None else self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        )


# ---- /v1/completions --------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: Int64 | None = 16
    logprobs: NonNegInt64 | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: NonNegInt64 | None = None
    add_special_tokens: bool = True  # vLLM's extra

    def unsupported(self) -> str | None:
        if self.echo:
            return "echo is not supported."
        if self.suffix:
            return "suffix is not supported."
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of other than n is not supported."
        return super().unsupported()


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ---------------------------------------------------------------------
class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the chat template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegInt64 | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extras
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if not self.messages:
            return "messages must hold at least one message."
        if self.tools:
            return "tools (function calling) are not supported."
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format other than text is not supported."
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs to be true."
        return super().unsupported()


class ChatLogProbsTop(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProbsTop):
    top_logprobs: list[ChatLogProbsTop] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer ------------------------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "compiled-llm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str

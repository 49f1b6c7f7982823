"""Request and response bodies of the OpenAI API (pydantic), with vLLM's extra fields.

Nothing a client asks for is silently dropped. A request field is either implemented, or named in
its class's `REFUSED` table (fields OpenAI or vLLM define that this server does not implement:
asking for anything but their no-op value is a 400 naming them), or unknown to both APIs: then it
is ignored and the server logs its name, as vLLM does (clients send some, such as `user`, that no
server acts on).
"""

from __future__ import annotations

import math
import time
from typing import Annotated, Any, Callable, ClassVar, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from compiled_llm.sampling_params import BeamSearchParams
from compiled_llm.utils import random_uuid

# Every integer a client sends must fit the int64 the engine stores it in: a bigger one would
# overflow there (and kill the engine) instead of being refused here.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
NonNegInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]
# A logprobs count: -1 is vLLM's "the whole vocabulary" (allowed up to --max-logprobs).
LogprobsCount = Annotated[int, Field(ge=-1, le=INT64_MAX)]
# Likewise a sampling knob must fit the float32 the sampler holds it in: a bigger one (1e39) is
# infinity there, which NaNs the logits (pydantic refuses NaN and Infinity themselves).
FLOAT32_MAX = 3.4028234663852886e38
Float32 = Annotated[float, Field(ge=-FLOAT32_MAX, le=FLOAT32_MAX)]
LOGIT_BIAS_LIMIT = 100.0


def _first_bad_leaf(value: Any, bad: Callable[[Any], bool], path: str, check_keys: bool) -> str | None:
    """The path of the first leaf (or, with `check_keys`, object key) of free-form JSON that `bad` refuses."""
    if isinstance(value, dict):
        for key, item in value.items():
            if check_keys and bad(key):
                return path or "body"
            found = _first_bad_leaf(item, bad, f"{path}.{key}" if path else str(key), check_keys)
            if found:
                return found
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _first_bad_leaf(item, bad, f"{path}[{i}]", check_keys)
            if found:
                return found
        return None
    return (path or "value") if bad(value) else None


def _not_unicode(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _unbounded(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not INT64_MIN <= value <= INT64_MAX
    return isinstance(value, float) and not math.isfinite(value)


def first_unencodable(value: Any, path: str = "") -> str | None:
    """The path of the first string in `value` that is not valid Unicode (a lone surrogate, which
    JSON's \\uXXXX escapes can express): no tokenizer or UTF-8 encoder can take it."""
    if isinstance(value, str) and not path:
        return "body" if _not_unicode(value) else None
    return _first_bad_leaf(value, _not_unicode, path, check_keys=True)


def first_unbounded_number(value: Any, path: str = "") -> str | None:
    """The path of the first number in free-form JSON that is no 64-bit integer or finite float."""
    return _first_bad_leaf(value, _unbounded, path, check_keys=False)


def _bounded_json(value: Any) -> Any:
    found = first_unbounded_number(value)
    if found is not None:
        raise ValueError(f"{found} must be a 64-bit integer or a finite number")
    return value


# Free-form JSON that reaches the engine (a JSON schema): its numbers must fit the engine's wire
# format (msgspec: 64-bit integers) and mean something (no NaN or Infinity, which a schema cannot hold).
JsonObject = Annotated[dict[str, Any], AfterValidator(_bounded_json)]
JsonSchemaOrText = Annotated[dict[str, Any] | str | None, AfterValidator(_bounded_json)]  # a schema, or its text


class OpenAIBaseModel(BaseModel):
    # Finite floats only: NaN and Infinity (which Python's JSON parser accepts) are no sampling knob.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _only_valid_unicode(cls, data: Any) -> Any:
        bad = first_unencodable(data)
        if bad is not None:
            raise ValueError(f"{bad} holds a string that is not valid Unicode (a lone UTF-16 surrogate)")
        return data


_NO_OP = (None, [], {}, "")


class RequestModel(OpenAIBaseModel):
    """A request body. Fields it does not declare are kept aside (`model_extra`) to be refused
    (`REFUSED`) or logged as ignored."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    # field -> values that ask for nothing (besides null, [], {} and ""): accepted as a no-op.
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    def refused_field(self) -> str | None:
        """The first field this server does not implement that the request sets to something."""
        for name, value in (self.model_extra or {}).items():
            if name in self.REFUSED and not any(value == v and type(value) is type(v) for v in _NO_OP) \
                    and value not in self.REFUSED[name]:
                return name
        return None

    def ignored_fields(self) -> list[str]:
        """Fields unknown to OpenAI's and vLLM's APIs alike (logged, then ignored)."""
        return sorted(name[:64] for name in (self.model_extra or {}) if name not in self.REFUSED)

    def __getattr__(self, name: str) -> Any:
        # pydantic hands out an undeclared field's raw JSON as an attribute; a check reading it
        # would take a client's list for the number it expects (a 500). What any code reads must be
        # a declared, typed field; the others are only ever compared, by `refused_field`.
        try:
            extra = object.__getattribute__(self, "__pydantic_extra__")
        except AttributeError:
            extra = None
        if extra and name in extra:
            raise AttributeError(f"{type(self).__name__} has no field {name!r} (it was sent, but is not declared: "
                                 "declare it, typed, to read it)")
        return super().__getattr__(name)


# ---- errors -----------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared pieces ----------------------------------------------------------------------------
class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class CompletionTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0  # output tokens of the reasoning (a server with a --reasoning-parser)


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk (with include_usage)


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBaseModel):
    """vLLM's `structured_outputs` object: exactly one of json, json_object, regex, choice, grammar."""

    json_: JsonSchemaOrText = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False  # JSON without free whitespace between its tokens
    # vLLM's options this server has no use for (one grammar engine, no fallback) or does not implement.
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: Any = None


def _logit_bias_keys(value: dict[str, float] | None) -> dict[str, float] | None:
    """Every bad entry named at once, so one round trip fixes them all."""
    # ASCII digits only: str.isdigit also takes "²", which int() does not.
    bad_keys = [key for key in value or {} if not (key.strip().isascii() and key.strip().isdigit())]
    bad_values = [f"{bias} for token {key}" for key, bias in (value or {}).items()
                  if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT]
    problems = []
    if bad_keys:
        problems.append(f"keys must be token ids (integers, as strings), got {', '.join(map(repr, bad_keys))}")
    if bad_values:
        problems.append(f"values must be in [-100, 100], got {', '.join(bad_values)}")
    if problems:
        raise ValueError("; ".join(problems))
    return value


class SamplingRequest(RequestModel):
    """The fields completions and chat share: OpenAI's sampling knobs and vLLM's extras."""

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        # OpenAI's
        "store": (False,), "service_tier": ("auto", "default"), "prediction": (), "audio": (),
        "modalities": (["text"],), "web_search_options": (), "verbosity": (), "reasoning_effort": (),
        # vLLM's
        "watermarking": (False,), "bad_words": (),
        "cache_salt": (), "kv_transfer_params": (), "ec_transfer_params": (), "vllm_xargs": (),
        "repetition_detection": (), "thinking_token_budget": (-1,), "stream_interval": (1,),
        "routed_experts_prompt_start": (0,), "return_token_offsets": (False,), "return_mm_kwargs": (True,),
        "mm_processor_kwargs": (), "media_io_kwargs": (), "prompt_embeds": (),
    }

    model: str | None = None
    n: NonNegInt64 | None = 1
    # Completions' (older vLLM chat requests carried it too): any value but n's is refused, as
    # there is no best-of selection here. Declared on chat too, so that it is never read untyped.
    best_of: NonNegInt64 | None = None
    temperature: Float32 | None = None
    top_p: Float32 | None = None
    presence_penalty: Float32 | None = None
    frequency_penalty: Float32 | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's identifiers of the end user or of the request's cache key: no server acts on them.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    min_p: Float32 | None = None
    repetition_penalty: Float32 | None = None
    ignore_eos: bool = False
    min_tokens: NonNegInt64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop_token_ids: list[TokenId] | None = None
    priority: Int64 = 0  # lower first, under --scheduling-policy priority
    # Beam search, n beams wide (entrypoints/beam_search.py)
    use_beam_search: bool = False
    length_penalty: Float32 = 1.0
    early_stopping: bool = False
    prompt_logprobs: LogprobsCount | None = None
    truncate_prompt_tokens: LogprobsCount | None = None  # keep the last k prompt tokens; -1: max_model_len
    truncation_side: Literal["left", "right"] | None = None  # left (default): keep the last k; right: the first
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    logprob_token_ids: list[TokenId] | None = None  # vLLM's: these ids' logprobs in place of the top ones
    allowed_token_ids: list[TokenId] | None = None  # vLLM's: sample among these ids only
    request_id: str | None = Field(default=None, max_length=256)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's older spellings of structured_outputs
    guided_json: JsonSchemaOrText = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    _check_logit_bias = field_validator("logit_bias")(classmethod(lambda cls, v: _logit_bias_keys(v)))

    def unsupported(self) -> str | None:
        """A combination of fields we refuse, with why; None when the request is fine."""
        if self.stream_options is not None and not self.stream:
            return "stream_options can only be set when stream is true."
        if self.prompt_logprobs is not None and self.stream and self.prompt_logprobs != 0:
            return "prompt_logprobs are not available when stream is true."
        if self.best_of is not None and self.best_of != (self.n or 1):
            return "best_of other than n is not supported."
        if self.truncate_prompt_tokens == 0:
            return "truncate_prompt_tokens must be -1 (the model's context) or at least 1."
        return self._beam_search_conflict()

    def _beam_search_conflict(self) -> str | None:
        """With use_beam_search, the first field beam search cannot honour that is set to anything
        but its no-op; without it, beam search's own fields. (Structured outputs: the handlers.)"""
        if not self.use_beam_search:
            if self.length_penalty != 1.0 or self.early_stopping:
                return "length_penalty and early_stopping apply to beam search only: set use_beam_search to true."
            return None
        conflicts = {
            "top_p": self.top_p not in (None, 1.0), "top_k": self.top_k not in (None, 0, -1),
            "min_p": self.min_p not in (None, 0.0), "presence_penalty": bool(self.presence_penalty),
            "frequency_penalty": bool(self.frequency_penalty),
            "repetition_penalty": self.repetition_penalty not in (None, 1.0), "logit_bias": bool(self.logit_bias),
            "min_tokens": self.min_tokens > 0, "stop": bool(self.stop),
            "prompt_logprobs": self.prompt_logprobs is not None, "allowed_token_ids": bool(self.allowed_token_ids),
        }
        for name, conflict in conflicts.items():
            if conflict:
                return (f"`{name}` is not supported with use_beam_search: beam search ranks beams by the model's own "
                        "log-probabilities and ends them at EOS or at stop_token_ids.")
        return None

    def to_beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """vLLM's: a search n beams wide (ValueError for values out of range)."""
        return BeamSearchParams(
            beam_width=1 if self.n is None else self.n, max_tokens=max_tokens, ignore_eos=self.ignore_eos,
            temperature=1.0 if self.temperature is None else self.temperature, length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output, early_stopping=self.early_stopping,
            stop_token_ids=self.stop_token_ids,
        )

    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): float(v) for k, v in self.logit_bias.items()} if self.logit_bias else None

    @property
    def usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def usage_in_every_chunk(self) -> bool:
        return self.usage_in_stream and bool(self.stream_options and self.stream_options.continuous_usage_stats)


# ---- /v1/completions --------------------------------------------------------------------------
class CompletionRequest(SamplingRequest):
    # Required, but null is vLLM's "no prompt" (then a 400 in vLLM's words, not pydantic's union errors).
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]], None]
    max_tokens: Int64 | None = 16
    logprobs: LogprobsCount | None = None
    echo: bool | None = False
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's extra

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix is not supported."
        if self.stream and self.use_beam_search:  # (vLLM's words; chat streams the finished beams)
            return "Streaming is not currently supported with beam search."
        return super().unsupported()

    @property
    def echo_without_generation(self) -> bool:
        """OpenAI's echo with `max_tokens: 0`: the prompt back (with its logprobs), nothing new."""
        return bool(self.echo) and self.max_tokens == 0


class LogprobInfo(OpenAIBaseModel):
    """vLLM's per-token `Logprob` in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One per prompt token: None for the first, else token id (as a string) -> its logprob, the prompt's
# token first and then the top candidates.
PromptLogprobsOut = list[dict[str, LogprobInfo] | None]


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
    token_ids: list[int] | None = None  # return_token_ids
    prompt_token_ids: list[int] | None = None  # return_token_ids (the first chunk of a stream)
    prompt_logprobs: PromptLogprobsOut | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ---------------------------------------------------------------------
class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, tool_calls, ... reach the chat template

    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        **SamplingRequest.REFUSED,
    }

    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: LogprobsCount | None = None
    tools: list[ToolParam] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none", "auto", "required" or a named function
    parallel_tool_calls: bool | None = True
    # OpenAI's deprecated spelling of tools and tool_choice
    functions: list[FunctionDefinition] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's extras
    echo: bool = False  # the reply starts with the last message's content when that is the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None
    include_reasoning: bool = True  # with --reasoning-parser: false leaves the reasoning out

    def unsupported(self) -> str | None:
        if not self.messages:
            return "messages must hold at least one message."
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs needs logprobs to be true."
        if self.continue_final_message and self.add_generation_prompt:
            if "add_generation_prompt" in self.model_fields_set:
                return "Cannot set both `continue_final_message` and `add_generation_prompt` to true."
        if self.continue_final_message and self.messages[-1].role != "assistant":
            return ("continue_final_message continues the last message, which must be the assistant's, "
                    f"got a {self.messages[-1].role!r} message.")
        if self.tools is not None and not self.tools:
            return "`tools` must not be an empty array: give at least one tool or leave it out."
        if self.tools and self.functions:
            return "Give `tools` or the older `functions`, not both."
        return super().unsupported()

    @property
    def generation_prompt(self) -> bool:
        """add_generation_prompt, which continue_final_message turns off unless given."""
        return self.add_generation_prompt and not self.continue_final_message


class ChatLogProbsTop(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProbsTop):
    top_logprobs: list[ChatLogProbsTop] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    # OpenAI's message fields this server never fills, null as vLLM sends them (clients that
    # compare a response's keys with their own model's expect them).
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None  # the older functions API's single call
    # With --reasoning-parser (set, even to None, only then): the text of the model's thinking,
    # under vLLM's name and its older one.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _leave_out_empty(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in ("reasoning", "reasoning_content"):
            if name not in self.model_fields_set:
                data.pop(name, None)
        if not data.get("tool_calls"):  # vLLM leaves out an empty list of calls
            data.pop("tool_calls", None)
        return data


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    service_tier: str | None = None  # OpenAI's; null, as vLLM sends them
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsOut | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    prompt_text: str | None = None  # return_prompt_text


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _leave_out_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(OpenAIBaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _leave_out_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # vLLM's older name of `reasoning`
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = None

    @model_serializer(mode="wrap")
    def _leave_out_empty(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in ("reasoning", "reasoning_content", "tool_calls", "function_call"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids

    @model_serializer(mode="wrap")
    def _leave_out_none(self, handler: Any) -> dict[str, Any]:
        return _without_none(handler(self), ("token_ids",))


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids, in the first chunk
    prompt_text: str | None = None  # return_prompt_text, in the first chunk

    @model_serializer(mode="wrap")
    def _leave_out_none(self, handler: Any) -> dict[str, Any]:
        return _without_none(handler(self), ("prompt_token_ids", "prompt_text"))


def _without_none(data: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """A streamed chat chunk leaves out vLLM's extension fields that it does not carry, as vLLM's
    chunks do: clients collect `token_ids` from every chunk that has the key, and expect
    `prompt_token_ids` in the first chunk only."""
    for name in names:
        if data.get(name) is None:
            data.pop(name, None)
    return data


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


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's POST /v1/load_lora_adapter: a PEFT folder served as the model `lora_name`."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; the name decides here


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {"mm_processor_kwargs": (), "return_token_offsets": (False,)}

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template adds them)
    return_token_strs: bool | None = False
    # chat form only
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[ToolParam] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str

"""Request, response and stream-event bodies of OpenAI's Responses API (`POST /v1/responses`), with
vLLM's extra sampling fields.

A request's `input` items and `tools` stay free-form JSON here: `serving_responses.py` turns them
into chat messages and chat tools, and its 400s name the item or tool that is not served (a
built-in tool, an image, an unknown item type). As in `protocol.py`, fields OpenAI defines that
this server does not implement are refused (`REFUSED`) unless set to their no-op value.

The events a stream sends once per token (text, reasoning and argument deltas) are plain dicts
encoded by msgspec, as `stream_events.py` does for chat; the rarer ones are pydantic models.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import ConfigDict, Field

from compiled_llm.entrypoints.openai.protocol import (
    Float32,
    Int64,
    JsonObject,
    LogprobsCount,
    OpenAIBaseModel,
    RequestModel,
)
from compiled_llm.utils import random_uuid


# ---- request ----------------------------------------------------------------------------------
class ResponseTextFormat(OpenAIBaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    model_config = ConfigDict(serialize_by_alias=True)  # echoed in the response as `schema`
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: JsonObject | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseTextConfig(OpenAIBaseModel):
    format: ResponseTextFormat = Field(default_factory=ResponseTextFormat)
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(RequestModel):
    REFUSED: ClassVar[dict[str, tuple[Any, ...]]] = {
        # OpenAI's
        "conversation": (), "prompt": (), "max_tool_calls": (), "stream_options": (),
        "truncation": ("disabled",), "context_management": (),
        # vLLM's
        "previous_input_messages": (), "mm_processor_kwargs": (), "cache_salt": (), "vllm_xargs": (),
    }

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: Float32 | None = None
    top_p: Float32 | None = None
    text: ResponseTextConfig | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None
    store: bool = True
    stream: bool = False
    background: bool = False  # refused when true, with a 400 that says why
    previous_response_id: str | None = None
    # Echoed; as vLLM, its `effort` reaches the chat template (`reasoning_effort`, and `enable_thinking`
    # false for "none", true otherwise, unless chat_template_kwargs says), the parser then splitting.
    reasoning: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more keyword arguments of the template
    include: list[str] | None = None  # what this server can add (a 400 names the rest)
    # The sampled tokens' logprobs and this many alternatives each, on the output text, only when
    # `include` names message.output_text.logprobs (as OpenAI and vLLM).
    top_logprobs: LogprobsCount | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras
    request_id: str | None = Field(default=None, max_length=256)
    priority: Int64 = 0
    seed: Int64 | None = None
    top_k: Int64 | None = None
    min_p: Float32 | None = None
    repetition_penalty: Float32 | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: the response also carries the rendered prompt and the raw output, text and token ids.
    enable_response_messages: bool = False

    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())


# ---- output items -----------------------------------------------------------------------------
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] | None = None


class OutputMessage(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"msg_{random_uuid()}")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "completed"
    content: list[OutputText] = Field(default_factory=list)


class FunctionToolCall(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"fc_{random_uuid()}")
    type: Literal["function_call"] = "function_call"
    call_id: str = Field(default_factory=lambda: f"call_{random_uuid()}")
    name: str
    arguments: str = ""
    status: ItemStatus = "completed"


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"rs_{random_uuid()}")
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    encrypted_content: str | None = None
    status: ItemStatus = "completed"


OutputItem = Annotated[Union[OutputMessage, FunctionToolCall, ReasoningItem], Field(discriminator="type")]


# ---- response ---------------------------------------------------------------------------------
class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class RawMessage(OpenAIBaseModel):
    """vLLM's `raw_message_tokens`: a text as the model saw or wrote it, and its token ids."""

    type: Literal["raw_message_tokens"] = "raw_message_tokens"
    message: str
    tokens: list[int]


class ResponsesResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"resp_{random_uuid()}")
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"] = "in_progress"
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    model: str
    instructions: str | None = None
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    text: ResponseTextConfig = Field(default_factory=ResponseTextConfig)
    truncation: Literal["disabled"] = "disabled"
    metadata: dict[str, str] | None = None
    store: bool = False  # whether this server kept it (for GET and previous_response_id)
    background: bool = False
    service_tier: str = "auto"
    user: str | None = None
    usage: ResponseUsage | None = None
    # vLLM's enable_response_messages: [RawMessage] of the prompt and of the output (else null).
    input_messages: list[RawMessage] | None = None
    output_messages: list[RawMessage] | None = None


class InputItemList(OpenAIBaseModel):
    """A page of `GET /v1/responses/{id}/input_items`: the official client's cursor page."""

    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# ---- stream events ----------------------------------------------------------------------------
class ResponseLifecycleEvent(OpenAIBaseModel):
    """`response.created`, `response.in_progress` and `response.completed`: the response so far."""

    type: Literal["response.created", "response.in_progress", "response.completed"]
    sequence_number: int
    response: ResponsesResponse


class OutputItemEvent(OpenAIBaseModel):
    """`response.output_item.added` (the item as it starts) and `.done` (as it ended)."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(OpenAIBaseModel):
    """`response.content_part.added` (an empty part) and `.done` (the part's whole text)."""

    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[Union[OutputText, ReasoningText], Field(discriminator="type")]


class OutputTextDoneEvent(OpenAIBaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextDoneEvent(OpenAIBaseModel):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int = 0
    text: str


class FunctionCallArgumentsDoneEvent(OpenAIBaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


def text_delta_event(sequence_number: int, item_id: str, output_index: int, delta: str,
                     logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`response.output_text.delta` (content part 0 of a message), with its tokens' logprobs if asked."""
    return {"type": "response.output_text.delta", "sequence_number": sequence_number, "item_id": item_id,
            "output_index": output_index, "content_index": 0, "delta": delta, "logprobs": logprobs or []}


def reasoning_delta_event(sequence_number: int, item_id: str, output_index: int, delta: str) -> dict[str, Any]:
    """`response.reasoning_text.delta` (content part 0 of a reasoning item)."""
    return {"type": "response.reasoning_text.delta", "sequence_number": sequence_number, "item_id": item_id,
            "output_index": output_index, "content_index": 0, "delta": delta}


def arguments_delta_event(sequence_number: int, item_id: str, output_index: int, delta: str) -> dict[str, Any]:
    """`response.function_call_arguments.delta`."""
    return {"type": "response.function_call_arguments.delta", "sequence_number": sequence_number,
            "item_id": item_id, "output_index": output_index, "delta": delta}

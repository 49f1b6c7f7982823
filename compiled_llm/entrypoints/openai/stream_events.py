"""The server-sent events of streamed completions and chat completions, encoded by msgspec.

A stream sends an event per step for every choice, so this runs once per token per client on the
frontend's one core. Built as pydantic models (validated, then dumped) a chunk cost about 13 us;
as plain dicts encoded by msgspec about 1 us. The dicts have exactly the fields, in the order, of
the response models in `protocol.py` (`ChatCompletionChunk`, `CompletionResponse`), and the bytes
are the same as those models' `model_dump_json` (tested). Parts that are rare in a stream (usage,
logprobs, tool-call deltas) may still be pydantic models: they are dumped by their own
serializers.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic import BaseModel


def _dump_model(value: Any) -> Any:
    """A pydantic part, as its own JSON (so its floats are written as pydantic writes them)."""
    if isinstance(value, BaseModel):
        return msgspec.Raw(value.model_dump_json())
    raise TypeError(f"cannot encode {type(value).__name__} in a stream event")


_ENCODER = msgspec.json.Encoder(enc_hook=_dump_model)


def event(fields: dict[str, Any]) -> str:
    """One server-sent event carrying `fields` as JSON."""
    return f"data: {_ENCODER.encode(fields).decode()}\n\n"


# ---- /v1/chat/completions ---------------------------------------------------------------------
def content_delta(content: str | None, role: str | None = None) -> dict[str, Any]:
    """A `DeltaMessage` without tool calls."""
    return {"role": role, "content": content}


def reasoning_delta(reasoning: str, role: str | None = None) -> dict[str, Any]:
    """A `DeltaMessage` carrying reasoning, under vLLM's name and its older one."""
    return {"role": role, "content": None, "reasoning": reasoning, "reasoning_content": reasoning}


def chat_choice(
    index: int, delta: dict[str, Any] | BaseModel, logprobs: Any = None, finish_reason: str | None = None,
    stop_reason: int | str | None = None, token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """A `ChatCompletionStreamChoice` (without `token_ids` when it has none, as the model)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
              "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def chat_chunk(
    id: str, created: int, model: str, choices: list[dict[str, Any]], usage: Any = None,
    prompt_token_ids: list[int] | None = None, prompt_text: str | None = None,
) -> str:
    """The event of a `ChatCompletionChunk` (the prompt's fields only where given, as the model)."""
    fields = {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
              "choices": choices, "usage": usage}
    if prompt_token_ids is not None:
        fields["prompt_token_ids"] = prompt_token_ids
    if prompt_text is not None:
        fields["prompt_text"] = prompt_text
    return event(fields)


# ---- /v1/completions --------------------------------------------------------------------------
def completion_choice(
    index: int, text: str, logprobs: Any = None, finish_reason: str | None = None,
    stop_reason: int | str | None = None, token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None, prompt_logprobs: Any = None,
) -> dict[str, Any]:
    """A `CompletionResponseChoice`."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason, "token_ids": token_ids, "prompt_token_ids": prompt_token_ids,
            "prompt_logprobs": prompt_logprobs}


def completion_chunk(id: str, created: int, model: str, choices: list[dict[str, Any]], usage: Any = None) -> str:
    """The event of a streamed `CompletionResponse`."""
    return event({"id": id, "object": "text_completion", "created": created, "model": model, "choices": choices,
                  "usage": usage})

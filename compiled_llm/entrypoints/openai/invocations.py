"""POST /invocations, the route Amazon SageMaker sends every request to: the body says which API
it is for. As vLLM, the body goes to the first API whose request model accepts it, tried in a fixed
order (chat completions before completions: a chat body has `messages`, a completion `prompt`)."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

import pydantic
from fastapi import Request
from fastapi.responses import Response

from compiled_llm.entrypoints.openai.errors import OpenAIError

Handler = Callable[[Any, Request], Awaitable[Response]]


async def invoke(raw_request: Request, handlers: list[tuple[type[pydantic.BaseModel], Handler]]) -> Response:
    """Answer `raw_request` with the first handler whose request model validates its body; a 400
    naming the request types when none does."""
    try:
        body = json.loads(await raw_request.body())
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the decoder goes
        raise OpenAIError(f"JSON decode error: {e}") from e
    for model, handler in handlers:
        try:
            request = model.model_validate(body)
        except pydantic.ValidationError:
            continue
        return await handler(request, raw_request)
    names = ", ".join(model.__name__ for model, _ in handlers)
    raise OpenAIError(f"Cannot find suitable handler for request. Expected one of: [{names}]")

"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure.

A user's mistake is a 4xx with a message that says what to change; only our own faults are 5xx.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi import HTTPException as FastAPIHTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from compiled_llm.engine.admission import EngineBusyError
from compiled_llm.engine.core_client import EngineDeadError
from compiled_llm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from compiled_llm.logger import init_logger

logger = init_logger(__name__)


def error_type(status: int) -> str:
    """vLLM's `type` for a status, which its clients and tests match: BadRequestError, NotFoundError,
    InternalServerError, ... (the status's phrase)."""
    try:
        name = HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    except ValueError:
        return "BadRequestError" if status < 500 else "InternalServerError"
    return name if name.endswith("Error") else name + "Error"


class RequestTooLarge(FastAPIHTTPException):  # FastAPI re-raises its own from body parsing
    """The request body is over the server's limit: a 413 before any of it is parsed."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The request body is larger than this server's limit of {limit} bytes "
                              "(--max-request-body-bytes).")


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type(status),
                                         param=param, code=code))


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message that quotes a client's text
    (a lone surrogate included) always encodes."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(message: str, status: int, param: str | None = None, code: str | None = None) -> JSONResponse:
    return _AsciiJSONResponse(error_body(message, status, param, code).model_dump(), status_code=status)


def engine_dead_message(error: BaseException) -> str:
    return f"{error} The server is shutting down, to be restarted."


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}.", None
    parts = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        # pydantic's error type and the value refused (cut short), as vLLM's messages carry them.
        value = repr(err.get("input"))
        value = value if len(value) <= 80 else value[:77] + "..."
        parts.append(f"{'.'.join(loc) or 'body'}: {err.get('msg')} [type={err.get('type')}, input_value={value}]")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    return "Invalid request: " + "; ".join(parts), (".".join(loc) or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default is a 422 in its own shape; OpenAI's clients expect a 400 in theirs.
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(EngineBusyError)
    async def engine_busy(request: Request, exc: EngineBusyError) -> JSONResponse:
        # 503: clients (the openai client retries it) and load balancers try again, here or elsewhere.
        return error_response(str(exc), 503, code=exc.reason)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(engine_dead_message(exc), 503, code="engine_dead")

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error serving %s %s.", request.method, request.url.path)
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)

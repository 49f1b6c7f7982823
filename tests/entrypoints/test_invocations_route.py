"""POST /invocations on bodies no API takes: a 400 in OpenAI's error shape, as the routes it
dispatches to answer (no engine: the real dispatcher, request models and error handlers, each
handler answering with the API it was given)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from compiled_llm.entrypoints.openai.errors import install_error_handlers
from compiled_llm.entrypoints.openai.invocations import invoke
from compiled_llm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest


async def answer(request, raw_request: Request) -> JSONResponse:
    return JSONResponse({"api": type(request).__name__})


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/invocations")
    async def invocations(raw_request: Request):
        return await invoke(raw_request, [(ChatCompletionRequest, answer), (CompletionRequest, answer)])

    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize("body", [b"[" * 100_000, b"{" * 50_000, b"", b"not json", b"[1]", b'"text"'])
def test_a_body_no_api_takes_is_a_400(client, body):
    response = client.post("/invocations", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "BadRequestError"


def test_each_api_gets_its_body(client):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/invocations", json=chat).json() == {"api": "ChatCompletionRequest"}
    assert client.post("/invocations", json={"model": "m", "prompt": "hi"}).json() == {"api": "CompletionRequest"}

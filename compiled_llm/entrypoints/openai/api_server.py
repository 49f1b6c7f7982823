"""The OpenAI-compatible server: a FastAPI app around one `AsyncLLM`, served by uvicorn.

The engine starts before uvicorn binds the port (so a client that can connect can be served);
the app's lifespan starts the engine's output handler and a watch on its death, and shuts the
engine down at the end. On SIGINT/SIGTERM open requests are aborted, so their streams end at
once and uvicorn's graceful shutdown does not wait on them. If the engine dies, open requests
fail, /health answers 503, and the server exits with status 1 so that a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import socket
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from compiled_llm import __version__
from compiled_llm.config import EngineConfig
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.engine.core_client import EngineStartupError
from compiled_llm.engine.engine_process import EngineHandle
from compiled_llm.engine.metrics import exposition
from compiled_llm.entrypoints.openai.errors import (
    OpenAIError,
    RequestTooLarge,
    engine_dead_message,
    error_response,
    install_error_handlers,
)
from compiled_llm.entrypoints.openai.invocations import invoke
from compiled_llm.entrypoints.openai.lora_modules import runtime_lora_updating_allowed
from compiled_llm.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from compiled_llm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from compiled_llm.entrypoints.openai.responses_protocol import ResponsesRequest
from compiled_llm.entrypoints.openai.server_args import ServerArgs
from compiled_llm.entrypoints.openai.serving_chat import OpenAIServingChat
from compiled_llm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from compiled_llm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from compiled_llm.entrypoints.openai.serving_models import ServedModels
from compiled_llm.entrypoints.openai.serving_pooling import OpenAIServingPooling
from compiled_llm.entrypoints.openai.serving_responses import OpenAIServingResponses
from compiled_llm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from compiled_llm.logger import init_logger
from compiled_llm.utils import freeze_gc_heap

logger = init_logger(__name__)

_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/invocations", "/pooling", "/score",
                       "/rerank", "/v2/rerank", "/classify")
# The routes that generate: their requests in progress are the server's load (GET /load).
_LOAD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/invocations"})


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>`, on the routes that reach the model.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which gets between a streaming
    response and the client's disconnect."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(_PROTECTED_PREFIXES):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self.expected):
                response = error_response(
                    "Missing or incorrect API key: send it as `Authorization: Bearer <key>`.", 401,
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for a request body over `max_bytes`, told by its Content-Length or counted as it
    arrives, before the app parses (and holds) any of it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            response = error_response(RequestTooLarge(self.max_bytes).detail, 413)
            await response(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)  # an HTTPException: the app answers 413
            return message

        await self.app(scope, counted_receive, send)


class ServerLoadMiddleware:
    """Counts the requests in progress on the generating routes, from their arrival to the last
    byte of their response (a stream's included), for GET /load (vLLM's `server_load`)."""

    def __init__(self, app: ASGIApp, load: ServerLoad) -> None:
        self.app = app
        self.load = load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in _LOAD_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.value += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.value -= 1


@dataclass
class ServerLoad:
    value: int = 0


def default_max_body_bytes(engine: AsyncLLM) -> int:
    """Room for the longest prompt that can fit the context, twice over (JSON escapes, chat
    messages around it), and never under 8 MiB."""
    return max(8 << 20, 2 * engine.processor.max_prompt_bytes + (1 << 20))


async def _exit_when_engine_dies(engine: AsyncLLM, on_engine_dead: Callable[[], None]) -> None:
    error = await engine.wait_until_dead()
    logger.error("The engine died (%s); the server exits so that a supervisor can restart it.", error)
    await asyncio.sleep(0.5)  # let open streams send their error event
    on_engine_dead()


def build_app(
    engine: AsyncLLM, server_args: ServerArgs, on_engine_dead: Callable[[], None] | None = None
) -> FastAPI:
    name = engine.model_config.served_model_name

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        freeze_gc_heap()  # the tokenizer, templates and routes are made: no collection walks them again
        watch = asyncio.create_task(_exit_when_engine_dies(engine, on_engine_dead)) if on_engine_dead else None
        try:
            yield
        finally:
            if watch is not None:
                watch.cancel()
            await engine.begin_shutdown()
            engine.shutdown()

    app = FastAPI(title="compiled-llm", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)
    max_body_bytes = server_args.max_request_body_bytes or default_max_body_bytes(engine)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=max_body_bytes)
    load = ServerLoad()
    if server_args.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, load=load)
    completions = OpenAIServingCompletion(engine, name, server_args)
    chat = OpenAIServingChat(engine, name, server_args)
    responses = OpenAIServingResponses(chat)
    tokenization = OpenAIServingTokenization(engine, name, server_args)
    embedding = OpenAIServingEmbedding(engine, name, server_args)
    pooling = OpenAIServingPooling(engine, name, server_args)
    if runtime_lora_updating_allowed() and server_args.api_server_count > 1:
        raise ValueError("Loading LoRA adapters at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs "
                         "--api-server-count 1: each API server process keeps its own adapter names.")
    # One set of names (the base model and its LoRA adapters) for every API of this server.
    served = ServedModels(engine, name, server_args.lora_modules or [])
    for handler in (completions, chat, tokenization, embedding, pooling, embedding.chat, pooling.chat):
        handler.models = served

    @app.get("/health")
    async def health() -> Response:
        if engine.errored:
            return error_response(engine_dead_message(engine.dead_error), 503, code="engine_dead")
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:  # SageMaker's health check
        return await health()

    @app.get("/load")
    async def server_load() -> JSONResponse:
        """Requests in progress on the generating routes (0 unless --enable-server-load-tracking)."""
        return JSONResponse({"server_load": load.value})

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(exposition(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=served.cards()).model_dump())

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        return JSONResponse(served.card(model).model_dump())  # another name is a 404 in OpenAI's shape

    if runtime_lora_updating_allowed():
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> Response:
            """vLLM's: the adapter is read and checked here (a 400 naming the problem), then named."""
            try:
                await asyncio.to_thread(served.add, request.lora_name, request.lora_path)
            except ValueError as e:
                raise OpenAIError(str(e), param="lora_path") from e
            return Response(f"Success: LoRA adapter '{request.lora_name}' added successfully.", media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> Response:
            served.remove(request.lora_name)
            return Response(f"Success: LoRA adapter '{request.lora_name}' removed successfully.",
                            media_type="text/plain")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chat.create_chat_completion(request, raw_request)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, raw_request: Request, order: str = "desc", limit: int = 20,
                               after: str | None = None, before: str | None = None) -> Response:
        query = raw_request.query_params  # the official client sends `include[]=...`
        include = query.getlist("include") + query.getlist("include[]")
        return responses.list_input_items(response_id, order, limit, after, before, include)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> Response:
        return responses.cancel(response_id)

    @app.post("/invocations")
    async def invocations(raw_request: Request) -> Response:
        if engine.model_config.runner == "pooling":  # vLLM's: the request types the served model answers
            return await invoke(raw_request, [(EmbeddingRequest, embedding.create_embedding),
                                              (ScoreRequest, pooling.create_score), (RerankRequest, pooling.do_rerank)])
        return await invoke(raw_request, [(ChatCompletionRequest, chat.create_chat_completion),
                                          (CompletionRequest, completions.create_completion)])

    if server_args.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info() -> JSONResponse:
            return JSONResponse(tokenization.tokenizer_info())

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.tokenize_request(request)).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.detokenize(request)).model_dump())

    # The pooling routes (vLLM's): a 400 naming --runner pooling on a server that generates.

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embedding.create_embedding(request, raw_request)

    @app.post("/pooling")
    async def create_pooling(request: PoolingRequest, raw_request: Request) -> Response:
        return await pooling.create_pooling(request, raw_request)

    @app.post("/score")
    @app.post("/v1/score")
    async def create_score(request: ScoreRequest, raw_request: Request) -> Response:
        return await pooling.create_score(request, raw_request)

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def do_rerank(request: RerankRequest, raw_request: Request) -> Response:
        return await pooling.do_rerank(request, raw_request)

    @app.post("/classify")
    async def create_classify(request: ClassificationRequest, raw_request: Request) -> Response:
        return await pooling.create_classify(request, raw_request)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, which also aborts open requests when told to exit, so that their
    streams end now instead of holding up the graceful shutdown. `loop`: the loop it serves on,
    set when it starts."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        loop = self.loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: loop.create_task(self.engine.begin_shutdown()))


async def _announce_when_ready(server: uvicorn.Server, engine: AsyncLLM, url: str) -> None:
    while not server.started:
        await asyncio.sleep(0.01)
    engine.start_chat_renderer()
    logger.info("Ready: serving %s at %s/v1", engine.model_config.served_model_name, url)


def make_http_server(engine: AsyncLLM, server_args: ServerArgs) -> _Server:
    """The app (its routes, handlers and the tokenizer's pieces they make) and its uvicorn server,
    not serving yet: made while the engine core loads, so that a ready engine is served at once."""
    server: _Server | None = None

    def on_engine_dead() -> None:
        assert server is not None
        server.should_exit = True

    app = build_app(engine, server_args, on_engine_dead)
    config = uvicorn.Config(app, host=server_args.host, port=server_args.port, log_level="info",
                            timeout_graceful_shutdown=5)
    server = _Server(config, engine)
    return server


async def serve_http(server: _Server, sock: socket.socket | None = None) -> None:
    """Serve until told to exit; on `sock` (bound already, maybe shared with other API server
    processes) instead of binding `host:port`."""
    server.loop = asyncio.get_running_loop()
    config = server.config
    announce = asyncio.create_task(_announce_when_ready(server, server.engine, f"http://{config.host}:{config.port}"))
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        announce.cancel()


def raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """uvloop's event loop where it is installed (a dependency), else asyncio's.

    The server's own process spends most of its time per streamed token in the event loop and the
    HTTP layer: every token of every stream is an event written to a socket and a wake-up.
    `benchmarks/frontend_per_token.py --serve` (32 streams, 64-token outputs, this project's CPU
    machine): 154 us of the process's CPU a token with asyncio's loop and h11, 129-137 us with uvloop
    and httptools (which uvicorn picks when installed), as vLLM serves.
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run_server(
    server_args: ServerArgs, engine_args: EngineArgs, config: EngineConfig | None = None,
    engine_core: EngineHandle | None = None,
) -> int:
    """`compiled-llm serve` with one API server process: 0 after a clean shutdown, 1 when the
    engine failed to start or died. `config`, `engine_core`: the config made from `engine_args`
    and its engine core, started already (the CLI starts it before importing this module)."""
    # Until uvicorn installs its own handlers, SIGTERM unwinds like Ctrl-C, so the engine is joined.
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    engine: AsyncLLM | None = None
    try:
        engine = AsyncLLM(config or engine_args.create_engine_config(), server_args.engine_timeout,
                          server_args.stream_interval, engine=engine_core, wait_ready=False,
                          admission=server_args.admission_limits(), metrics_namespace=server_args.metrics_namespace)
        # While the engine loads: the app, then this process's start-up heap is made (the server
        # stack, the tokenizer), so the collection that freezes it is off the path to ready.
        server = make_http_server(engine, server_args)
        freeze_gc_heap()
        engine.wait_ready()
    except BaseException as e:
        if engine is not None:
            engine.shutdown()
        if isinstance(e, (EngineStartupError, ValueError, OSError)):  # a bad model folder or setting, said plainly
            logger.error("%s", e)
            return 1
        raise
    return serve_engine(engine, server_args, server=server)


def serve_engine(engine: AsyncLLM, server_args: ServerArgs, sock: socket.socket | None = None,
                 server: _Server | None = None) -> int:
    """Serve HTTP in front of a started engine until a signal or the engine's death; 0 after a
    clean shutdown, 1 when the engine died. `server`: made already (`make_http_server`)."""
    try:
        if server is None:
            server = make_http_server(engine, server_args)
        with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
            runner.run(serve_http(server, sock))
    except KeyboardInterrupt:
        pass  # the signal uvicorn re-raises after its graceful shutdown
    finally:
        engine.shutdown()
    return 1 if engine.errored else 0

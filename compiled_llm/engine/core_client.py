"""Clients of the engine core: in-process (offline `LLM`, tests) and in its own process over
ZeroMQ with asyncio (the server).

`AsyncMPClient` owns the engine from start to stop, through an `EngineHandle` (a local process by
default, a Ray actor in a Ray data-parallel group). It notices the engine's death (it exits,
reports an error, or sends nothing for `engine_timeout_s` while work is in flight), fails
everything open with `EngineDeadError`, and on `shutdown()` stops the engine so that nothing is
left behind.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import time
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from compiled_llm.config import EngineConfig
from compiled_llm.engine.engine_process import EngineHandle, EngineProcess, EngineStartupError
from compiled_llm.logger import init_logger
from compiled_llm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest, RequestType, UtilityRequest

logger = init_logger(__name__)

_POLL_MS = 1000  # how often the output task looks at the engine's liveness when nothing arrives


class EngineDeadError(RuntimeError):
    """The engine core died or stopped answering: nothing it held will finish."""


__all__ = ["AsyncMPClient", "EngineDeadError", "EngineStartupError", "InprocClient"]


class InprocClient:
    """The engine core in this process, stepped by the caller (offline `LLM`)."""

    def __init__(self, config: EngineConfig) -> None:
        # Imported here: a server's process, which runs the engine in another, never needs it.
        from compiled_llm.core.engine_core import EngineCore

        self.engine_core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class AsyncMPClient:
    """The engine core in its own process, reached over two ZeroMQ sockets (`ipc://` to a local
    process, tcp to a Ray actor).

    Input: our PUSH connects to the engine's PULL; output: the engine's PUSH connects to our PULL.
    The sending side connects, so messages queue from the start, before the peer is up.
    Construction blocks until the engine is ready and raises `EngineStartupError` if it is not.
    """

    def __init__(
        self,
        config: EngineConfig,
        engine_timeout_s: float = 120.0,
        engine_index: int = 0,
        outputs: asyncio.Queue | None = None,
        wait_ready: bool = True,
        engine: EngineHandle | None = None,
        client_index: int = 0,
    ) -> None:
        """`engine_index`, `outputs`: this engine's place in a data-parallel group, and the queue
        the group's outputs share. `wait_ready=False`: return once the process started; call
        `wait_ready()` (several engines start at once that way). `engine`: how the engine runs
        (default: a local process). `client_index`: this client's place among the API server
        processes that share the engine (its outputs come back to this client's socket)."""
        self.engine_timeout_s = engine_timeout_s
        self.engine_index = engine_index
        self.client_index = client_index
        # The one record of the engine's death (the frontend reads it from here).
        self.dead_error: EngineDeadError | None = None
        self._dead_listeners: list[asyncio.Future[EngineDeadError]] = []
        self._closed = False
        self._exit_expected = False
        self._shutdown_requested = False
        self.engine: EngineHandle = engine or EngineProcess(config, engine_index)
        self._ctx = zmq.Context()
        self.input_socket = self._ctx.socket(zmq.PUSH)
        # An asyncio view of the same context. The async socket must own its handle: a shadowed
        # sync socket would close it again when collected, by then maybe a newer client's socket.
        self.output_socket = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.PULL)
        self._encoder = msgspec.msgpack.Encoder()
        self._outputs: asyncio.Queue[EngineCoreOutputs | EngineDeadError] = outputs or asyncio.Queue()
        self._receiver: asyncio.Task | None = None
        self._in_flight: set[str] = set()
        self._last_heard = time.monotonic()
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        # Messages to the engine, in order, for the sender task: the event loop never blocks on a
        # full socket, and a burst (n children, many clients) waits for room instead of failing.
        self._send_queue: asyncio.Queue[list[bytes]] | None = None
        self._sender: asyncio.Task | None = None

        self._started = time.perf_counter()
        self.num_blocks: int | None = None
        try:
            self.output_socket.bind(self.engine.output_bind_address)
            self.engine.start(self.output_socket.getsockopt(zmq.LAST_ENDPOINT).decode())
            self.input_socket.connect(self.engine.input_address)
        except BaseException:
            self.shutdown()
            raise
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the engine is ready; `EngineStartupError` (and the process stopped) if not."""
        try:
            handshake = self.engine.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks = handshake.num_blocks or None  # the KV cache's blocks (metrics' cache_config_info)
        if not self.engine.owns_engine:
            return  # its owner started it and said so
        total = time.perf_counter() - getattr(self.engine, "started_at", self._started)
        capture = f" (CUDA graphs {handshake.capture_seconds:.1f} s)" if handshake.capture_seconds else ""
        logger.info(
            "Engine core %d (pid %d) ready in %.1f s: process start and imports %.1f s, weights %.1f s, "
            "KV cache %.1f s, compile or warm-up %.1f s%s.",
            self.engine_index, self.engine.pid, total, total - handshake.startup_seconds, handshake.load_seconds,
            handshake.kv_seconds, handshake.startup_seconds - handshake.load_seconds - handshake.kv_seconds, capture,
        )

    @property
    def num_in_flight(self) -> int:
        """Requests sent and not finished: this engine's load, as the frontend sees it."""
        return len(self._in_flight)

    # ---- liveness and outputs ------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.engine.pid

    @property
    def proc(self) -> multiprocessing.process.BaseProcess | None:
        """The engine's local process (None for a Ray actor)."""
        return getattr(self.engine, "proc", None)

    def _ensure_receiving(self) -> None:
        if self._receiver is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._receiver = loop.create_task(self._receive_outputs(), name="EngineCoreOutputs")
            self._send_queue = asyncio.Queue()
            self._sender = loop.create_task(self._send_inputs(), name="EngineCoreInputs")

    def start(self) -> None:
        """Start watching the engine from the running event loop (otherwise the first call does)."""
        self._ensure_receiving()

    def expect_exit(self) -> None:
        """A shutdown has begun: the engine exiting now (on the same Ctrl-C, say) is no death."""
        self._exit_expected = True

    async def _receive_outputs(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.output_socket, zmq.POLLIN)
        poller.register(self.engine.sentinel, zmq.POLLIN)
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        try:
            while True:
                events = dict(await poller.poll(_POLL_MS))
                if self.output_socket in events:
                    self._deliver(decoder.decode(await self.output_socket.recv()))
                elif self.engine.sentinel in events:
                    if self._exit_expected:
                        return
                    while await self.output_socket.poll(0):  # what it sent before it went
                        self._deliver(decoder.decode(await self.output_socket.recv()))
                    self.engine.join(1)
                    raise EngineDeadError(self.engine.describe_exit())
                elif (self._in_flight or self._utility_calls) and (
                    time.monotonic() - self._last_heard > self.engine_timeout_s
                ):
                    self.engine.kill()
                    raise EngineDeadError(
                        f"The engine core stopped answering: nothing for {self.engine_timeout_s:g} s with "
                        f"{len(self._in_flight)} requests in flight; it was killed."
                    )
        except EngineDeadError as e:
            self.mark_dead(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not self._closed:
                logger.exception("Receiving engine core outputs failed.")
                self.mark_dead(EngineDeadError(f"Lost the engine core's output socket: {e}"))

    def _deliver(self, outputs: EngineCoreOutputs) -> None:
        self._last_heard = time.monotonic()
        if outputs.engine_dead:
            raise EngineDeadError("The engine core hit an error and stopped; see its log.")
        if outputs.utility_output is not None:
            call_id, result, error = outputs.utility_output
            future = self._utility_calls.pop(call_id, None)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(RuntimeError(error))
            return
        for out in outputs.outputs:
            if out.finished:
                self._in_flight.discard(out.request_id)
        self._outputs.put_nowait(outputs)

    def mark_dead(self, error: EngineDeadError) -> None:
        """The engine is gone (or the frontend cannot use it any more): fail everything open, once."""
        if self.dead_error is not None:
            return
        logger.error("%s", error)
        self.dead_error = error
        for listener in self._dead_listeners:
            if not listener.done():
                listener.set_result(error)
        self._dead_listeners.clear()
        if self._sender is not None:
            self._sender.cancel()  # it may wait for room that a dead engine never makes
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(str(error)))
        self._utility_calls.clear()
        self._in_flight.clear()
        self._outputs.put_nowait(error)

    async def wait_until_dead(self) -> EngineDeadError:
        if self.dead_error is not None:
            return self.dead_error
        listener: asyncio.Future[EngineDeadError] = asyncio.get_running_loop().create_future()
        self._dead_listeners.append(listener)
        return await listener

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next batch of outputs; raises `EngineDeadError` once the engine is gone."""
        self._ensure_receiving()
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put_nowait(item)  # every later call fails the same way
            raise EngineDeadError(str(item))
        return item

    # ---- requests --------------------------------------------------------------------------
    def _send(self, kind: RequestType, data: bytes, *more: bytes) -> None:
        """Queue a message for the sender task (in order; never blocks, never fails on a burst)."""
        if self.dead_error is not None:
            raise EngineDeadError(str(self.dead_error))
        if self._closed:
            raise EngineDeadError("The engine core client is shut down.")
        self._ensure_receiving()
        assert self._send_queue is not None
        self._send_queue.put_nowait([kind.value, data, *more])

    async def _send_inputs(self) -> None:
        """Write queued messages to the engine's socket. When its queue is full (the engine's input
        thread has not drained a burst yet), wait for room: whether the engine is dead is decided
        by its process (exit, or silence with work in flight), never by a full queue."""
        assert self._send_queue is not None
        while True:
            frames = await self._send_queue.get()
            while True:
                try:
                    self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    await asyncio.sleep(0.002)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_receiving()
        if not self._in_flight:
            self._last_heard = time.monotonic()
        request.client_index = self.client_index
        self._send(RequestType.ADD, self._encoder.encode(request))
        self._in_flight.add(request.request_id)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if not request_ids or self.dead_error is not None or self._closed:
            return  # a dead engine holds nothing to free
        # The third frame, the sender's client index: an engine shared by several API servers aborts
        # only this one's requests of those ids (a user-chosen id may be open on another one).
        self._send(RequestType.ABORT, self._encoder.encode(request_ids), str(self.client_index).encode())
        self._in_flight.difference_update(request_ids)

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._ensure_receiving()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        if not self._in_flight and not self._utility_calls:
            self._last_heard = time.monotonic()
        self._utility_calls[call_id] = future
        try:
            self._send(RequestType.UTILITY,
                       self._encoder.encode(UtilityRequest(call_id, method, list(args), self.client_index)))
        except EngineDeadError:
            self._utility_calls.pop(call_id, None)
            raise
        return await future

    async def reset_prefix_cache_async(self) -> bool:
        return await self.call_utility_async("reset_prefix_cache")

    # ---- shutdown ---------------------------------------------------------------------------
    def request_shutdown(self) -> bool:
        """Ask the engine to exit (SHUTDOWN) without waiting for it, so that several engines stop
        at the same time; whether it was asked (an engine this client owns, alive)."""
        if self._closed or not self.engine.owns_engine or not self.engine.is_alive() or self.dead_error is not None:
            return False
        if not self._shutdown_requested:
            try:
                self.input_socket.send_multipart([RequestType.SHUTDOWN.value, b""], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                return False
            self._shutdown_requested = True
        return True

    def shutdown(self) -> None:
        """Stop the engine (SHUTDOWN, then SIGTERM or a kill) and join it; only let go of an engine
        that another process owns."""
        if self._closed:
            return
        if self.request_shutdown():
            self.engine.join(5)
        self._closed = True
        for task in (self._receiver, self._sender):
            if task is not None and not task.done() and not task.get_loop().is_closed():
                task.cancel()
        self.engine.stop()
        self.input_socket.close(linger=0)
        self.output_socket.close(linger=0)
        self._ctx.term()

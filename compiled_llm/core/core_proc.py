"""`EngineCore` in its own process, so that a model step never waits on the HTTP server and the
server never waits on a model step.

The process runs a busy loop on its main thread: drain the input queue (add, abort, utility
calls, shutdown), step the engine while there is work, and block on the queue when there is none.
Socket I/O lives on two daemon threads: one receives and decodes msgpack frames into the input
queue, the other encodes and sends what the loop puts on the output queue. Messages are msgspec
structs, never pickles: a peer can send data, not code. Several API server processes may feed one
engine (`serve --api-server-count`): each has its own output socket, and `OutputRouter` says which
outputs go to which.

Start-up: the client hands the process one end of a pipe. The process answers on it once, with a
`Handshake` (ready, or the start-up error in words), and then watches it: when the client's end
closes, because the client shut down or died, the engine exits too. A Ray actor
(`core_actor.py`) runs the same start and loop with Ray in place of the pipe.
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import msgspec
import zmq

from compiled_llm.config import EngineConfig
from compiled_llm.core.engine_core import EngineCore
from compiled_llm.core.output_router import OutputRouter
from compiled_llm.logger import init_logger
from compiled_llm.messages.engine_core import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Handshake,
    RequestType,
    UtilityRequest,
)
from compiled_llm.utils import UserError, exit_without_teardown, freeze_gc_heap, watch_parent_pipe

logger = init_logger(__name__)

ENGINE_PROC_TITLE = "compiled_llm::EngineCore"

# Calls a client may make by name; nothing else is reachable over the socket.
UTILITIES: dict[str, Callable[..., Any]] = {
    "ping": lambda engine: "pong",
    "reset_prefix_cache": lambda engine: engine.reset_prefix_cache(),
}


def run_utility(engine: EngineCore, request: UtilityRequest) -> tuple[int, Any, str | None]:
    """Run a named utility call; returns (call id, result, error message)."""
    fn = UTILITIES.get(request.method)
    if fn is None:
        return request.call_id, None, f"Unknown utility method {request.method!r}."
    try:
        return request.call_id, fn(engine, *request.args), None
    except Exception as e:  # a failed utility call is the caller's answer, not the engine's death
        logger.exception("Utility call %s failed.", request.method)
        return request.call_id, None, f"{type(e).__name__}: {e}"


class _Refused(msgspec.Struct):
    """A message the input thread could not decode, but whose sender waits for an answer:
    a request (its id) or a utility call (its call id), and the API server process it came from."""

    kind: RequestType
    id: str | int
    error: str
    client: int = 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _client_frame(frames: list[bytes]) -> int:
    """The sender's client index in an ABORT's third frame (absent: 0)."""
    try:
        return int(frames[2]) if len(frames) > 2 else 0
    except ValueError:
        return 0


def _salvage_id(kind: RequestType, frame: bytes) -> tuple[str | int, int] | None:
    """The request id (or utility call id) of an undecodable ADD (or UTILITY) message and its
    sender's client index, if any: its sender is told why instead of waiting for ever."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if not isinstance(raw, list) or not raw:
        return None
    # The client index's place in the array-like struct (absent when it is 0).
    slot = {RequestType.ADD: 5, RequestType.UTILITY: 3}.get(kind)
    client = raw[slot] if slot is not None and len(raw) > slot and _is_int(raw[slot]) else 0
    if kind == RequestType.ADD and isinstance(raw[0], str):
        return raw[0], client
    if kind == RequestType.UTILITY and _is_int(raw[0]):
        return raw[0], client
    return None


class EngineCoreProc:
    """The busy loop around an `EngineCore`, with its two socket threads. `output_address`: one
    client's output socket, or a list of them, one per API server process (`client_index`)."""

    def __init__(
        self, engine: EngineCore, input_address: str, output_address: str | list[str], engine_index: int = 0
    ) -> None:
        self.engine = engine
        self.engine_index = engine_index  # stamped on every output (data parallelism)
        output_addresses = [output_address] if isinstance(output_address, str) else list(output_address)
        self.router = OutputRouter(len(output_addresses))
        self.input_queue: queue.Queue[tuple[RequestType, Any]] = queue.Queue()
        # (client index, message); None stops the output thread.
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs] | None] = queue.Queue()
        self._stop_input = threading.Event()
        self._shutdown_requested = False
        self._stats_stale = False
        self._ctx = ctx = zmq.Context()
        self.input_thread = threading.Thread(
            target=self._receive_inputs, args=(ctx, input_address), name="EngineCoreInput", daemon=True
        )
        self.output_thread = threading.Thread(
            target=self._send_outputs, args=(ctx, output_addresses), name="EngineCoreOutput", daemon=True
        )
        self.input_thread.start()
        self.output_thread.start()

    # ---- the main thread -----------------------------------------------------------------------
    def run_busy_loop(self) -> None:
        engine = self.engine
        while not self._shutdown_requested:
            if not engine.has_unfinished_requests():
                if self._stats_stale:
                    # Idle after aborts: publish the stats once so gauges fall back to zero.
                    self._stats_stale = False
                    self._publish(engine.step())
                self._handle(*self.input_queue.get())
            while True:
                try:
                    self._handle(*self.input_queue.get_nowait())
                except queue.Empty:
                    break
            if self._shutdown_requested:
                break
            if engine.has_unfinished_requests():
                self._stats_stale = False
                self._publish(engine.step())

    def _publish(self, outputs: EngineCoreOutputs) -> None:
        for item in self.router.route(outputs, time.monotonic()):
            self.output_queue.put(item)

    def _handle(self, kind: RequestType, data: Any) -> None:
        if isinstance(data, _Refused):
            self._refuse(data.kind, data.id, data.error, data.client)
            return
        if kind == RequestType.ADD:
            try:
                self.engine.add_request(data)
            except ValueError as e:  # the frontend checks first; the engine never dies of a request
                self._refuse(kind, data.request_id, str(e), data.client_index)
                return
            self.router.added(data.request_id, data.client_index)
        elif kind == RequestType.ABORT:
            request_ids, client = data
            request_ids = self.router.owned(request_ids, client)
            self.engine.abort_requests(request_ids)
            self.router.aborted(request_ids)
        elif kind == RequestType.UTILITY:
            client = self.router.check_client(data.client_index)
            self.output_queue.put((client, EngineCoreOutputs(utility_output=run_utility(self.engine, data))))
            return
        elif kind == RequestType.SHUTDOWN:
            self._shutdown_requested = True
        self._stats_stale = True

    def _refuse(self, kind: RequestType, id: str | int, error: str, client: int = 0) -> None:
        logger.error("Refused %s %r: %s", "request" if kind == RequestType.ADD else "utility call", id, error)
        client = self.router.check_client(client)
        if kind == RequestType.ADD:
            output = EngineCoreOutput(str(id), [], finish_reason="error", stop_reason=error)
            self.output_queue.put((client, EngineCoreOutputs([output], timestamp=time.time())))
        else:
            self.output_queue.put((client, EngineCoreOutputs(utility_output=(int(id), None, error))))

    def report_dead(self) -> None:
        for item in self.router.to_all(EngineCoreOutputs(engine_dead=True, timestamp=time.time())):
            self.output_queue.put(item)

    def shutdown(self) -> None:
        """Stop both threads; the output thread sends what is queued first (a few seconds at most),
        and what its socket still holds goes out before the context ends (its linger, 1 s at most):
        the process exits without the interpreter's teardown, which would otherwise end it."""
        self._stop_input.set()
        self.output_queue.put(None)
        self.output_thread.join(timeout=5)
        self.input_thread.join(timeout=1)
        if not self.input_thread.is_alive() and not self.output_thread.is_alive():
            self._ctx.term()  # would wait for ever on a socket still open in a stuck thread

    # ---- the socket threads -------------------------------------------------------------------
    def _receive_inputs(self, ctx: zmq.Context, address: str) -> None:
        decoders = {
            RequestType.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
            RequestType.ABORT: msgspec.msgpack.Decoder(list[str]),
            RequestType.UTILITY: msgspec.msgpack.Decoder(UtilityRequest),
        }
        sock = ctx.socket(zmq.PULL)
        sock.bind(address)
        try:
            while not self._stop_input.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                try:
                    kind = RequestType(frames[0])
                except ValueError:
                    logger.error("Dropped a message of unknown type %r to the engine core.", frames[0][:8])
                    continue
                decoder = decoders.get(kind)
                try:
                    data = decoder.decode(frames[1]) if decoder is not None else None
                except (IndexError, msgspec.DecodeError) as e:
                    found = _salvage_id(kind, frames[1]) if len(frames) > 1 else None
                    if found is None:
                        logger.error("Dropped a malformed %s message to the engine core: %s", kind.name, e)
                        continue
                    data = _Refused(kind, found[0], f"Malformed {kind.name} message: {e}", found[1])
                if kind == RequestType.ABORT and not isinstance(data, _Refused):
                    data = (data, _client_frame(frames))
                self.input_queue.put((kind, data))
        finally:
            sock.close(linger=0)

    def _send_outputs(self, ctx: zmq.Context, addresses: list[str]) -> None:
        encoder = msgspec.msgpack.Encoder()
        sockets = []
        try:
            for address in addresses:
                sockets.append(ctx.socket(zmq.PUSH))
                if len(addresses) > 1:  # one lagging API server must not stall the others' outputs
                    sockets[-1].setsockopt(zmq.SNDHWM, 0)
                sockets[-1].connect(address)
            while True:
                item = self.output_queue.get()
                if item is None:
                    break
                client, outputs = item
                outputs.engine_index = self.engine_index
                sockets[client].send(encoder.encode(outputs), copy=False)
        finally:
            for sock in sockets:
                sock.close(linger=1000)


def _exit_on_signal(signum: int, frame: Any) -> None:
    # Once: a second signal must not interrupt the clean-up the first one started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(0)


def start_engine_core(
    config: EngineConfig, input_address: str, output_address: str | list[str], engine_index: int = 0
) -> tuple[EngineCoreProc | None, Handshake]:
    """Build the engine and its socket threads; the handshake says whether that worked (and why
    not). Shared by the local process below and the Ray actor (`core_actor.py`)."""
    try:
        engine = EngineCore(config, exit_on_worker_death=True)
    except SystemExit:
        raise
    except BaseException as e:
        if not isinstance(e, UserError):  # the user's to fix: the frontend says it in one line
            logger.exception("Engine core failed to start.")
        return None, Handshake(ok=False, error=f"{type(e).__name__}: {e}")
    proc = EngineCoreProc(engine, input_address, output_address, engine_index)
    return proc, Handshake(
        ok=True,
        num_blocks=engine.num_blocks,
        load_seconds=engine.executor.load_seconds,
        kv_seconds=engine.kv_seconds,
        startup_seconds=engine.startup_seconds,
        capture_seconds=engine.capture_seconds,
    )


def serve_engine_core(proc: EngineCoreProc) -> int:
    """Run the busy loop until SHUTDOWN (or a signal); returns the exit code."""
    exit_code = 0
    freeze_gc_heap()  # the model and its compiled code are made: no collection walks them again
    try:
        proc.run_busy_loop()
    except SystemExit:
        pass
    except BaseException:
        logger.exception("Engine core died.")
        proc.report_dead()
        exit_code = 1
    finally:
        proc.shutdown()
        proc.engine.shutdown()
    logger.info("Engine core exited.")
    return exit_code


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str | list[str], conn: Connection,
    engine_index: int = 0,
) -> None:
    """Entry point of the engine process (multiprocessing, spawn context); `engine_index`: its place
    in a data-parallel group; `output_address`: a list with several API server processes."""
    from setproctitle import setproctitle

    setproctitle(ENGINE_PROC_TITLE if config.parallel_config.data_parallel_size == 1
                 else f"{ENGINE_PROC_TITLE}_DP{engine_index}")
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    threading.Thread(target=watch_parent_pipe, args=(conn,), name="ParentWatch", daemon=True).start()
    try:
        proc, handshake = start_engine_core(config, input_address, output_address, engine_index)
    except SystemExit:
        return
    conn.send_bytes(msgspec.msgpack.encode(handshake))
    # Every resource is released explicitly by now: skip the interpreter's teardown of the heap
    # (seconds of garbage collection, for the frontend's join on shutdown to wait out).
    exit_without_teardown(1 if proc is None else serve_engine_core(proc))

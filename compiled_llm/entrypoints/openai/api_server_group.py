"""`compiled-llm serve --api-server-count N`: N API server processes in front of one engine core.

One Python process streams on the order of 10k tokens/s: every token of every stream is an event
written to its socket and a wake-up of the event loop (`benchmarks/frontend_per_token.py`), while
a GPU decodes more than that at a large batch. As vLLM's `--api-server-count`, this process (the
supervisor) claims the HTTP port, starts the engine core, then N API servers that listen on that
port together (SO_REUSEPORT: the kernel spreads new connections over them by a hash of the
client's address, where one socket shared by all would hand a burst of connections to whichever
process woke first) and reach the engine over ZeroMQ, one output socket each
(`core/output_router.py` sends each request's outputs to the process that sent it). /metrics adds
up every process's series (prometheus_client's multiprocess mode).

The supervisor serves nothing itself: it waits on its children. SIGTERM or Ctrl-C: the API servers
end their open requests and exit, then the engine. An API server that exits on its own (the
engine died, or the server failed) brings the rest down, and the command exits with status 1, as
one server does when its engine dies, so that whatever supervises `serve` restarts it whole.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any

from compiled_llm.config import EngineConfig
from compiled_llm.engine.arg_utils import EngineArgs
from compiled_llm.engine.async_llm import AsyncLLM
from compiled_llm.engine.engine_process import AttachedEngine, EngineProcess, EngineStartupError
from compiled_llm.engine.metrics import GROUP_METRICS_ENV
from compiled_llm.entrypoints.openai.api_server import raise_keyboard_interrupt, serve_engine
from compiled_llm.entrypoints.openai.server_args import ServerArgs
from compiled_llm.logger import init_logger
from compiled_llm.messages.engine_core import Handshake
from compiled_llm.utils import exit_without_teardown, watch_parent_pipe

logger = init_logger(__name__)

API_SERVER_PROC_TITLE = "compiled_llm::APIServer"
_STOP_TIMEOUT_S = 10.0  # the API servers' graceful shutdown (uvicorn's is 5 s) and some room


def bind_port(host: str, port: int, reuse_port: bool = True) -> socket.socket:
    """A socket bound to `host:port`, with SO_REUSEPORT unless told not to: the supervisor's (never
    listening) claims the port, and each API server's listens on it."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    return sock


def claim_port(host: str, port: int) -> socket.socket:
    """Bind once without SO_REUSEPORT first, so that a port in use (another `serve`, whose sockets
    would otherwise share it with ours) fails here as it does for one server; then claim it."""
    with bind_port(host, port, reuse_port=False) as probe:
        port = probe.getsockname()[1]  # --port 0: the one the kernel chose
    return bind_port(host, port)


def run_api_server_process(
    server_args: ServerArgs, config: EngineConfig, index: int, input_address: str, output_address: str,
    engine_pid: int, handshake: Handshake, conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of API server `index` (multiprocessing, spawn context); `server_args.port`: the
    port the supervisor claimed."""
    from setproctitle import setproctitle

    setproctitle(f"{API_SERVER_PROC_TITLE}_{index}")
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)  # until uvicorn installs its handlers
    threading.Thread(target=watch_parent_pipe, args=(conn,), name="SupervisorWatch", daemon=True).start()
    try:
        engine = AsyncLLM(config, server_args.engine_timeout, server_args.stream_interval,
                          engine=AttachedEngine(engine_pid, input_address, output_address, handshake),
                          client_index=index, admission=server_args.admission_limits(),
                          metrics_namespace=server_args.metrics_namespace)
    except (EngineStartupError, ValueError, OSError) as e:
        logger.error("API server %d could not start: %s", index, e)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(0)
    try:
        sock = bind_port(server_args.host, server_args.port)
    except OSError as e:
        logger.error("API server %d could not bind %s:%d: %s", index, server_args.host, server_args.port, e)
        engine.shutdown()
        sys.exit(1)
    exit_without_teardown(serve_engine(engine, server_args, sock))  # as one server's process ends (cli.py)


class _Supervisor:
    """The engine process and the API server processes, started and stopped together."""

    def __init__(self, server_args: ServerArgs, config: EngineConfig, folder: str) -> None:
        self.server_args = server_args
        self.config = config
        self.folder = folder
        self.count = server_args.api_server_count
        self.engine = EngineProcess(config)
        self.servers: list[multiprocessing.process.BaseProcess] = []
        self._pipes: list[Any] = []
        self.stop_requested = False
        self.engine_died = False
        # Written to by `request_stop` (a signal handler), so that `wait` returns at once.
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)

    def request_stop(self) -> None:
        self.stop_requested = True
        try:
            os.write(self._wake_write, b"\0")
        except BlockingIOError:  # a wake-up is pending already
            pass

    def start(self) -> None:
        """The engine first (its handshake says how big the KV cache came out), then the servers."""
        outputs = [f"ipc://{self.folder}/output{i}" for i in range(self.count)]
        self.engine.start(outputs)
        handshake = self.engine.wait_ready()  # each API server's client reads the KV cache's size from it
        logger.info("Engine core (pid %d) ready; starting %d API server processes.", self.engine.pid, self.count)
        mp = multiprocessing.get_context("spawn")
        for i in range(self.count):
            parent_end, child_end = mp.Pipe()
            server = mp.Process(
                target=run_api_server_process, name=f"APIServer_{i}",
                args=(self.server_args, self.config, i, self.engine.input_address, outputs[i], self.engine.pid,
                      handshake, child_end),
            )
            server.start()
            child_end.close()
            self.servers.append(server)
            self._pipes.append(parent_end)

    def wait(self) -> int:
        """Until a signal, or a child's exit; 0 when told to stop and all went well, else 1."""
        assert self.engine.proc is not None
        engine_sentinel = self.engine.proc.sentinel
        sentinels = {server.sentinel: server for server in self.servers}
        while not self.stop_requested:
            ready = multiprocessing.connection.wait([engine_sentinel, *sentinels, self._wake_read])
            if self.stop_requested:  # Ctrl-C reaches the children too: their exits are expected now
                break
            if engine_sentinel in ready:
                logger.error("The engine core exited (exit code %s); the API servers fail their open requests "
                             "and exit.", self.engine.proc.exitcode)
                self.engine_died = True
                return 1
            for sentinel in ready:
                server = sentinels[sentinel]
                server.join()
                logger.error("%s exited (exit code %s); stopping the others and the engine.", server.name,
                             server.exitcode)
                return 1
        return 0

    def stop(self) -> bool:
        """Servers first (they end their streams), then the engine; whether every server exited cleanly."""
        clean = True
        deadline = time.monotonic() + _STOP_TIMEOUT_S
        if self.engine_died:  # they notice it, end each open stream with the error and exit: let them
            for server in self.servers:
                server.join(max(deadline - time.monotonic(), 0))
        for server in self.servers:
            if server.is_alive():
                server.terminate()
        for server in self.servers:
            server.join(max(deadline - time.monotonic(), 0))
            if server.is_alive():
                logger.warning("%s did not exit within %.0f s; killing it.", server.name, _STOP_TIMEOUT_S)
                server.kill()
                server.join(5)
                clean = False
            elif server.exitcode not in (0, -signal.SIGTERM):
                clean = False
        for pipe in self._pipes:
            pipe.close()
        self.engine.stop()
        os.close(self._wake_read)
        os.close(self._wake_write)
        return clean


def run_api_server_group(server_args: ServerArgs, engine_args: EngineArgs) -> int:
    """`compiled-llm serve --api-server-count N` (N > 1): 0 after a clean shutdown, 1 when the
    engine or an API server failed to start or died."""
    try:
        config = engine_args.create_engine_config()
    except (ValueError, OSError) as e:
        logger.error("%s", e)
        return 1
    if config.parallel_config.data_parallel_size > 1:
        logger.error("--api-server-count > 1 serves one engine core; it does not combine with "
                     "--data-parallel-size %d yet.", config.parallel_config.data_parallel_size)
        return 1
    try:
        claim = claim_port(server_args.host, server_args.port)
    except OSError as e:
        logger.error("Could not bind %s:%d: %s", server_args.host, server_args.port, e)
        return 1
    server_args = dataclasses.replace(server_args, port=claim.getsockname()[1])  # --port 0: the one chosen
    folder = tempfile.mkdtemp(prefix="compiled-llm-api-")
    metrics_dir = os.path.join(folder, "metrics")
    os.mkdir(metrics_dir)
    previous_metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir  # inherited by the API servers
    os.environ[GROUP_METRICS_ENV] = "1"
    supervisor = _Supervisor(server_args, config, folder)

    def request_stop(signum: int, frame: Any) -> None:
        supervisor.request_stop()

    # While the engine starts (minutes of loading or compiling, maybe), a signal interrupts the wait
    # at once, as for one server; once all runs, it asks the waiting loop to stop.
    signals = (signal.SIGTERM, signal.SIGINT)
    previous_handlers = {sig: signal.signal(sig, raise_keyboard_interrupt) for sig in signals}
    status = 1
    try:
        supervisor.start()
        for sig in signals:
            signal.signal(sig, request_stop)
        status = supervisor.wait()
    except KeyboardInterrupt:
        status = 130
    except EngineStartupError as e:
        logger.error("%s", e)
    finally:
        for sig in previous_handlers:  # a second Ctrl-C must not interrupt the shutdown
            signal.signal(sig, signal.SIG_IGN)
        if not supervisor.stop() and status == 0:
            status = 1
        claim.close()
        shutil.rmtree(folder, ignore_errors=True)
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        os.environ.pop(GROUP_METRICS_ENV, None)
        if previous_metrics_dir is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous_metrics_dir
    logger.info("Stopped (exit status %d).", status)
    return status

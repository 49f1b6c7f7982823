"""How the frontend holds an engine core: where to reach it, whether it is ready, whether it is gone.

`AsyncMPClient` owns the sockets, the sender and the receiver; an `EngineHandle` owns only the
engine's life. `EngineProcess` is a local process reached over `ipc://` (the default);
`ray_engine.RayEngine` is a Ray actor, maybe on another node, reached over tcp; `AttachedEngine`
is a local engine that another process started and owns (one of several API server processes,
`serve --api-server-count`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import select
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Protocol

import msgspec

from compiled_llm.config import EngineConfig
from compiled_llm.logger import init_logger
from compiled_llm.messages.engine_core import Handshake

logger = init_logger(__name__)


class EngineStartupError(RuntimeError):
    """The engine core could not start (the message says why)."""


class EngineHandle(Protocol):
    """The engine's life as the client sees it.

    `output_bind_address`: where the client binds its output socket (a tcp port may be `*`);
    `start(output_address)` gets the bound address; `input_address` is valid after `start`.
    `sentinel`: a file descriptor that turns readable once the engine is gone, for the poller.
    `owns_engine`: the client's shutdown stops the engine (not so for an engine shared by several
    clients: its owner stops it).
    """

    input_address: str
    output_bind_address: str
    sentinel: int
    owns_engine: bool

    @property
    def pid(self) -> int | None: ...

    def start(self, output_address: str) -> None: ...

    def wait_ready(self) -> Handshake: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float) -> None: ...

    def describe_exit(self) -> str: ...

    def kill(self) -> None: ...

    def stop(self) -> None: ...


def _stop_engine(proc: multiprocessing.process.BaseProcess, conn: Any, folder: str) -> None:
    """Ask the engine to exit, then insist; runs at shutdown and, as a last resort, at exit."""
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        logger.warning("The engine core did not exit within 5 s of SIGTERM; killing it.")
        proc.kill()
        proc.join(5)
    conn.close()
    shutil.rmtree(folder, ignore_errors=True)


def _engine_main(client_end: Any, *args: Any) -> None:
    """The engine process's entry point. A forked child first closes its copy of the client's end
    of the pipe (holding it, it would never see the client go). The engine's own modules (the
    worker, the models, Dynamo) are imported here, never by the client's process."""
    if client_end is not None:
        client_end.close()
    from compiled_llm.core.core_proc import run_engine_core

    run_engine_core(*args)


def fork_is_safe(config: EngineConfig) -> bool:
    """Whether the engine may be forked from this process rather than spawned: on a CPU only, with
    CUDA not initialised here, where the platform forks. The caller vouches for the rest: that
    this process has run no torch computation yet (a forked child of a process whose OpenMP
    threads ran hangs in its first parallel region) and holds no sockets or threads the engine
    must not inherit. `compiled-llm serve` forks before anything else starts."""
    if config.torch_device.type != "cpu" or "fork" not in multiprocessing.get_all_start_methods():
        return False
    import torch

    return not torch.cuda.is_initialized()


class EngineProcess:
    """The engine core in a local process, reached over two `ipc://` sockets in a temp folder.
    Start-up handshake over a pipe, whose end of file also tells the engine that its client is
    gone; death is the process's sentinel.

    Spawned by default. `fork=True` (where `fork_is_safe`): forked, so that the child starts with
    what this process imported already (torch, transformers, the config: seconds of a start)."""

    owns_engine = True

    def __init__(self, config: EngineConfig, engine_index: int = 0, fork: bool = False) -> None:
        self._config = config
        self._engine_index = engine_index
        self._fork = fork and fork_is_safe(config)
        self._folder = tempfile.mkdtemp(prefix="compiled-llm-")
        self.input_address = f"ipc://{self._folder}/input"
        self.output_bind_address = f"ipc://{self._folder}/output"
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._output_address: str | list[str] | None = None

    def start(self, output_address: str | list[str]) -> None:
        """`output_address`: the client's output socket, or one per client (several API servers).
        Starting again with the same address does nothing: the engine may be started before its
        client exists (its output socket queues until the client binds), for the two to overlap."""
        if self.proc is not None:
            if output_address != self._output_address:
                raise ValueError(f"The engine was started to send to {self._output_address}, not {output_address}.")
            return
        self._output_address = output_address
        self.started_at = time.perf_counter()  # for the start-up line: the process may predate its client
        if self._fork:  # else the child would write out this process's buffered output again
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
        mp = multiprocessing.get_context("fork" if self._fork else "spawn")
        self._conn, child_conn = mp.Pipe()
        self.proc = mp.Process(
            target=_engine_main,
            name="EngineCore",
            args=(self._conn if self._fork else None, self._config, self.input_address, output_address, child_conn,
                  self._engine_index),
        )
        self.proc.start()
        child_conn.close()
        self.sentinel = self.proc.sentinel
        # Runs at interpreter exit before multiprocessing joins its children, so a forgotten
        # client neither hangs the exit nor leaves the engine behind.
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_engine, args=(self.proc, self._conn, self._folder), exitpriority=10
        )

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def wait_ready(self) -> Handshake:
        assert self.proc is not None
        ready = multiprocessing.connection.wait([self._conn, self.proc.sentinel])
        if self._conn in ready:
            try:
                handshake = msgspec.msgpack.decode(self._conn.recv_bytes(), type=Handshake)
            except EOFError:
                handshake = None
            if handshake is not None:
                if handshake.ok:
                    return handshake
                raise EngineStartupError(f"The engine core failed to start: {handshake.error}")
        self.proc.join(5)
        raise EngineStartupError(
            f"The engine core process exited during start-up (exit code {self.proc.exitcode}); see its log above."
        )

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.is_alive()

    def join(self, timeout: float) -> None:
        if self.proc is not None:
            self.proc.join(timeout)

    def describe_exit(self) -> str:
        return f"The engine core process exited unexpectedly (exit code {self.proc and self.proc.exitcode})."

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()

    def stop(self) -> None:
        """Terminate (then kill) and join the process; remove the socket folder."""
        if self.proc is None:
            shutil.rmtree(self._folder, ignore_errors=True)
        else:
            self._finalizer()


class AttachedEngine:
    """An engine core that another local process started and owns (the `serve` supervisor, for
    several API server processes): this client only connects to it, with the handshake its owner
    received. Its death is seen through a pidfd, which turns readable when the process exits, even
    for a process that is not this one's child (Linux 5.3 and later)."""

    owns_engine = False

    def __init__(self, pid: int, input_address: str, output_bind_address: str, handshake: Handshake) -> None:
        self.input_address = input_address
        self.output_bind_address = output_bind_address
        self._pid = pid
        self._handshake = handshake
        try:
            self.sentinel = os.pidfd_open(pid)
        except ProcessLookupError as e:
            raise EngineStartupError(f"The engine core process (pid {pid}) is gone.") from e
        except OSError as e:  # e.g. a container's seccomp profile without pidfd_open (Linux < 5.3)
            raise EngineStartupError(f"Cannot watch the engine core process (pidfd_open: {e}); several API "
                                     "server processes need Linux 5.3 or later and pidfd_open allowed.") from e
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._pid

    def start(self, output_address: str) -> None:
        if output_address != self.output_bind_address:
            raise ValueError(f"The engine was started to send to {self.output_bind_address}, not {output_address}.")

    def wait_ready(self) -> Handshake:
        return self._handshake

    def is_alive(self) -> bool:
        return not self._closed and not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float) -> None:
        if not self._closed:
            select.select([self.sentinel], [], [], timeout)

    def describe_exit(self) -> str:
        return f"The engine core process (pid {self._pid}) exited unexpectedly; see its log."

    def kill(self) -> None:
        """A hung engine hangs every API server: kill it (the owner then stops the rest)."""
        try:
            signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """Only let go of it: its owner stops it."""
        if not self._closed:
            self._closed = True
            os.close(self.sentinel)

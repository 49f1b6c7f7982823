"""`EngineCore` inside a Ray actor: one engine of a data-parallel group that Ray may place on any
node of its cluster (`--data-parallel-size N --distributed-executor-backend ray`).

Only the start and the end differ from the local engine process (`core_proc.run_engine_core`):
the messages, the socket threads and the busy loop are the same `EngineCoreProc`. The frontend
learns readiness from `start()`'s return value (the `Handshake`), and the engine's death from
`run()`, a call that lasts as long as the engine: its result fails with `RayActorError` when the
actor dies. No pipe to watch: Ray ends an actor when the driver that owns it goes.

Sockets are ZeroMQ over tcp, since `ipc://` reaches no other host. They are reachable from the
network, so the engine binds its input socket to its node's own address (never 0.0.0.0), and
every frame is decoded as msgpack into the known msgspec types: a peer can send data, not code.
Keep the cluster's network private all the same: anyone who reaches the port can submit work.
"""

from __future__ import annotations

import os

from compiled_llm.config import EngineConfig
from compiled_llm.core.core_proc import EngineCoreProc, serve_engine_core, start_engine_core
from compiled_llm.messages.engine_core import Handshake
from compiled_llm.utils import get_open_port


class EngineCoreActor:
    """One engine of a data-parallel group (the class is wrapped by `ray.remote` at run time)."""

    def __init__(self, engine_index: int) -> None:
        import ray

        self.engine_index = engine_index
        self.node_id = ray.get_runtime_context().get_node_id()
        ip = ray.util.get_node_ip_address()
        self.input_address = f"tcp://{ip}:{get_open_port(ip)}"
        self._proc: EngineCoreProc | None = None

    def where(self) -> tuple[str, str, int]:
        """(input address to connect to, node id, pid): known as soon as Ray placed the actor."""
        return self.input_address, self.node_id, os.getpid()

    def start(self, config: EngineConfig, output_address: str) -> Handshake:
        """Load the model, bind the input socket, connect the output one; the handshake says how it went."""
        self._proc, handshake = start_engine_core(config, self.input_address, output_address, self.engine_index)
        return handshake

    def run(self) -> int:
        """The busy loop, until SHUTDOWN; returns the exit code (1: the engine died of an error)."""
        if self._proc is None:
            return 1
        proc, self._proc = self._proc, None
        return serve_engine_core(proc)

"""Tensor parallelism over local processes: rank 0 (the driver) in the engine core's process, ranks
1..N-1 spawned, each told every step's scheduler output over its pipe (msgpack, no pickle).

Start-up commands (KV sizing, allocation, compilation) go to every rank at once and wait for
their answers; a step's command is sent without waiting: the ranks meet in the collectives of the
forward, and the driver hands back the step's output. A rank that dies ends the engine: its
process's exit is noticed (here, or by the collective that loses its peer), never waited on.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
from typing import Any, Callable

import msgspec
import torch

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from compiled_llm.executor.base import MultiRankExecutor
from compiled_llm.logger import init_logger
from compiled_llm.messages.runner_output import AsyncModelRunnerOutput
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.utils import get_open_port
from compiled_llm.worker.worker import run_worker_process

logger = init_logger(__name__)


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank's process exited: the engine cannot go on without its slice."""


class MultiprocExecutor(MultiRankExecutor):
    def __init__(self, config: EngineConfig, exit_on_worker_death: bool = False) -> None:
        super().__init__(config)
        self._exit_on_worker_death = exit_on_worker_death
        world_size = config.parallel_config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        context = multiprocessing.get_context("spawn")
        self._encoder = msgspec.msgpack.Encoder()
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._closing = False
        for rank in range(1, world_size):
            parent, child = context.Pipe()
            proc = context.Process(target=run_worker_process, args=(config, rank, init_method, child),
                                   name=f"Worker_TP{rank}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        try:
            init_tensor_parallel(0, world_size, init_method, config.torch_device)
            self._build_driver()
            self._collect()  # every rank built its slice
        except BaseException:
            self.shutdown()
            raise
        if exit_on_worker_death:
            threading.Thread(target=self._watch, name="WorkerWatch", daemon=True).start()

    # ---- commands ------------------------------------------------------------------------------
    def _send(self, name: str, arg: Any) -> None:
        frame = self._encoder.encode([name, arg])
        for conn in self._conns:
            conn.send_bytes(frame)

    def _collect(self) -> list[Any]:
        """Each worker's answer to the last command; a dead worker or a failed command raises."""
        results = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            ready = multiprocessing.connection.wait([conn, proc.sentinel])
            if conn not in ready:
                raise WorkerDiedError(f"Tensor-parallel rank {rank} exited (code {proc.exitcode}); see its log.")
            status, value = msgspec.msgpack.decode(conn.recv_bytes())
            if status == "error":
                raise RuntimeError(f"Tensor-parallel rank {rank} failed: {value}")
            results.append(value)
        return results

    def _send_to_workers(self, method: str, args: tuple[Any, ...]) -> None:
        self._send(method, args)

    def _worker_results(self, pending: None) -> list[Any]:
        return self._collect()

    # ---- the executor --------------------------------------------------------------------------
    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> AsyncModelRunnerOutput:
        self._send("execute", self._encoder.encode(scheduler_output))
        return self.driver.execute_model_async(scheduler_output, grammar_bitmask)

    # ---- liveness and shutdown -----------------------------------------------------------------
    def _watch(self) -> None:
        """A rank that dies mid-serving leaves the others waiting in a collective: end the engine
        core's process, whose exit its client reports as the engine's death."""
        multiprocessing.connection.wait([p.sentinel for p in self._procs])
        if not self._closing:
            dead = next(p for p in self._procs if not p.is_alive())
            logger.error("Tensor-parallel rank %s exited (code %s); the engine stops.", dead.name, dead.exitcode)
            os._exit(1)

    def shutdown(self) -> None:
        self._closing = True
        for conn in self._conns:
            try:
                conn.send_bytes(self._encoder.encode(["shutdown", None]))
            except (OSError, ValueError):
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        destroy_tensor_parallel()

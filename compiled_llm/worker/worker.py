"""A tensor-parallel rank other than the driver: a model runner that follows the driver's steps.

It builds its slice of the model, sizes and allocates its slice of the KV cache, compiles (or
loads) its own pieces, and for every step applies the same scheduler output as the driver and
runs the same forward, meeting the other ranks in the collectives inside it. It samples nothing:
the driver samples and broadcasts the ids, which this rank's rows take in as the driver's do.

The same object serves a local process (`run_worker_process`, commands over a pipe) and a Ray
actor (`executor/ray_executor.py`).
"""

from __future__ import annotations

import os
import signal
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any, Sequence

import msgspec

from compiled_llm.config import EngineConfig
from compiled_llm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from compiled_llm.logger import init_logger
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.worker.model_runner import ModelRunner
from compiled_llm.worker.step_output import StepOutput

logger = init_logger(__name__)


# The runner methods the driver may call on every rank by name (`Executor.collective_rpc`): a
# name crosses the pipe, never code, and only these names run.
RUNNER_METHODS = frozenset({"determine_num_blocks", "initialize_kv_cache", "compile_or_warm_up", "compile",
                            "pin_lora", "unpin_lora"})


def call_runner(runner: ModelRunner, method: str, args: Sequence[Any]) -> Any:
    """`runner.method(*args)` for a method of `RUNNER_METHODS` (any other name is refused)."""
    if method not in RUNNER_METHODS:
        raise ValueError(f"{method!r} is not a runner method the driver may call (one of {sorted(RUNNER_METHODS)}).")
    return getattr(runner, method)(*args)


class Worker:
    def __init__(self, config: EngineConfig, rank: int, init_method: str) -> None:
        self.rank = rank
        init_tensor_parallel(rank, config.parallel_config.tensor_parallel_size, init_method, config.torch_device)
        self.runner = ModelRunner(config)
        self._async = config.scheduler_config.async_scheduling
        self._steps: deque[StepOutput] = deque()
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)

    def call(self, method: str, args: Sequence[Any]) -> Any:
        """A start-up command the driver runs on every rank (`call_runner`)."""
        return call_runner(self.runner, method, args)

    def execute(self, payload: bytes) -> None:
        """Run the step the driver runs. Sampled ids are taken in one step late under asynchronous
        scheduling (the next step reads them on the device), at once otherwise."""
        self._steps.append(self.runner.execute_model_async(self._decoder.decode(payload)))
        while len(self._steps) > (1 if self._async else 0):
            self._steps.popleft().get_output()

    def shutdown(self) -> None:
        destroy_tensor_parallel()


def run_worker_process(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    """Entry point of a worker process (spawned): answer the driver's commands until it goes. A
    command is `[name, arg]`: "execute" and a step's scheduler output (msgpack, not answered),
    "shutdown", or a runner method of `RUNNER_METHODS` and its arguments (answered)."""
    from setproctitle import setproctitle

    setproctitle(f"compiled_llm::Worker_TP{rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when this rank ends
    encoder = msgspec.msgpack.Encoder()
    try:
        worker = Worker(config, rank, init_method)
    except BaseException as e:
        logger.exception("Tensor-parallel rank %d failed to start.", rank)
        conn.send_bytes(encoder.encode(["error", f"{type(e).__name__}: {e}"]))
        os._exit(1)
    conn.send_bytes(encoder.encode(["ready", None]))
    while True:
        try:
            name, arg = msgspec.msgpack.decode(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver is gone
        if name == "shutdown":
            break
        try:
            if name == "execute":
                worker.execute(arg)
                continue
            conn.send_bytes(encoder.encode(["ok", worker.call(name, arg)]))
        except BaseException as e:
            logger.error("Tensor-parallel rank %d failed in %s:\n%s", rank, name, traceback.format_exc())
            if name == "execute":
                os._exit(1)  # the driver waits in a collective: only this process's exit frees it
            conn.send_bytes(encoder.encode(["error", f"{type(e).__name__}: {e}"]))
    worker.shutdown()
    os._exit(0)

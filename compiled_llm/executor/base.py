"""What the engine core asks of its ranks. The driver (rank 0) runs in the engine core's process:
its runner samples and hands back each step's output; the other ranks follow the same steps on
their slices of the model and meet the driver in the collectives inside the forward."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.messages.runner_output import AsyncModelRunnerOutput, ModelRunnerOutput
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.worker.model_runner import ModelRunner
from compiled_llm.worker.worker import call_runner


class Executor:
    driver: ModelRunner

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.load_seconds = 0.0

    def _build_driver(self) -> None:
        started = time.perf_counter()
        self.driver = ModelRunner(self.config)
        self.load_seconds = time.perf_counter() - started

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call the runner's `method(*args)` on every rank at once (the start-up commands: the
        profiling run and the compiled forward hold collectives); returns each rank's answer, in
        rank order. `method` is one of `worker.worker.RUNNER_METHODS`."""
        raise NotImplementedError

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> AsyncModelRunnerOutput:
        """Launch a step on every rank; `grammar_bitmask` is the driver's (it alone samples)."""
        raise NotImplementedError

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output, grammar_bitmask).get_output()

    def shutdown(self) -> None:
        pass


class MultiRankExecutor(Executor):
    """An executor with ranks beyond the driver. A command goes to the other ranks first (they meet
    the driver in the collectives it holds), then runs on the driver; subclasses say only how a
    command reaches the other ranks and how their answers come back."""

    def _send_to_workers(self, method: str, args: tuple[Any, ...]) -> Any:
        """Start `method(*args)` on every other rank; returns what `_worker_results` needs."""
        raise NotImplementedError

    def _worker_results(self, pending: Any) -> list[Any]:
        raise NotImplementedError

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        pending = self._send_to_workers(method, args)
        mine = call_runner(self.driver, method, args)
        return [mine, *self._worker_results(pending)]

"""One rank: the model runner in the engine core's own process."""

from __future__ import annotations

from typing import Any, Callable

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.executor.base import Executor
from compiled_llm.messages.runner_output import AsyncModelRunnerOutput
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.worker.worker import call_runner


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._build_driver()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [call_runner(self.driver, method, args)]

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> AsyncModelRunnerOutput:
        return self.driver.execute_model_async(scheduler_output, grammar_bitmask)

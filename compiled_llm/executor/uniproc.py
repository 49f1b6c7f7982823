"""One rank: the model runner in the engine core's own process."""

from __future__ import annotations

from typing import Any, Callable

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.executor.base import Executor
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.worker.step_output import StepOutput
from compiled_llm.worker.worker import compile_summary


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._build_driver()

    def determine_num_blocks(self) -> int:
        return self.driver.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.driver.initialize_kv_cache(num_blocks)

    def compile_or_warm_up(self) -> None:
        self.driver.compile_or_warm_up()

    def compile(self) -> list[dict[str, Any]]:
        self.driver.compile()
        return [compile_summary(self.driver, 0)]

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> StepOutput:
        return self.driver.execute_model_async(scheduler_output, grammar_bitmask)

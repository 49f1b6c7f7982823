"""What the engine core asks of its ranks. The driver (rank 0) runs in the engine core's process:
its runner samples and hands back each step's output; the other ranks follow the same steps on
their slices of the model and meet the driver in the collectives inside the forward."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.messages.runner_output import ModelRunnerOutput
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.worker.model_runner import ModelRunner
from compiled_llm.worker.step_output import StepOutput


class Executor:
    driver: ModelRunner

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.load_seconds = 0.0

    def _build_driver(self) -> None:
        started = time.perf_counter()
        self.driver = ModelRunner(self.config)
        self.load_seconds = time.perf_counter() - started

    # Every rank at once: the profiling run and the compiled forward hold collectives.
    def determine_num_blocks(self) -> int:
        """KV-cache blocks that fit on every rank (the smallest rank decides)."""
        raise NotImplementedError

    def initialize_kv_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def compile_or_warm_up(self) -> None:
        raise NotImplementedError

    def compile(self) -> list[dict[str, Any]]:
        """Compile (or load) without capturing CUDA graphs, on every rank (what `precompile`
        does); returns what each rank did."""
        raise NotImplementedError

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> StepOutput:
        """Launch a step on every rank; `grammar_bitmask` is the driver's (it alone samples)."""
        raise NotImplementedError

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: Callable[[], torch.Tensor] | None = None
    ) -> ModelRunnerOutput:
        return self.execute_model_async(scheduler_output, grammar_bitmask).get_output()

    def shutdown(self) -> None:
        pass

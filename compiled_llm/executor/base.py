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
from compiled_llm.worker.worker import compile_summary


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


class MultiRankExecutor(Executor):
    """An executor with ranks beyond the driver. A command goes to the other ranks first (they meet
    the driver in the collectives it holds), then runs on the driver; subclasses say only how a
    command reaches the other ranks and how their answers come back."""

    def _send_to_workers(self, name: str, arg: Any) -> Any:
        """Start `name(arg)` on every other rank; returns what `_worker_results` needs."""
        raise NotImplementedError

    def _worker_results(self, pending: Any) -> list[Any]:
        raise NotImplementedError

    def _on_every_rank(self, name: str, arg: Any = None) -> tuple[Any, list[Any]]:
        pending = self._send_to_workers(name, arg)
        if name == "compile":
            self.driver.compile()
            mine = compile_summary(self.driver, 0)
        else:
            mine = getattr(self.driver, name)(*([] if arg is None else [arg]))
        return mine, self._worker_results(pending)

    def determine_num_blocks(self) -> int:
        mine, theirs = self._on_every_rank("determine_num_blocks")
        return min([mine, *theirs])

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._on_every_rank("initialize_kv_cache", num_blocks)

    def compile_or_warm_up(self) -> None:
        self._on_every_rank("compile_or_warm_up")

    def compile(self) -> list[dict[str, Any]]:
        mine, theirs = self._on_every_rank("compile")
        return [mine, *theirs]

"""The engine core: scheduler + model runner, stepped one batch at a time.

`EngineCore` is the in-process object; `engine/core_proc.py` runs one in its own process
behind ZeroMQ sockets.
"""

from __future__ import annotations

import time
from collections import deque

from compiled_llm.config import EngineConfig
from compiled_llm.core.request import Request
from compiled_llm.core.scheduler import Scheduler
from compiled_llm.logger import init_logger
from compiled_llm.messages.engine_core import EngineCoreOutputs, EngineCoreRequest
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.worker.model_runner import ModelRunner
from compiled_llm.worker.step_output import StepOutput

logger = init_logger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        self.runner = ModelRunner(config)
        logger.info("Model weights loaded in %.2f s.", self.runner.load_seconds)
        t = time.perf_counter()
        num_blocks = self.runner.determine_num_blocks()
        config.cache_config.num_blocks = num_blocks
        self.runner.initialize_kv_cache(num_blocks)
        self.kv_seconds = time.perf_counter() - t
        self.runner.compile_or_warm_up()
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config)
        self._in_flight: deque[tuple[SchedulerOutput, StepOutput]] = deque()  # launched, not yet accounted
        self.startup_seconds = time.perf_counter() - started
        logger.info("Engine core ready in %.2f s.", self.startup_seconds)

    def check_request(self, request: EngineCoreRequest) -> None:
        """Refuse (ValueError) what the model cannot run. The frontend checks the same first; the
        engine checks again because a bad request here would kill it, and with it every other one."""
        mc = self.config.model_config
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("The prompt is empty.")
        if len(ids) > mc.max_model_len:
            raise ValueError(f"The prompt is {len(ids)} tokens long, more than max_model_len={mc.max_model_len}.")
        if min(ids) < 0 or max(ids) >= mc.vocab_size:
            bad = next(t for t in ids if not 0 <= t < mc.vocab_size)
            raise ValueError(f"Token id {bad} is out of the vocabulary (size {mc.vocab_size}).")
        params = request.sampling_params
        if params.n != 1:
            raise ValueError(f"The engine runs one sequence per request (the frontend fans out n), got n={params.n}.")
        if params.logprobs is not None and params.logprobs > mc.max_logprobs:
            raise ValueError(f"logprobs must be at most {mc.max_logprobs}, got {params.logprobs}.")
        bad_stops = [t for t in params.stop_token_ids or [] if t >= mc.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids holds {bad_stops[0]}, outside the vocabulary (size {mc.vocab_size}).")

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_request(request)
        self.scheduler.add_request(
            Request(
                request.request_id,
                request.prompt_token_ids,
                request.sampling_params,
                self.config.model_config.eos_token_ids,
                self.config.cache_config.block_size,
                request.arrival_time,
                request.priority,
            )
        )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def step(self) -> EngineCoreOutputs:
        """Schedule, run and account one step (its outputs may be empty)."""
        if self.config.scheduler_config.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs([], self.scheduler.make_stats(), time.time())
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(), time.time())

    def _step_async(self) -> EngineCoreOutputs:
        """Launch the next step, then account the one launched before it: the device runs a step
        while the host schedules the next and reads the last one's tokens, which the host thus
        learns a step late (two steps in flight at most)."""
        launched = False
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            step = self.runner.execute_model_async(scheduler_output)
            if not scheduler_output.empty:
                self._in_flight.append((scheduler_output, step))
                launched = True
        outputs = []
        if len(self._in_flight) > 1 or (self._in_flight and not launched):
            scheduler_output, step = self._in_flight.popleft()
            outputs = self.scheduler.update_from_output(scheduler_output, step.get_output())
        return EngineCoreOutputs(outputs, self.scheduler.make_stats(), time.time())

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        pass

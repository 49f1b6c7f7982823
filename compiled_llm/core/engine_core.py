"""The engine core: scheduler + model runner, stepped one batch at a time.

`EngineCore` is the in-process object; `engine/core_proc.py` runs one in its own process
behind ZeroMQ sockets.

A request with structured outputs waits (in `StructuredOutputManager`) until its grammar is
compiled, then joins the scheduler. Each step that samples such a request fills the grammar
bitmask after the forward is launched and before sampling: under asynchronous scheduling that is
also when the step in flight is accounted, so that every grammar has seen its request's previous
token before it says which tokens may come next.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Callable

import torch

from compiled_llm.config import EngineConfig
from compiled_llm.core.request import Request
from compiled_llm.core.scheduler import Scheduler
from compiled_llm.core.structured_outputs.manager import StructuredOutputManager
from compiled_llm.executor import make_executor
from compiled_llm.logger import init_logger
from compiled_llm.messages.engine_core import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from compiled_llm.messages.runner_output import AsyncModelRunnerOutput
from compiled_llm.messages.scheduler_output import SchedulerOutput
from compiled_llm.structured_output_spec import grammar_spec

if TYPE_CHECKING:
    from compiled_llm.lora.request import LoRARequest

# How long an idle engine blocks on a grammar being compiled before it looks at its inputs again.
_GRAMMAR_WAIT_SECONDS = 0.05
# How often speculative decoding's acceptance rate is logged (when drafts were verified meanwhile).
_SPEC_LOG_SECONDS = 10.0
# Every how many LoRA requests the pins of adapters no unfinished request names any more are released
# (also whenever an adapter is pinned anew).
_LORA_UNPIN_EVERY = 256

logger = init_logger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, exit_on_worker_death: bool = False) -> None:
        """`exit_on_worker_death`: this is the engine core's own process (a tensor-parallel rank
        that dies ends it, and its client reports the engine's death)."""
        started = time.perf_counter()
        self.config = config
        # Every rank's runner; this process holds the driver's (rank 0), which samples.
        self.executor = make_executor(config, exit_on_worker_death)
        logger.info("Model weights loaded in %.2f s.", self.executor.load_seconds)
        t = time.perf_counter()
        # What fits on every rank: a result of start-up, kept here (the config stays as it was resolved).
        self.num_blocks: int = min(self.executor.collective_rpc("determine_num_blocks"))
        self.executor.collective_rpc("initialize_kv_cache", self.num_blocks)
        self.kv_seconds = time.perf_counter() - t
        # The driver's CUDA-graph capture time, for the start-up line (ranks capture side by side).
        self.capture_seconds = float(self.executor.collective_rpc("compile_or_warm_up")[0] or 0.0)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.num_blocks,
                                   config.speculative_config,
                                   config.lora_config.max_loras if config.lora_config is not None else None,
                                   measure_step_cost=config.torch_device.type == "cpu")
        self._in_flight: deque[tuple[SchedulerOutput, AsyncModelRunnerOutput]] = deque()  # launched, not accounted
        # The last step (its plan, outputs, start and forward's seconds), timed when the next begins.
        self._last_step: tuple[SchedulerOutput, list[EngineCoreOutput], float, float] | None = None
        self.structured_outputs: StructuredOutputManager | None = None  # made by the first constrained request
        # LoRA: adapter id -> (its folder, the requests that named it since it was pinned on the ranks).
        self._lora_pins: dict[int, tuple[str, set[str]]] = {}
        self._lora_adds = 0
        self.startup_seconds = time.perf_counter() - started
        logger.info("Engine core ready in %.2f s.", self.startup_seconds)
        spec = config.speculative_config
        if spec is not None:
            source = (f"n-grams of {spec.prompt_lookup_min} to {spec.prompt_lookup_max} tokens"
                      if spec.method == "ngram" else f"draft model {spec.model}")
            logger.info("Speculative decoding: %s, %d tokens per step, %s; the acceptance rate is logged every %d s.",
                        spec.method, spec.num_speculative_tokens, source, _SPEC_LOG_SECONDS)
        self._spec_logged = (time.monotonic(), 0, 0, 0)  # when, and the totals (drafts, proposed, accepted) then

    def check_request(self, request: EngineCoreRequest) -> None:
        """Refuse (ValueError) what the model cannot run. The frontend checks the same first; the
        engine checks again because a bad request here would kill it, and with it every other one.
        A structured outputs constraint is parsed when it is compiled, off the step loop (the first
        one would stall every running request while xgrammar loads): a bad one ends its request
        with an error naming the problem."""
        mc = self.config.model_config
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("The prompt is empty.")
        if len(ids) > mc.max_model_len:
            raise ValueError(f"The prompt is {len(ids)} tokens long, more than max_model_len={mc.max_model_len}.")
        if min(ids) < 0 or max(ids) >= mc.vocab_size:
            bad = next(t for t in ids if not 0 <= t < mc.vocab_size)
            raise ValueError(f"Token id {bad} is out of vocabulary (vocabulary size {mc.vocab_size}).")
        pooling = mc.runner == "pooling"
        if (request.pooling_params is not None) != pooling:
            raise ValueError("This engine runs the pooling runner: it embeds prompts and generates no text."
                             if pooling else "This engine generates text: pooling (embeddings) needs --runner pooling.")
        if request.pooling_params is not None:
            request.pooling_params.verify(mc.hf_config.hidden_size, mc.hf_config)
        if request.lora_request is not None and self.config.lora_config is None:
            raise ValueError(f"LoRA adapter {request.lora_request.lora_name!r}: this engine runs without LoRA "
                             "(start it with enable_lora / --enable-lora).")
        params = request.sampling_params
        if params.n != 1:
            raise ValueError(f"The engine runs one sequence per request (the frontend fans out n), got n={params.n}.")
        if params.logprobs is not None and 0 <= mc.max_logprobs < params.logprobs:  # -1: no limit
            raise ValueError(f"logprobs must be at most {mc.max_logprobs}, got {params.logprobs}.")
        bad_stops = [t for t in params.stop_token_ids or [] if t >= mc.vocab_size]
        if bad_stops:
            raise ValueError(f"stop_token_ids holds {bad_stops[0]}, outside the vocabulary (size {mc.vocab_size}).")
        params.verify_for_model(mc.vocab_size, mc.max_logprobs)
        if params.structured_outputs is not None:
            grammar_spec(params.structured_outputs)  # a schema that is not even JSON

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_request(request)
        if request.lora_request is not None:
            self._pin_lora(request.request_id, request.lora_request)
        core_request = Request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            self.config.model_config.eos_token_ids,
            self.config.cache_config.block_size,
            request.arrival_time,
            request.priority,
            request.parent_id,
            request.pooling_params,
            request.lora_request,
        )
        if self.structured_outputs is not None and request.request_id in self.structured_outputs:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.sampling_params.structured_outputs is None:
            self.scheduler.add_request(core_request)
            return
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.structured_outputs is None:
            self.structured_outputs = StructuredOutputManager(
                self.config.model_config, self.config.scheduler_config.max_num_seqs
            )
        self.structured_outputs.add_request(core_request)  # joins the scheduler once compiled

    def _pin_lora(self, request_id: str, lora: LoRARequest) -> None:
        """Keep the adapter in every rank's host memory while a request names it (lora/manager.py).
        It is read and checked here when not pinned yet, so a folder that vanished or changed after
        the frontend checked it refuses this request (ValueError) instead of failing a step."""
        self._lora_adds += 1
        pinned = self._lora_pins.get(lora.lora_int_id)
        if pinned is None or self._lora_adds % _LORA_UNPIN_EVERY == 0:
            self._unpin_finished_loras()
            pinned = self._lora_pins.get(lora.lora_int_id)
        if pinned is None:
            errors = [e for e in self.executor.collective_rpc("pin_lora", lora.lora_int_id, lora.lora_path) if e]
            if errors:
                self.executor.collective_rpc("unpin_lora", lora.lora_int_id)  # ranks that read it in time
                raise ValueError(errors[0])
            pinned = self._lora_pins[lora.lora_int_id] = (lora.lora_path, set())
        elif pinned[0] != lora.lora_path:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: its id {lora.lora_int_id} names the adapter at "
                             f"{pinned[0]} for running requests, not {lora.lora_path}.")
        pinned[1].add(request_id)

    def _unpin_finished_loras(self) -> None:
        waiting = self.structured_outputs
        for adapter_id, (_, users) in list(self._lora_pins.items()):
            users -= {r for r in users if r not in self.scheduler.requests and not (waiting and r in waiting)}
            if not users:
                del self._lora_pins[adapter_id]
                self.executor.collective_rpc("unpin_lora", adapter_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs.abort_requests(request_ids)
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._in_flight)
            or bool(self.structured_outputs and len(self.structured_outputs))
        )

    def step(self) -> EngineCoreOutputs:
        """Schedule, run and account one step (its outputs may be empty)."""
        outputs = self._admit_compiled_requests()
        if self.config.scheduler_config.async_scheduling:
            outputs += self._step_async()
        elif self.scheduler.has_unfinished_requests():
            started = time.perf_counter()
            self._time_last_step(started)
            scheduler_output = self.scheduler.schedule()
            forward_started = time.perf_counter()
            runner_output = self.executor.execute_model(scheduler_output, self._grammar_bitmask(scheduler_output))
            forward = time.perf_counter() - forward_started
            step_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            if self.scheduler.has_unfinished_requests():
                self._last_step = (scheduler_output, step_outputs, started, forward)
            outputs += step_outputs
        return EngineCoreOutputs(outputs, self._stats(), time.time())

    def _time_last_step(self, now: float) -> None:
        """Tell the scheduler what the last step cost, from its start to this one's: scheduling,
        the forward and sampling, and handing its outputs on (a token that a draft saves saves all
        of it). A gap far beyond its forward was the engine waiting (for input, a grammar), not
        the step: not counted."""
        if self._last_step is None:
            return
        scheduler_output, step_outputs, started, forward = self._last_step
        self._last_step = None
        period = now - started
        if period <= 2 * forward + 0.02:
            self.scheduler.record_step_time(scheduler_output, step_outputs, period)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Launch the next step, then account the one launched before it: the device runs a step
        while the host schedules the next and reads the last one's tokens, which the host thus
        learns a step late (two steps in flight at most). A step that samples a constrained
        request accounts the step before it earlier, between its forward and its sampling."""
        outputs: list[EngineCoreOutput] = []
        launched = False
        if self.scheduler.has_unfinished_requests():
            scheduler_output = self.scheduler.schedule()
            step = self.executor.execute_model_async(scheduler_output, self._grammar_bitmask(scheduler_output, outputs))
            if not scheduler_output.empty:
                self._in_flight.append((scheduler_output, step))
                launched = True
        if len(self._in_flight) > 1 or (self._in_flight and not launched):
            outputs += self._account_oldest_step()
        return outputs

    def _account_oldest_step(self) -> list[EngineCoreOutput]:
        scheduler_output, step = self._in_flight.popleft()
        return self.scheduler.update_from_output(scheduler_output, step.get_output())

    def _grammar_bitmask(
        self, scheduler_output: SchedulerOutput, accounted: list[EngineCoreOutput] | None = None
    ) -> Callable[[], torch.Tensor] | None:
        """What the runner calls, after the forward and before sampling, for the bitmask of the
        step's constrained requests (None when it has none: nothing is built). `accounted`
        (asynchronous scheduling) receives the outputs of the step in flight, accounted first."""
        ids = scheduler_output.structured_output_request_ids
        if not ids:
            return None
        assert self.structured_outputs is not None

        def fill() -> torch.Tensor:
            if accounted is not None and self._in_flight:
                accounted.extend(self._account_oldest_step())
            assert self.structured_outputs is not None
            drafts = [scheduler_output.scheduled_spec_decode_tokens.get(rid, []) for rid in ids]
            return self.structured_outputs.grammar_bitmask([self.scheduler.requests.get(rid) for rid in ids],
                                                           drafts if any(drafts) else None)

        return fill

    def _admit_compiled_requests(self) -> list[EngineCoreOutput]:
        """Move constrained requests whose grammar is ready into the scheduler (blocking briefly
        when nothing else can run); those whose grammar failed end with an error."""
        manager = self.structured_outputs
        if manager is None or not len(manager):
            return []
        if not self.scheduler.has_unfinished_requests() and not self._in_flight:
            manager.wait(_GRAMMAR_WAIT_SECONDS)
        ready, failed = manager.take_ready()
        for request in ready:
            self.scheduler.add_request(request)
        for request, reason in failed:
            logger.error("Request %s: %s", request.request_id, reason)
        return [EngineCoreOutput(r.request_id, [], finish_reason="error", stop_reason=why) for r, why in failed]

    def _stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        if stats.spec_decoding is not None:
            self._log_speculation()
        if self.structured_outputs is not None:
            stats.num_waiting_reqs += len(self.structured_outputs)  # waiting for their grammar
        return stats

    def _log_speculation(self) -> None:
        """The acceptance rate since the last such line, at most every `_SPEC_LOG_SECONDS`."""
        now = time.monotonic()
        last, drafts0, proposed0, accepted0 = self._spec_logged
        if now - last < _SPEC_LOG_SECONDS:
            return
        totals = self.scheduler.spec_totals
        drafts, proposed = totals.num_drafts - drafts0, totals.num_draft_tokens - proposed0
        accepted = totals.num_accepted_tokens - accepted0
        self._spec_logged = (now, totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens)
        if proposed:
            logger.info("Speculative decoding: acceptance rate %.1f%% (%d of %d draft tokens), mean accepted length "
                        "%.2f tokens per verification.", 100.0 * accepted / proposed, accepted, proposed,
                        1.0 + accepted / drafts)
        gain = self.scheduler.spec_gain.summary() if self.scheduler.spec_gain is not None else {}
        if gain:
            logger.info("Speculative decoding, measured decode tok/s without / with drafts: %s.", "; ".join(
                f"up to {n} running: {plain:.0f} / {spec:.0f}, {'on' if on else 'off'}"
                for n, (plain, spec, on) in gain.items()))

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.structured_outputs is not None:
            self.structured_outputs.shutdown()
        self.executor.shutdown()

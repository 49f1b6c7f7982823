"""The scheduler: which requests run in the next step and how many tokens each computes.

There are no prefill and decode phases. Every request has `num_computed_tokens` and
`num_tokens`; a step gives each scheduled request some new tokens within the token budget
(`max_num_batched_tokens`), running requests first, then waiting ones in arrival order
(chunked prefill splits a long prompt across steps). When the KV cache runs out for a running
request, the last running request is preempted (its blocks freed, recomputed later); a waiting
request never preempts anyone.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from compiled_llm.config import CacheConfig, SchedulerConfig
from compiled_llm.engine.kv_cache_manager import KVCacheManager
from compiled_llm.engine.messages import EngineCoreOutput, LogprobsLists, SchedulerStats
from compiled_llm.engine.request import Request, RequestStatus
from compiled_llm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the model runner has no row for yet (new, or resumed after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt and any output generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # rows the runner can drop
    # Rows the runner drops for now but whose sampling state (a seeded generator) it keeps:
    # the request comes back and must draw the same random numbers as if never preempted.
    preempted_req_ids: set[str] = field(default_factory=set)

    @property
    def empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # empty for a request still in the middle of its prompt
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, eos_token_ids: list[int]) -> None:
        assert cache_config.num_blocks is not None, "the KV cache size must be known"
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.eos_token_ids = eos_token_ids
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    # ---- requests in and out ----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(rid)
        return aborted

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (cannot happen without speculative tokens)
                index += 1
                continue
            while True:
                new_blocks = self.kv.allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if new_blocks is None:  # preempted itself: nothing left to try
                break
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            # The rest of a chunked prompt (or a recomputed one) counts as prompt tokens too.
            self._prompt_tokens += max(0, min(num_new, request.num_prompt_tokens - request.num_computed_tokens))
            cached_reqs.append(
                CachedRequestData(request.request_id, [b.block_id for b in new_blocks], request.num_computed_tokens)
            )
            index += 1

        # Admit waiting requests only when nobody had to be preempted for lack of room.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_hit = [], 0
            looked_up = request.num_computed_tokens == 0
            if looked_up:
                computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            request.num_computed_tokens = num_hit
            if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if looked_up:
                self.kv.record_prefix_lookup(request, num_hit)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            self._prompt_tokens += max(0, min(num_new, request.num_prompt_tokens - num_hit))
            new_reqs.append(
                NewRequestData(
                    request.request_id,
                    list(request.all_token_ids),
                    request.num_prompt_tokens,
                    request.sampling_params,
                    self.kv.block_ids(request.request_id),
                    num_hit,
                )
            )

        # Scheduled tokens count as computed from now on: the step computes them.
        for rid, n in num_scheduled.items():
            self.requests[rid].num_computed_tokens += n
        output = SchedulerOutput(
            new_reqs,
            cached_reqs,
            num_scheduled,
            sum(num_scheduled.values()),
            self.finished_req_ids,
            self.preempted_req_ids,
        )
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        return output

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self.preempted_req_ids.add(request.request_id)  # the runner drops its row, keeps its RNG

    # ---- after the model ran ------------------------------------------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        for rid, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if not sampled:
                continue  # a prompt chunk: nothing to report yet
            new_tokens: list[int] = []
            for token in sampled:
                request.append_output_token(token)
                new_tokens.append(token)
                if self._check_stop(request):
                    break
            self._generation_tokens += len(new_tokens)
            out = EngineCoreOutput(
                rid,
                new_tokens,
                runner_output.logprobs.get(rid),
                num_cached_tokens=max(request.num_cached_tokens, 0),
            )
            if request.status.finished:
                out.finish_reason = request.status.finish_reason
                out.stop_reason = request.stop_reason
                stopped.append(request)
            outputs.append(out)
        if stopped:
            stopped_ids = {r.request_id for r in stopped}
            self.running = [r for r in self.running if r.request_id not in stopped_ids]
            for request in stopped:
                self._finish(request, request.status)
        return outputs

    def _check_stop(self, request: Request) -> bool:
        token = request.all_token_ids[-1]
        num_output = request.num_output_tokens
        if num_output >= request.sampling_params.min_tokens:
            if token in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in request.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return True
        if (request.max_tokens is not None and num_output >= request.max_tokens) or (
            request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv.stats.take()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self._prompt_tokens,
            num_generation_tokens=self._generation_tokens,
        )
        self._prompt_tokens = self._generation_tokens = 0
        return stats

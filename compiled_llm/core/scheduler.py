"""The scheduler: which requests run in the next step and how many tokens each computes.

There are no prefill and decode phases. Every request has `num_computed_tokens` and
`num_tokens`; a step gives each scheduled request some new tokens within the token budget
(`max_num_batched_tokens`), running requests first, then waiting ones in the policy's order
(arrival, or priority then arrival; chunked prefill splits a long prompt across steps). When the
KV cache runs out for a running request, a running request is preempted (its blocks freed,
recomputed later): the last one to arrive, or under the priority policy the one of lowest
priority. A waiting request never preempts anyone.

The samples of one `n > 1` request (a group) hold at most `max_running_per_group` running slots,
so that about an eighth of them stay for other requests: admission passes over the waiting samples
of a group at its share, and a preemption takes from the group with the most running members
first. Alone, a request of its own is a group of one, and the order is as above.

With asynchronous scheduling the next step is scheduled before the last one's tokens are known:
a request that samples in a step gets a placeholder token (`num_output_placeholders`), which the
next step computes (the runner feeds it from the device), and which turns into a real token when
that step's output arrives. A request whose placeholders will end it (max_tokens, max_model_len)
leaves the running batch at once and gives its blocks back, as it would once finished (the step
still in flight writes its last KV entry before any later step can reuse them); it finishes when
its output arrives. One that turns out to have stopped (EOS, a stop token) is finished then, and
whatever a step already in flight computed for it is dropped.

Speculative decoding with asynchronous scheduling: a verification step's request gets 1 + k
placeholders, as if every draft were accepted, and the next step is planned on that optimistic
count (its positions and blocks lie at or past the true ones). Its k draft slots are filled in by
the runner, which knows the verified tokens when it runs the step (n-gram lookups there, or the
draft model); the runner also moves the step back by the drafts the step before rejected. When the
output arrives, the rejected drafts come off `num_computed_tokens` and the placeholders. A request
that the tokens in flight may or may not end (the optimistic count reaches max_tokens or
max_model_len, the certain one does not) sits out one step until they are known. Requests with
structured outputs get no drafts then (the grammar cannot check drafts the runner proposes).

A request with structured outputs joins the scheduler with its grammar compiled: its sampled
tokens advance its matcher, and it stops when the grammar is complete (or refuses a token). Each
step lists the constrained requests that sample in it, the rows of the grammar bitmask. A request
that wants prompt logprobs skips the prefix cache (a cached block's positions would have no
logprobs); one with `max_tokens=0` (scoring) finishes after its prompt, its sample dropped.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from compiled_llm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from compiled_llm.core.block_pool import KVCacheBlock
from compiled_llm.core.kv_cache_manager import KVCacheManager
from compiled_llm.core.request import Request, RequestStatus
from compiled_llm.core.request_queue import make_request_queue
from compiled_llm.messages.engine_core import EngineCoreOutput, SchedulerStats, SpecDecodingStats
from compiled_llm.messages.runner_output import LogprobsLists, ModelRunnerOutput, PooledTensor
from compiled_llm.messages.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from compiled_llm.spec_decode.backoff import min_acceptance, shortest_match
from compiled_llm.spec_decode.gain import SpeculationGain
from compiled_llm.spec_decode.ngram import NgramIndex
from compiled_llm.spec_decode.step_cost import StepCost


@dataclass
class _StepPlan:
    """One `schedule` call in the making: the token budget left and what it has given out."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # Prompt tokens each scheduled request computes (a prompt's chunk, or a recomputed one), for the stats.
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts each request verifies
    preempted: bool = False  # someone lacked room: no waiting request is admitted

    def take(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` of the budget for `request`, from its `num_computed_tokens` on."""
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        prompt_left = request.num_prompt_tokens - request.num_computed_tokens
        self.prompt_tokens[request.request_id] = max(0, min(num_tokens, prompt_left))

    def give_back(self, request_id: str) -> None:
        """Undo `take` for a request preempted later in the same step."""
        self.token_budget += self.num_scheduled_tokens.pop(request_id)
        del self.prompt_tokens[request_id]
        self.spec_tokens.pop(request_id, None)
        self.cached_reqs = [c for c in self.cached_reqs if c.req_id != request_id]


class Scheduler:
    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
        speculative_config: SpeculativeConfig | None = None, max_loras: int | None = None,
        measure_step_cost: bool = False,
    ) -> None:
        """`num_blocks`: the KV cache's size, which the runners decide at start-up from their memory.
        `max_loras` (LoRA on): the most distinct adapters among running requests (the runner's slots).
        `measure_step_cost`: where each verified row costs compute (a CPU), fit decode steps' times
        to their rows, from which the acceptance drafts need at a batch size follows (step_cost.py)."""
        self.speculative_config = speculative_config
        self.step_cost = StepCost() if measure_step_cost and speculative_config is not None else None
        self.spec_stats = SpecDecodingStats() if speculative_config is not None else None  # since the last stats
        self.spec_totals = SpecDecodingStats()  # since start-up (the acceptance rate in the logs)
        measures = speculative_config is not None and speculative_config.measure_gain
        self.spec_gain = SpeculationGain() if measures else None
        self._step_speculates = False  # whether the last scheduled step could propose drafts
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        self.async_scheduling = scheduler_config.async_scheduling
        max_seqs = scheduler_config.max_num_seqs
        self.max_running_per_group = max(1, max_seqs - max(1, max_seqs // 8))
        self.max_loras = max_loras
        # (asynchronous) Requests whose tokens in flight finish them: out of `running`, blocks freed.
        self.finishing: dict[str, Request] = {}
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
        self.waiting.add(request)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        aborted = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None or request.status.finished:
                continue
            if self.finishing.pop(rid, None) is not None:
                pass
            elif request.status == RequestStatus.RUNNING:
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

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _release_finishing(self) -> None:
        """(asynchronous) Take requests whose tokens in flight end them out of the batch now."""
        ending = [r for r in self.running if self._ends_with_placeholders(r)]
        if not ending:
            return
        self.running = [r for r in self.running if not self._ends_with_placeholders(r)]
        for request in ending:
            self.kv.free(request)
            self.finishing[request.request_id] = request

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan the next step (running requests first, then waiting ones) and hand the runner what
        changed since the last."""
        plan = _StepPlan(self.config.max_num_batched_tokens)
        if self.async_scheduling:
            self._release_finishing()
        self._schedule_running(plan)
        if not plan.preempted:  # waiting requests are admitted only when nobody lacked room
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Give each running request, in order, its next tokens within the budget, preempting
        others (or at last itself) when its blocks do not fit."""
        spec = self.speculative_config
        speculates = spec is not None and (spec.disable_by_batch_size is None
                                           or len(self.running) <= spec.disable_by_batch_size)
        if speculates and self.spec_gain is not None:
            speculates = self.spec_gain.speculate(len(self.running))
        self._step_speculates = speculates
        for request in list(self.running):
            if plan.token_budget <= 0:
                break
            if request.status == RequestStatus.PREEMPTED:  # a victim earlier in this step
                continue
            computable = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            num_new = min(computable, plan.token_budget)
            if num_new <= 0 or (request.num_draft_placeholders and self._ends_with_placeholders(request, True)):
                continue  # (the second: it may end with the drafts in flight; known after their step)
            drafts = self._propose(request, plan.token_budget) if speculates and computable == 1 else []
            # Drafts take free blocks only: rather than preempt anyone for them, the request decodes one token.
            new_blocks = self.kv.allocate_slots(request, num_new + len(drafts)) if drafts else None
            if new_blocks is not None:
                num_new += len(drafts)
            else:
                drafts = []
                new_blocks = self._allocate_preempting(request, num_new, plan)
                if new_blocks is None:  # preempted itself: nothing left to try
                    break
            plan.take(request, num_new)
            if drafts:
                plan.spec_tokens[request.request_id] = drafts
            block_ids = [b.block_id for b in new_blocks]
            plan.cached_reqs.append(CachedRequestData(request.request_id, block_ids, request.num_computed_tokens))

    def _propose(self, request: Request, token_budget: int) -> list[int]:
        """Draft tokens for a decoding request to verify in this step (none without speculation, or
        while its proposals' acceptance is low: `AcceptanceBackoff`): at most what the budget,
        max_model_len and max_tokens leave room for after its one known token. The proposals come
        from here, the engine core, where every request's tokens are known once a step is
        accounted: one index per request, grown as tokens are accepted, and no tokens to ship back
        from the runners (each rank of a tensor-parallel group would hold the same)."""
        spec = self.speculative_config
        if spec is None or not request.may_speculate or not request.spec_backoff.may_propose():
            return []
        pending = request.num_output_placeholders  # (asynchronous) tokens in flight, counted as if all accepted
        room = min(spec.num_speculative_tokens, request.spec_backoff.length, token_budget - 1,
                   self.config.max_model_len - request.num_tokens - pending - 1)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - pending - 1)
        if room <= 0:
            return []
        if self.async_scheduling:  # placeholders: the runner fills them in from the tokens it has verified
            return [] if request.grammar is not None else [0] * room
        if spec.method == "draft_model":  # placeholders: the runner's draft model fills them in
            # (under a grammar they would have to be checked against it before the verification)
            return [] if request.grammar is not None else [0] * room
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        needed = self._acceptance_needed(request, len(self.running))
        if request.ngram is None:
            request.ngram = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max, request.all_token_ids)
            request.spec_backoff.probe(needed)
            room = min(room, request.spec_backoff.length)
        drafts = request.ngram.propose(room, shortest_match(needed, spec.prompt_lookup_min, spec.prompt_lookup_max))
        if drafts and request.grammar is not None:  # a draft the grammar forbids would be rejected
            drafts = drafts[: request.grammar.valid_prefix(drafts)]
        return drafts

    def _allocate_preempting(self, request: Request, num_new: int, plan: _StepPlan) -> list[KVCacheBlock] | None:
        """Blocks for `num_new` more tokens of a running request, preempting victims until they fit;
        None once the request itself was the victim."""
        while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
            victim = self._pick_victim()
            self.running.remove(victim)
            if victim.request_id in plan.num_scheduled_tokens:  # already given tokens this step
                plan.give_back(victim.request_id)
            self._preempt(victim)
            plan.preempted = True
            if victim is request:
                return None
        return new_blocks

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Admit waiting requests in the policy's order (passing over a group at its share) while
        the budget, the running slots and the blocks last."""
        per_group: Counter[str] | None = None  # running requests per group, counted once needed
        loras: set[int] = set()  # the adapters of running requests
        while self.waiting and plan.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            if per_group is None:
                per_group = Counter(r.group for r in self.running)
                loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
            request = self._next_admissible(per_group, loras)
            if request is None or not self._admit(request, plan):
                break
            per_group[request.group] += 1
            if request.lora_request is not None:
                loras.add(request.lora_request.lora_int_id)

    def _admit(self, request: Request, plan: _StepPlan) -> bool:
        """Start (or resume) a waiting request: its prefix-cache hit, then blocks for as many
        tokens as the budget allows. False, and nothing changed, when the blocks do not fit."""
        computed_blocks, num_hit = [], 0
        looked_up = request.num_computed_tokens == 0 and not request.skips_prefix_cache
        if looked_up:
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_hit, plan.token_budget)
        request.num_computed_tokens = num_hit
        if self.kv.allocate_slots(request, num_new, computed_blocks) is None:
            request.num_computed_tokens = 0
            return False
        if request is self.waiting.peek():
            self.waiting.pop()
        else:  # passed over a group at its share
            self.waiting.remove(request)
        if looked_up:
            self.kv.record_prefix_lookup(request, num_hit)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
            request.first_scheduled_time = time.time()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.take(request, num_new)
        plan.new_reqs.append(
            NewRequestData(
                request.request_id,
                list(request.all_token_ids),
                request.num_prompt_tokens,
                request.sampling_params,
                self.kv.block_ids(request.request_id),
                num_hit,
                request.pooling_params,
                request.lora_request,
            )
        )
        return True

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        """Count the planned tokens as computed from now on (the step computes them) and hand the
        runner what changed."""
        constrained: list[str] = []
        for rid, n in plan.num_scheduled_tokens.items():
            request = self.requests[rid]
            request.num_computed_tokens += n
            num_drafts = len(plan.spec_tokens.get(rid, ()))
            samples = request.num_computed_tokens - num_drafts == request.num_tokens + request.num_output_placeholders
            if samples and request.grammar is not None:
                constrained.append(rid)
            if self.async_scheduling and samples:  # its tokens are known a step later
                request.num_output_placeholders += 1 + num_drafts
                request.num_draft_placeholders += num_drafts
        self._prompt_tokens += sum(plan.prompt_tokens.values())
        output = SchedulerOutput(
            plan.new_reqs,
            plan.cached_reqs,
            plan.num_scheduled_tokens,
            sum(plan.num_scheduled_tokens.values()),
            self.finished_req_ids,
            self.preempted_req_ids,
            constrained,
            plan.spec_tokens,
        )
        self.finished_req_ids = set()
        self.preempted_req_ids = set()
        return output

    def _ends_with_placeholders(self, request: Request, if_all_accepted: bool = False) -> bool:
        """The tokens in flight take the request to max_tokens or max_model_len: it finishes when
        they arrive, and another step for it would compute a token nobody gets. `if_all_accepted`:
        count the draft slots in flight as tokens too (they may end it)."""
        pending = request.num_output_placeholders - (0 if if_all_accepted else request.num_draft_placeholders)
        if not pending:
            return False
        return (request.max_tokens is not None and request.num_output_tokens + pending >= request.max_tokens) or (
            request.num_tokens + pending >= self.config.max_model_len
        )

    def _next_admissible(self, per_group: Counter[str], loras: set[int]) -> Request | None:
        """The first waiting request, in the policy's order, whose group is below its share and
        whose adapter is running already or fits in a free adapter slot (the others wait)."""
        def admissible(r: Request) -> bool:
            lora = r.lora_request
            fits = lora is None or self.max_loras is None or lora.lora_int_id in loras or len(loras) < self.max_loras
            return fits and per_group[r.group] < self.max_running_per_group

        head = self.waiting.peek()
        if admissible(head):
            return head
        return next((r for r in self.waiting if admissible(r)), None)

    def _pick_victim(self) -> Request:
        """The running request to preempt: the lowest-priority one (latest among equals) under the
        priority policy; otherwise the last to arrive of the group with the most running members
        (of all running requests, when each is a group of one)."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        per_group = Counter(r.group for r in self.running)
        largest = max(per_group.values())
        return next(r for r in reversed(self.running) if per_group[r.group] == largest)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)
        self.preempted_req_ids.add(request.request_id)  # the runner drops its row, keeps its RNG

    # ---- after the model ran ------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        for rid, sampled in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            request = self.requests.get(rid)
            if request is None or request.status.finished or not sampled:
                continue  # aborted or finished while the step ran, or a prompt chunk (nothing to report)
            num_slots = len(scheduler_output.scheduled_spec_decode_tokens.get(rid, ()))
            if request.num_output_placeholders:  # (asynchronous) the tokens it stood for
                request.num_output_placeholders -= 1 + num_slots
                request.num_draft_placeholders -= num_slots
            elif request.status != RequestStatus.RUNNING:
                continue
            if num_slots:
                proposed = runner_output.num_proposed_drafts.get(rid, num_slots)
                needed = self._acceptance_needed(request, len(scheduler_output.num_scheduled_tokens))
                self._roll_back_rejected(request, num_slots, proposed, len(sampled) - 1, needed)
            outputs.append(self._accept_sampled(request, sampled, runner_output))
            if request.status.finished:
                stopped.append(request)
        for rid, pooled in runner_output.pooler_output.items():
            request = self.requests.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                outputs.append(self._finish_pooled(request, pooled))
                stopped.append(request)
        if stopped:
            self._remove_stopped(stopped)
        return outputs

    def _finish_pooled(self, request: Request, pooled: PooledTensor) -> EngineCoreOutput:
        """A pooling request whose prompt is computed is done: its vector is the result, and its
        blocks go back (hashed ones stay cached for the next prompt with the same prefix)."""
        request.status = RequestStatus.FINISHED_STOPPED
        out = EngineCoreOutput(request.request_id, [], finish_reason="stop",
                               num_cached_tokens=max(request.num_cached_tokens, 0),
                               scheduled_time=request.first_scheduled_time or 0.0,
                               num_preemptions=request.num_preemptions, pooling_output=pooled)
        request.first_scheduled_time = None
        return out

    def record_step_time(self, scheduler_output: SchedulerOutput, outputs: list[EngineCoreOutput],
                         seconds: float) -> None:
        """How long a step took and what it yielded: decode-only steps tell `spec_gain` whether
        speculation pays at their batch size, and `step_cost` what a row costs (nothing is counted
        without them)."""
        if (self.spec_gain is None and self.step_cost is None) or scheduler_output.scheduled_new_reqs:
            return
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if any(n != 1 + len(drafts.get(rid, ())) for rid, n in scheduler_output.num_scheduled_tokens.items()):
            return  # a prompt chunk's time says nothing of decoding
        if self.step_cost is not None:
            self.step_cost.observe(scheduler_output.total_num_scheduled_tokens, seconds)
        if self.spec_gain is not None:
            self.spec_gain.record(len(scheduler_output.num_scheduled_tokens), self._step_speculates,
                                  sum(len(o.new_token_ids) for o in outputs), seconds)

    def _acceptance_needed(self, request: Request, batch: int) -> float:
        """The share of its drafts `request` must get accepted to keep proposing in a step of `batch`
        requests. A seeded request's drafts never depend on measured times (each verification
        draws from its stream, so its text would), only on the workload: it keeps the fixed bar."""
        measured = self.step_cost is not None and request.sampling_params.seed is None
        return min_acceptance(batch, self.step_cost.fixed_rows() if measured else None)

    def _roll_back_rejected(self, request: Request, num_slots: int, num_drafts: int, num_accepted: int,
                            needed: float) -> None:
        """The step computed KV for all `num_drafts` drafts; only the accepted ones' entries hold.
        The rejected ones' slots are written again when their positions are computed with real
        tokens; the blocks stay with the request for its next drafts (freed with it). None of them
        is ever cached: a block is hashed only once full of known tokens (`Request.block_hashes`).
        `num_slots`: the draft slots the step was given; (asynchronous) the runner may have found
        fewer `num_drafts` to fill them with. A request preempted meanwhile has nothing to roll back.
        `needed`: the acceptance its drafts need at the step's batch size (`AcceptanceBackoff.record`)."""
        if request.status == RequestStatus.RUNNING:
            request.num_computed_tokens -= num_slots - num_accepted
        if not num_drafts:
            return
        request.spec_backoff.record(num_drafts, num_accepted, needed)
        assert self.spec_stats is not None and self.speculative_config is not None
        for stats in (self.spec_stats, self.spec_totals):
            stats.observe(num_drafts, num_accepted, self.speculative_config.num_speculative_tokens)

    def _accept_sampled(
        self, request: Request, sampled: list[int], runner_output: ModelRunnerOutput
    ) -> EngineCoreOutput:
        """Append a step's sampled tokens to the request up to its first stop, and say what it got."""
        rid = request.request_id
        new_tokens: list[int] = []
        if request.max_tokens == 0:  # scoring a prompt: its logprobs are the result, no token
            request.status = RequestStatus.FINISHED_LENGTH
            sampled = []
        for token in sampled:
            request.append_output_token(token)
            new_tokens.append(token)
            if request.grammar is not None:
                request.grammar.accept(rid, token)
            if self._check_stop(request):
                break
        self._generation_tokens += len(new_tokens)
        logprobs = runner_output.logprobs.get(rid) if new_tokens else None
        if logprobs is not None and len(logprobs.sampled_ranks) > len(new_tokens):  # tokens after a stop
            n = len(new_tokens)
            logprobs = LogprobsLists(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.sampled_ranks[:n])
        out = EngineCoreOutput(
            rid,
            new_tokens,
            logprobs,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            new_prompt_logprobs=runner_output.prompt_logprobs.get(rid),
            scheduled_time=request.first_scheduled_time or 0.0,
            num_preemptions=request.num_preemptions,
        )
        request.first_scheduled_time = None  # sent once, with the first output
        if request.status.finished:
            out.finish_reason = request.status.finish_reason
            out.stop_reason = request.stop_reason
        return out

    def _remove_stopped(self, stopped: list[Request]) -> None:
        """Finish requests that stopped in this output, wherever they sit now."""
        stopped_ids = {r.request_id for r in stopped}
        self.running = [r for r in self.running if r.request_id not in stopped_ids]
        for request in stopped:
            # (asynchronous) It may have left the batch already: ending, or preempted with a token in flight.
            if self.finishing.pop(request.request_id, None) is None and request in self.waiting:
                self.waiting.remove(request)
            self._finish(request, request.status)

    def _check_stop(self, request: Request) -> bool:
        token = request.all_token_ids[-1]
        num_output = request.num_output_tokens
        if request.grammar is not None and request.grammar.terminated:
            # Complete (its stop token accepted), or given a token outside it: nothing can follow.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
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

    def _num_waiting_deferred(self) -> int:
        """Waiting requests whose group holds its share of the running slots: admission passes over
        them, however much room there is."""
        if not self.waiting or not self.running:
            return 0
        per_group = Counter(r.group for r in self.running)
        if max(per_group.values()) < self.max_running_per_group:
            return 0
        return sum(1 for r in self.waiting if per_group[r.group] >= self.max_running_per_group)

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv.stats.take()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_waiting_deferred=self._num_waiting_deferred(),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self._prompt_tokens,
            num_generation_tokens=self._generation_tokens,
            spec_decoding=self.spec_stats,
        )
        self._prompt_tokens = self._generation_tokens = 0
        if self.spec_stats is not None:
            self.spec_stats = SpecDecodingStats()
        return stats

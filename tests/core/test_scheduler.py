"""Scheduler behaviour and invariants, driven with synthetic model outputs (the model is not the unit here)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from compiled_llm.config import CacheConfig, SchedulerConfig
from compiled_llm.core.request import Request, RequestStatus
from compiled_llm.core.scheduler import Scheduler
from compiled_llm.messages.runner_output import ModelRunnerOutput
from compiled_llm.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, budget=16, max_model_len=64, caching=True,
                   policy="fcfs"):
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, policy), cache, num_blocks)


def req(rid: str, n_prompt: int, max_tokens: int = 4, block_size: int = 4, **kw) -> Request:
    prompt = [5 + i % 7 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), [EOS], block_size)


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    sampled = []
    for rid in out.num_scheduled_tokens:
        r = s.requests[rid]
        sampled.append([token] if r.num_computed_tokens == r.num_tokens else [])
    return out, s.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))


def test_chunked_prefill_splits_a_long_prompt_within_the_budget():
    s = make_scheduler(budget=8)
    s.add_request(req("a", 20))
    chunks = []
    for _ in range(3):
        out, results = run_step(s)
        chunks.append(out.num_scheduled_tokens["a"])
        assert not results or results[0].new_token_ids == [7]
    assert chunks == [8, 8, 4]


def test_stats_count_every_prompt_chunk_and_each_prefix_lookup_once():
    s = make_scheduler(budget=8)
    s.add_request(req("a", 20))
    for _ in range(3):
        run_step(s)
    stats = s.make_stats()
    assert stats.num_prompt_tokens == 20 and stats.prefix_cache_queries == 20
    # A request that waits for room is looked up every step but counted once, when admitted.
    s = make_scheduler(num_blocks=10, max_num_seqs=4, budget=32)
    s.add_request(req("big", 24, max_tokens=4))
    run_step(s)
    s.add_request(Request("late", [40 + i for i in range(12)], SamplingParams(max_tokens=2), [EOS], 4))
    run_step(s)
    assert [r.request_id for r in s.waiting] == ["late"]  # looked up, no room yet
    for _ in range(4):
        run_step(s)
    stats = s.make_stats()
    assert stats.num_preemptions == 0 and not s.has_unfinished_requests()
    assert stats.prefix_cache_queries == 24 + 12


def test_running_requests_come_before_waiting_ones():
    s = make_scheduler(budget=10)
    s.add_request(req("a", 6, max_tokens=10))
    run_step(s)
    s.add_request(req("b", 30))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [r.request_id for r in s.running] == ["a", "b"]


def test_new_request_joins_running_batch_next_step():
    s = make_scheduler()
    s.add_request(req("a", 4, max_tokens=10))
    run_step(s)
    run_step(s)
    s.add_request(req("b", 3))
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}


def test_preemption_frees_the_last_running_request_and_recomputes_it():
    # 6 usable blocks of 4 tokens; two requests that each grow to 12 tokens.
    s = make_scheduler(num_blocks=7, budget=32, max_model_len=64)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8))
    finished, preempted_seen = {}, False
    for _ in range(60):
        out, results = run_step(s)
        if s.num_preemptions:
            preempted_seen = True
        for r in results:
            if r.finished:
                finished[r.request_id] = r.finish_reason
        if not s.has_unfinished_requests():
            break
    assert preempted_seen
    assert finished == {"a": "length", "b": "length"}
    assert s.kv.pool.num_free_blocks == 6


def test_waiting_request_never_preempts():
    s = make_scheduler(num_blocks=5, budget=32)  # 4 usable blocks
    s.add_request(req("a", 12, max_tokens=5))  # takes 3 blocks, then 4
    run_step(s)
    s.add_request(req("b", 8))  # needs 2 blocks: must wait, not evict a
    out, _ = run_step(s)
    assert "b" not in out.num_scheduled_tokens
    assert s.requests["a"].status == RequestStatus.RUNNING and s.num_preemptions == 0


def test_stop_conditions():
    s = make_scheduler()
    s.add_request(req("eos", 3, max_tokens=10))
    s.add_request(req("min", 3, max_tokens=10, min_tokens=2))
    s.add_request(req("ignore", 3, max_tokens=3, ignore_eos=True))
    s.add_request(req("stoptok", 3, max_tokens=10, ignore_eos=True, stop_token_ids=[EOS]))
    done, steps = {}, {}
    for step in range(1, 12):
        _, results = run_step(s, token=EOS)
        for r in results:
            if r.finished:
                done[r.request_id], steps[r.request_id] = (r.finish_reason, r.stop_reason), step
    assert done["eos"] == ("stop", None) and steps["eos"] == 1
    assert done["min"] == ("stop", None) and steps["min"] == 2  # EOS ignored before min_tokens
    assert done["ignore"] == ("length", None) and steps["ignore"] == 3
    assert done["stoptok"] == ("stop", EOS)  # a stop token id still stops with ignore_eos


def test_max_model_len_ends_with_length():
    s = make_scheduler(max_model_len=10)
    s.add_request(req("a", 8, max_tokens=100))
    reasons = []
    for _ in range(5):
        _, results = run_step(s)
        reasons += [r.finish_reason for r in results if r.finished]
    assert reasons == ["length"]


def test_abort_frees_blocks_and_tells_the_runner():
    s = make_scheduler()
    s.add_request(req("a", 10, max_tokens=10))
    run_step(s)
    s.abort_requests(["a"])
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks - 1
    out = s.schedule()
    assert out.finished_req_ids == {"a"}


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=3, budget=12, max_model_len=32)
        self.n = 0
        self.finished: set[str] = set()
        self.aborted: set[str] = set()

    @rule(n_prompt=st.integers(1, 20), max_tokens=st.integers(1, 8), shared=st.booleans())
    def add(self, n_prompt, max_tokens, shared):
        self.n += 1
        r = Request(f"r{self.n}", ([1] * 8 if shared else []) + [3 + self.n % 5] * n_prompt,
                    SamplingParams(max_tokens=max_tokens), [EOS], 4)
        if r.num_tokens <= 32:
            self.s.add_request(r)

    @rule(n=st.integers(2, 4), n_prompt=st.integers(1, 12), max_tokens=st.integers(1, 8))
    def add_parallel_samples(self, n, n_prompt, max_tokens):
        """A request with n > 1: its samples share a parent (and so a share of the slots)."""
        self.n += 1
        for i in range(n):
            self.s.add_request(Request(f"{i}_p{self.n}", [3 + self.n % 5] * n_prompt,
                                       SamplingParams(max_tokens=max_tokens), [EOS], 4, parent_id=f"p{self.n}"))

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.abort_requests([rid])
        self.aborted.add(rid)

    @rule(token=st.sampled_from([7, 8, EOS]))
    def step(self, token):
        before_waiting = {r.request_id for r in self.s.waiting}
        preemptions = self.s.num_preemptions
        out, results = run_step(self.s, token)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= 12
        assert len(self.s.running) <= 3
        scheduled = set(out.num_scheduled_tokens)
        assert {c.req_id for c in out.scheduled_cached_reqs} | {n.req_id for n in out.scheduled_new_reqs} == scheduled
        assert not scheduled & out.preempted_req_ids, "a request was both run and preempted in one step"
        if self.s.num_preemptions > preemptions:
            newly_running = {rid for rid in before_waiting if rid in out.num_scheduled_tokens}
            assert not newly_running, "a request was admitted in a step that preempted"
        for r in results:
            if r.finished:
                assert r.request_id not in self.finished
                self.finished.add(r.request_id)

    @invariant()
    def no_parent_holds_every_slot(self):
        per_parent = Counter(r.group for r in self.s.running)
        assert all(count <= self.s.max_running_per_group < 3 for count in per_parent.values())

    @invariant()
    def blocks_accounted(self):
        kv = self.s.kv
        live = {r.request_id for r in self.s.running}
        assert set(kv.req_blocks) <= live | {r.request_id for r in self.s.waiting}
        for r in self.s.waiting:
            assert kv.req_blocks.get(r.request_id, []) == []
        used = sum(1 for b in kv.pool.blocks[1:] if b.ref_cnt > 0)
        assert used + kv.pool.num_free_blocks == kv.pool.num_blocks - 1

    def teardown(self):
        # Everything left finishes without new arrivals: no request starves, nothing leaks.
        for _ in range(400):
            if not self.s.has_unfinished_requests():
                break
            run_step(self.s)
        assert not self.s.has_unfinished_requests(), "requests starved"
        assert self.s.kv.pool.num_free_blocks == self.s.kv.pool.num_blocks - 1, "blocks leaked"


class PrioritySchedulerMachine(SchedulerMachine):
    """The same invariants under the priority policy, with requests of mixed priority."""

    def __init__(self) -> None:
        super().__init__()
        self.s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=3, budget=12, max_model_len=32,
                                policy="priority")

    @rule(n_prompt=st.integers(1, 20), max_tokens=st.integers(1, 8), priority=st.integers(-2, 2))
    def add_with_priority(self, n_prompt, max_tokens, priority):
        self.n += 1
        r = Request(f"r{self.n}", [3 + self.n % 5] * n_prompt, SamplingParams(max_tokens=max_tokens), [EOS], 4,
                    priority=priority)
        self.s.add_request(r)


class AsyncSchedulerMachine(RuleBasedStateMachine):
    """Asynchronous scheduling: each step is scheduled before the previous one's tokens arrive
    (two steps in flight). Blocks stay accounted, nothing finishes twice or starves, and a
    request's tokens keep their order."""

    def __init__(self) -> None:
        super().__init__()
        self.s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=3, budget=12, max_model_len=32)
        self.s.async_scheduling = True
        self.n = 0
        self.in_flight: list = []
        self.finished: set[str] = set()
        self.tokens: dict[str, int] = {}

    @rule(n_prompt=st.integers(1, 20), max_tokens=st.integers(1, 8))
    def add(self, n_prompt, max_tokens):
        self.n += 1
        self.s.add_request(Request(f"r{self.n}", [3 + self.n % 5] * n_prompt, SamplingParams(max_tokens=max_tokens),
                                   [EOS], 4))

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def abort(self, data):
        self.s.abort_requests([data.draw(st.sampled_from(sorted(self.s.requests)))])

    def _launch(self) -> None:
        before = {rid: r.num_output_placeholders for rid, r in self.s.requests.items()}
        out = self.s.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values()) <= 12
        assert len(self.s.running) <= 3
        assert not set(self.s.finishing) & {r.request_id for r in self.s.running}
        sampling = []
        for rid in out.num_scheduled_tokens:
            r = self.s.requests[rid]
            # It samples when this step reaches its end: then the scheduler gave it a placeholder.
            samples = r.num_output_placeholders == before.get(rid, 0) + 1
            assert not samples or r.num_computed_tokens == r.num_tokens + r.num_output_placeholders - 1
            sampling.append(samples)
        if not out.empty:
            self.in_flight.append((out, sampling))

    def _account(self, token) -> None:
        out, sampling = self.in_flight.pop(0)
        ids = list(out.num_scheduled_tokens)
        results = self.s.update_from_output(
            out, ModelRunnerOutput(ids, [[token] if samples else [] for samples in sampling]))
        for r in results:
            self.tokens[r.request_id] = self.tokens.get(r.request_id, 0) + len(r.new_token_ids)
            if r.finished:
                assert r.request_id not in self.finished
                self.finished.add(r.request_id)

    @rule(token=st.sampled_from([7, 8, EOS]))
    def step(self, token):
        if self.s.has_unfinished_requests():
            self._launch()
        if len(self.in_flight) > 1 or (self.in_flight and not self.s.has_unfinished_requests()):
            self._account(token)

    @invariant()
    def blocks_accounted(self):
        kv = self.s.kv
        holders = {r.request_id for r in self.s.running} | {r.request_id for r in self.s.waiting}
        assert set(kv.req_blocks) <= holders  # finishing requests gave theirs back
        used = sum(1 for b in kv.pool.blocks[1:] if b.ref_cnt > 0)
        assert used + kv.pool.num_free_blocks == kv.pool.num_blocks - 1
        for r in self.s.requests.values():
            assert 0 <= r.num_output_placeholders <= 2

    def teardown(self):
        for _ in range(400):
            if not self.s.has_unfinished_requests() and not self.in_flight:
                break
            self.step(7)
        assert not self.s.requests, "requests starved"
        assert self.s.kv.pool.num_free_blocks == self.s.kv.pool.num_blocks - 1, "blocks leaked"


TestAsyncSchedulerMachine = AsyncSchedulerMachine.TestCase
TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestPrioritySchedulerMachine = PrioritySchedulerMachine.TestCase
TestPrioritySchedulerMachine.settings = TestSchedulerMachine.settings


# ---- parallel samples (n > 1) share the slots of about one request ---------------------------------
def samples(parent: str, n: int, max_tokens: int = 50) -> list[Request]:
    return [Request(f"{i}_{parent}", [5, 6, 7, 8], SamplingParams(max_tokens=max_tokens), [EOS], 4, parent_id=parent)
            for i in range(n)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_arriving_behind_many_samples_runs_at_once(policy):
    """Issue 21: 128 samples of one request held every slot and the queue ahead of everyone else."""
    s = make_scheduler(num_blocks=200, max_num_seqs=8, budget=64, policy=policy)
    for r in samples("big", 16):
        s.add_request(r)
    run_step(s)
    assert len(s.running) == s.max_running_per_group == 7  # one slot of 8 left for the others
    s.add_request(req("small", 4, max_tokens=2))
    out, _ = run_step(s)
    assert "small" in out.num_scheduled_tokens
    _, results = run_step(s)
    assert any(r.request_id == "small" and r.finished for r in results)
    while s.has_unfinished_requests():  # and the samples all finish
        run_step(s)


def test_preemption_takes_from_the_largest_group_first():
    s = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=8, budget=64)
    for r in samples("big", 6, max_tokens=30):
        s.add_request(r)
    run_step(s)
    s.add_request(req("small", 4, max_tokens=30))
    while "small" not in s.requests or s.requests["small"].status != RequestStatus.RUNNING:
        run_step(s)
    while not (out := run_step(s)[0]).preempted_req_ids:
        assert s.has_unfinished_requests()
    assert all(rid.endswith("_big") for rid in out.preempted_req_ids)  # not the one request of its own
    while s.has_unfinished_requests():
        run_step(s)


# ---- the priority policy ------------------------------------------------------------------------
def prio(rid: str, n_prompt: int, priority: int, arrival: float, max_tokens: int = 4) -> Request:
    return Request(rid, [5 + i % 7 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens), [EOS], 4,
                   arrival_time=arrival, priority=priority)


def test_priority_orders_the_waiting_queue_then_arrival():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    for rid, priority, arrival in [("late-low", 5, 1.0), ("high", 0, 3.0), ("early-low", 5, 0.5), ("mid", 1, 2.0)]:
        s.add_request(prio(rid, 4, priority, arrival, max_tokens=1))
    order = []
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        order += [n.req_id for n in out.scheduled_new_reqs]
    assert order == ["high", "mid", "early-low", "late-low"]


def test_fcfs_ignores_priority():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(prio("first", 4, 9, 1.0, max_tokens=1))
    s.add_request(prio("second", 4, 0, 2.0, max_tokens=1))
    out, _ = run_step(s)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["first"]


def test_priority_preempts_the_lowest_priority_running_request():
    # 6 usable blocks of 4 tokens; both requests grow past what fits together.
    s = make_scheduler(num_blocks=7, budget=32, policy="priority")
    s.add_request(prio("important", 8, 0, 2.0, max_tokens=8))  # arrives later
    s.add_request(prio("background", 8, 3, 1.0, max_tokens=8))
    preempted = []
    finished = []
    for _ in range(60):
        out, results = run_step(s)
        preempted += sorted(out.preempted_req_ids)
        finished += [r.request_id for r in results if r.finished]
        if not s.has_unfinished_requests():
            break
    assert preempted and set(preempted) == {"background"}  # never the important one, though it arrived last
    assert finished == ["important", "background"]
    assert s.kv.pool.num_free_blocks == 6


def test_a_preempted_victim_scheduled_earlier_in_the_step_gives_its_tokens_back():
    s = make_scheduler(num_blocks=7, budget=32, policy="priority")
    s.add_request(prio("low", 8, 5, 1.0, max_tokens=12))  # first in the running list
    s.add_request(prio("high", 8, 0, 2.0, max_tokens=12))
    victims = set()
    for _ in range(30):
        out, _ = run_step(s)
        if out.preempted_req_ids:
            victims |= out.preempted_req_ids
            assert "low" not in out.num_scheduled_tokens  # its scheduled tokens were taken back
            assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        if not s.has_unfinished_requests():
            break
    assert victims == {"low"}
    assert not s.has_unfinished_requests()
TestAsyncSchedulerMachine.settings = TestSchedulerMachine.settings


def test_stats_count_the_samples_waiting_beyond_their_share_as_deferred():
    s = make_scheduler(num_blocks=200, max_num_seqs=8, budget=64)
    for r in samples("big", 10):
        s.add_request(r)
    run_step(s)
    stats = s.make_stats()
    assert stats.num_running_reqs == 7 and stats.num_waiting_reqs == 3 and stats.num_waiting_deferred == 3
    s.add_request(req("small", 4))  # waits for the next step, held back by nothing but the step
    stats = s.make_stats()
    assert stats.num_waiting_reqs == 4 and stats.num_waiting_deferred == 3


def test_outputs_carry_how_often_their_request_was_preempted():
    s = make_scheduler(num_blocks=7, budget=32, max_model_len=64)  # as in the preemption test above
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8))
    last: dict[str, int] = {}
    while s.has_unfinished_requests():
        for r in run_step(s)[1]:
            last[r.request_id] = r.num_preemptions
    assert sum(last.values()) == s.num_preemptions > 0

"""Scheduler behaviour and invariants, driven with synthetic model outputs (the model is not the unit here)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from compiled_llm.config import CacheConfig, SchedulerConfig
from compiled_llm.engine.request import Request, RequestStatus
from compiled_llm.engine.scheduler import ModelRunnerOutput, Scheduler
from compiled_llm.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=4, budget=16, max_model_len=64, caching=True):
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=caching, num_blocks=num_blocks)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), cache, [EOS])


def req(rid: str, n_prompt: int, max_tokens: int = 4, block_size: int = 4, **kw) -> Request:
    return Request(rid, [5 + i % 7 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, **kw), [EOS], block_size)


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
        assert out.total_num_scheduled_tokens <= 12
        assert len(self.s.running) <= 3
        if self.s.num_preemptions > preemptions:
            newly_running = {rid for rid in before_waiting if rid in out.num_scheduled_tokens}
            assert not newly_running, "a request was admitted in a step that preempted"
        for r in results:
            if r.finished:
                assert r.request_id not in self.finished
                self.finished.add(r.request_id)

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


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])

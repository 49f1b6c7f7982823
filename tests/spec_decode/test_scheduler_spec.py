"""The scheduler's bookkeeping of drafts, driven with synthetic runner outputs: what it schedules,
how it rolls back rejected tokens, that their blocks never become prefix-cache blocks, and that
stops apply to each accepted token in order."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compiled_llm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from compiled_llm.core.block_hash import hash_block_tokens
from compiled_llm.core.request import Request, RequestStatus
from compiled_llm.core.scheduler import Scheduler
from compiled_llm.messages.runner_output import ModelRunnerOutput
from compiled_llm.sampling_params import SamplingParams

EOS = 2
BLOCK = 4


def make_scheduler(k=3, budget=64, max_model_len=64, num_blocks=64) -> Scheduler:
    return Scheduler(SchedulerConfig(4, budget, max_model_len), CacheConfig(block_size=BLOCK), num_blocks,
                     SpeculativeConfig("ngram", k, 1, 3))


def add(s: Scheduler, rid: str, prompt: list[int], **params) -> Request:
    request = Request(rid, prompt, SamplingParams(**{"max_tokens": 30, **params}), [EOS], BLOCK)
    s.add_request(request)
    return request


def finish(s: Scheduler, out, accept=lambda rid, drafts: len(drafts), next_token=lambda rid: 9):
    """Account step `out` where each verifying request accepts `accept(rid, drafts)` drafts, then
    gets `next_token(rid)` (a request without drafts gets only that token)."""
    sampled = []
    for rid in out.num_scheduled_tokens:
        request = s.requests[rid]
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        if request.num_computed_tokens - len(drafts) < request.num_tokens:
            sampled.append([])  # a prompt chunk
            continue
        sampled.append(drafts[: accept(rid, drafts)] + [next_token(rid)])
    return s.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))


def step(s: Scheduler, accept=lambda rid, drafts: len(drafts), next_token=lambda rid: 9):
    out = s.schedule()
    return out, finish(s, out, accept, next_token)


def test_drafts_follow_the_latest_match_and_rejected_ones_are_rolled_back():
    s = make_scheduler(k=3)
    r = add(s, "a", [5, 6, 7, 8, 5, 6])
    out, _ = step(s, next_token=lambda rid: 7)  # the prompt; sampled 7: "5 6 7" was seen, 8 5 6 follow
    assert not out.scheduled_spec_decode_tokens
    out, results = step(s, accept=lambda rid, d: 1, next_token=lambda rid: 1)
    assert out.scheduled_spec_decode_tokens == {"a": [8, 5, 6]} and out.num_scheduled_tokens == {"a": 4}
    assert results[0].new_token_ids == [8, 1]
    assert r.all_token_ids == [5, 6, 7, 8, 5, 6, 7, 8, 1] and r.num_computed_tokens == r.num_tokens - 1


def test_stops_apply_to_each_accepted_token_in_order():
    s = make_scheduler(k=4)
    add(s, "eos", [3, 4, EOS, 5, 3])
    add(s, "stop", [3, 4, 11, 12, 3], stop_token_ids=[11])
    add(s, "len", [3, 4, 13, 14, 3], max_tokens=2)
    step(s, next_token=lambda rid: 4)  # each ends "3 4": the drafts are what followed "3 4" before
    out, results = step(s, next_token=lambda rid: 6)
    assert out.scheduled_spec_decode_tokens == {"eos": [EOS, 5, 3, 4], "stop": [11, 12, 3, 4]}
    got = {o.request_id: (o.new_token_ids, o.finish_reason, o.stop_reason) for o in results}
    assert got["eos"] == ([EOS], "stop", None)  # 5 3 4 6 after EOS dropped
    assert got["stop"] == ([11], "stop", 11)
    assert got["len"] == ([6], "length", None)  # max_tokens left no room for drafts
    assert not s.has_unfinished_requests() and s.kv.pool.num_free_blocks == 63


def test_min_tokens_hold_back_eos_inside_an_accepted_run():
    s = make_scheduler(k=4)
    r = add(s, "a", [3, EOS, 5], min_tokens=3)
    step(s, next_token=lambda rid: 3)  # output 1: 3; what followed "3" before: EOS 5 3, and so on
    out, results = step(s, next_token=lambda rid: 8)
    assert out.scheduled_spec_decode_tokens == {"a": [EOS, 5, 3, EOS]}
    # Output 2 (EOS) is held back by min_tokens; output 5, the same EOS past min_tokens, ends the request.
    assert results[0].new_token_ids == [EOS, 5, 3, EOS] and results[0].finish_reason == "stop"
    assert r.status == RequestStatus.FINISHED_STOPPED and s.kv.pool.num_free_blocks == 63


def test_drafts_fit_the_budget_and_max_model_len():
    s = make_scheduler(k=5, budget=4, max_model_len=12)
    r = add(s, "a", [1, 2, 3, 1, 2, 3, 1, 2])
    proposed = 0
    while s.has_unfinished_requests():
        known = r.num_tokens
        out = s.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        proposed += len(drafts)
        assert out.num_scheduled_tokens["a"] <= 4 and known + len(drafts) + 1 <= 12
        finish(s, out)
    assert proposed and r.num_tokens == 12 and r.status == RequestStatus.FINISHED_LENGTH


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(accepts=st.lists(st.integers(0, 4), min_size=1, max_size=40), seed=st.integers(0, 3))
def test_only_blocks_of_known_tokens_are_ever_cached(accepts, seed):
    s = make_scheduler(k=4, num_blocks=40)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9, 10, 9], [1, 3, 1, 3, 1]]
    for i, prompt in enumerate(prompts):
        add(s, f"r{i}", prompt, max_tokens=25)
    rounds = iter(accepts * 4)
    for _ in range(200):  # 3 requests of 25 tokens: far fewer steps
        if not s.has_unfinished_requests():
            break
        n = next(rounds, 0)
        step(s, accept=lambda rid, d, n=n: min(n, len(d)), next_token=lambda rid, n=n: 5 + (seed + n) % 4)
        for request in s.requests.values():
            # Computed tokens never run ahead of the known ones (rejected drafts are rolled back).
            assert request.status != RequestStatus.RUNNING or request.num_computed_tokens <= request.num_tokens
            for i, block in enumerate(s.kv.req_blocks.get(request.request_id, [])):
                if block.block_hash is not None:  # a cached block holds known tokens only
                    tokens = request.all_token_ids[i * BLOCK : (i + 1) * BLOCK]
                    assert len(tokens) == BLOCK
                    parent = request.block_hashes[i - 1] if i else None
                    assert block.block_hash == hash_block_tokens(parent, tokens)
    assert not s.has_unfinished_requests() and s.kv.pool.num_free_blocks == 39


def test_drafts_never_preempt_anyone():
    s = make_scheduler(k=3, num_blocks=3)  # two usable blocks of 4 tokens
    add(s, "a", [5, 6, 7, 5, 6, 7, 5])
    step(s, next_token=lambda rid: 6)  # 8 tokens: both blocks; drafts 7 5 6 would need a third
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_decode_tokens
    assert s.num_preemptions == 0


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size():
    s = Scheduler(SchedulerConfig(4, 64, 64), CacheConfig(block_size=BLOCK), 64,
                  SpeculativeConfig("ngram", 3, 1, 3, disable_by_batch_size=1))
    add(s, "long", [5, 6, 7, 5, 6], max_tokens=12)
    add(s, "short", [8, 9, 8, 9], max_tokens=3)
    both, alone = [], []
    while s.has_unfinished_requests():
        out, _ = step(s, next_token=lambda rid: 6 if rid == "long" else 8)
        (both if len(out.num_scheduled_tokens) == 2 else alone).append(bool(out.scheduled_spec_decode_tokens))
    assert both and not any(both) and any(alone)

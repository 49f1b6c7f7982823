"""Adaptive back-off: a request whose proposals keep failing is paused (longer each time in a row),
one whose proposals land keeps proposing; the scheduler asks for drafts only when it may."""

from __future__ import annotations

from compiled_llm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from compiled_llm.core.request import Request
from compiled_llm.core.scheduler import Scheduler
from compiled_llm.messages.runner_output import ModelRunnerOutput
from compiled_llm.sampling_params import SamplingParams
from compiled_llm.spec_decode.backoff import (
    FIRST_LENGTH,
    MIN_ACCEPTANCE,
    AcceptanceBackoff,
    min_acceptance,
    shortest_match,
)


def pauses(backoff: AcceptanceBackoff, verdicts: list[int], k: int = 4, needed: float = MIN_ACCEPTANCE) -> list[int]:
    """Feed verdicts (accepted of k) whenever it may propose; the steps it sat out before each."""
    out, waited = [], 0
    verdicts = list(verdicts)
    while verdicts:
        if backoff.may_propose():
            out.append(waited)
            waited = 0
            backoff.record(k, verdicts.pop(0), needed)
        else:
            waited += 1
    return out


def test_rejections_pause_longer_each_time_and_acceptance_resets():
    assert pauses(AcceptanceBackoff(), [4] * 10) == [0] * 10
    waits = pauses(AcceptanceBackoff(), [0] * 8)
    assert waits[:3] == [0, 0, 0] and waits[3] == 8 and max(waits) <= 128
    assert [w for w in waits if w] == sorted(w for w in waits if w)  # longer each time
    assert pauses(AcceptanceBackoff(), [0, 0, 0, 4, 4, 4, 0, 0, 0, 0]) == [0, 0, 0, 8, 0, 0, 0, 0, 0, 8]


def test_the_scheduler_stops_proposing_to_a_request_whose_drafts_fail():
    s = Scheduler(SchedulerConfig(4, 64, 256), CacheConfig(block_size=4), 128, SpeculativeConfig("ngram", 3, 1, 1))
    s.add_request(Request("a", [5, 6, 5, 6, 5], SamplingParams(max_tokens=60), [2], 4))
    verified = 0
    for _ in range(60):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        verified += bool(drafts)
        s.update_from_output(out, ModelRunnerOutput(["a"], [[5 if drafts == [] else 7]]))  # every draft rejected
    assert 3 <= verified <= 10  # not every one of ~60 steps


def test_draft_length_doubles_on_full_acceptance_and_drops_to_one_past_the_accepted():
    b = AcceptanceBackoff()
    assert b.length == 4
    lengths = []
    for drafts, accepted in [(4, 4), (8, 8), (16, 16), (5, 2), (3, 3), (2, 2), (6, 6), (12, 0)]:
        b.record(drafts, accepted)
        lengths.append(b.length)
    # a proposal shorter than the length (the context ran out), all accepted, leaves it as it is
    assert lengths == [8, 16, 32, 3, 6, 6, 12, 1]


def test_the_scheduler_gives_a_request_as_many_drafts_as_its_length_allows():
    """num_speculative_tokens caps the length; a repeating prompt's drafts grow to it as they land."""
    s = Scheduler(SchedulerConfig(4, 64, 256), CacheConfig(block_size=4), 512, SpeculativeConfig("ngram", 10, 1, 2))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 6
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=80), [2], 4))
    sizes = []
    while s.has_unfinished_requests():
        out = s.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        if out.num_scheduled_tokens.get("a", 0) == 1 + len(drafts):  # a decode step (not a prompt chunk)
            sizes.append(len(drafts))
        known = len(s.requests["a"].all_token_ids)  # the model continues the cycle: every draft is right
        assert drafts == [prompt[(known + i) % 12] for i in range(len(drafts))]
        s.update_from_output(out, ModelRunnerOutput(["a"], [[*drafts, prompt[(known + len(drafts)) % 12]]]))
    assert sizes[:3] == [4, 8, 10] and max(sizes) == 10


def test_the_acceptance_drafts_need_grows_with_the_batch_where_rows_cost_compute():
    """Break-even: a draft costs a row, an accepted one saves its request's share of a step."""
    assert min_acceptance(1, None) == min_acceptance(32, None) == MIN_ACCEPTANCE  # GPU: rows next to free
    assert min_acceptance(1, 4.0) == MIN_ACCEPTANCE
    assert min_acceptance(8, 4.0) == 8 / 12 and min_acceptance(32, 4.0) == 32 / 36
    needs = [min_acceptance(b, 4.0) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert needs == sorted(needs) and needs[-1] < 1


def test_at_a_large_batch_half_accepted_drafts_pause_and_a_copy_keeps_speculating():
    needed = min_acceptance(32, 4.0)
    assert pauses(AcceptanceBackoff(), [4] * 10, needed=needed) == [0] * 10  # a copy: every draft lands
    assert pauses(AcceptanceBackoff(), [2] * 10, needed=MIN_ACCEPTANCE) == [0] * 10  # alone, half pays
    waits = pauses(AcceptanceBackoff(), [2] * 6, needed=needed)
    assert waits[1] == 8 and all(waits[2:])  # at 32 requests it pauses, each time after one try
    # After a pause one good verification keeps it going (its average starts at what it needs).
    assert pauses(AcceptanceBackoff(), [2, 4, 4, 4], needed=needed) == [0, 8, 0, 0]


def test_the_scheduler_asks_more_of_a_batch_of_requests_where_rows_cost_compute():
    """Eight requests whose drafts are at most half right. Where each step's time grows with its rows as on
    a CPU (6.5 ms + 2 ms a row: a fixed cost of 3.25 rows), half is not enough at 8 requests and
    they mostly stop proposing; where rows are free (steps take 5 ms whatever their rows) or the
    cost is not measured, they keep going."""
    def verified(measure: bool, seconds) -> int:
        s = Scheduler(SchedulerConfig(8, 256, 512), CacheConfig(block_size=4), 512, SpeculativeConfig("ngram", 2, 1, 1),
                      measure_step_cost=measure)
        for i in range(8):
            s.add_request(Request(f"r{i}", [5, 6, 5, 6, 5, 6, 5], SamplingParams(max_tokens=150), [2], 4))
        count = step = 0
        while s.has_unfinished_requests():
            out = s.schedule()
            ids = list(out.num_scheduled_tokens)
            sampled = []
            for i, rid in enumerate(ids):
                drafts = out.scheduled_spec_decode_tokens.get(rid, [])
                count += bool(drafts)
                # every other step the first draft is right, the rest never (so draft lengths, and
                # the steps' rows, vary)
                right = drafts[:1] if (i + step) % 2 else []
                sampled.append([*right, 9] if drafts else [s.requests[rid].all_token_ids[-2]])
            step += 1
            outputs = s.update_from_output(out, ModelRunnerOutput(ids, sampled))
            s.record_step_time(out, outputs, seconds(out.total_num_scheduled_tokens))
        if measure:
            fixed = s.step_cost.fixed_rows()
            assert fixed is None if seconds(1) == seconds(9) else abs(fixed - 3.25) < 0.01
        return count

    costly = verified(True, lambda rows: 6.5e-3 + 2e-3 * rows)
    free = verified(True, lambda rows: 5e-3)
    unmeasured = verified(False, lambda rows: 6.5e-3 + 2e-3 * rows)
    assert free == unmeasured and costly < free / 2, (costly, free)


def test_untried_drafts_are_probed_one_at_a_time_where_the_bar_is_high():
    """At 32 requests (a bar of 89% with a fixed cost of 4 rows) a request's first proposal, and its
    first after a pause, is one draft, doubled while all land; alone (a bar of 20%) it starts at
    FIRST_LENGTH."""
    alone = AcceptanceBackoff()
    alone.probe(min_acceptance(1, 4.0))
    assert alone.length == FIRST_LENGTH
    b, needed = AcceptanceBackoff(), min_acceptance(32, 4.0)
    b.probe(needed)
    lengths = [b.length]
    for drafts, accepted in [(1, 1), (2, 2), (4, 1)]:
        b.record(drafts, accepted, needed)
        lengths.append(b.length)
    assert lengths == [1, 2, 4, 1] and b.pause_left  # the last verification paused it


def test_the_scheduler_probes_with_one_draft_in_a_batch_where_rows_cost_compute():
    """With a measured fixed cost of 3.25 rows, eight requests' first proposals are one draft each
    (a bar of 71%); one request alone gets FIRST_LENGTH (a bar of 24%)."""
    def first_drafts(n: int) -> list[int]:
        s = Scheduler(SchedulerConfig(8, 256, 512), CacheConfig(block_size=4), 512, SpeculativeConfig("ngram", 4, 1, 1),
                      measure_step_cost=True)
        for step in range(20):  # steps of 1..9 rows at 6.5 ms + 2 ms a row
            rows = 1 + step % 9
            s.step_cost.observe(rows, 6.5e-3 + 2e-3 * rows)
        assert abs(s.step_cost.fixed_rows() - 3.25) < 0.01
        for i in range(n):
            s.add_request(Request(f"r{i}", [5, 6, 5, 6, 5, 6, 5], SamplingParams(max_tokens=20), [2], 4))
        first: dict[str, int] = {}
        while len(first) < n:
            out = s.schedule()
            ids = list(out.num_scheduled_tokens)
            for rid, drafts in out.scheduled_spec_decode_tokens.items():
                first.setdefault(rid, len(drafts))
            s.update_from_output(out, ModelRunnerOutput(ids, [[s.requests[r].all_token_ids[-2]] for r in ids]))
        return list(first.values())

    assert first_drafts(8) == [1] * 8
    assert first_drafts(1) == [FIRST_LENGTH]


def test_where_most_drafts_must_land_only_the_longest_matches_propose():
    """With a measured fixed cost of 3.25 rows: alone (a bar of 24%) a request whose context repeats
    only a 2-token n-gram gets drafts; among eight (a bar of 71%) it gets none, while one that
    repeats a 3-token n-gram (prompt_lookup_max) still does."""
    assert shortest_match(min_acceptance(1, 4.0), 2, 4) == 2 and shortest_match(min_acceptance(32, 4.0), 2, 4) == 4

    def first_drafts(prompts: list[list[int]]) -> list[list[int]]:
        s = Scheduler(SchedulerConfig(8, 256, 512), CacheConfig(block_size=4), 512, SpeculativeConfig("ngram", 4, 2, 3),
                      measure_step_cost=True)
        for step in range(20):  # steps of 1..9 rows at 6.5 ms + 2 ms a row
            rows = 1 + step % 9
            s.step_cost.observe(rows, 6.5e-3 + 2e-3 * rows)
        for i, prompt in enumerate(prompts):
            s.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=20), [2], 4))
        out = s.schedule()  # the prompts, each then sampling a 6
        s.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), [[6] for _ in prompts]))
        out = s.schedule()  # each request's first decode: its drafts, if any
        return [out.scheduled_spec_decode_tokens.get(f"r{i}", []) for i in range(len(prompts))]

    short = [3, 5, 6, 8, 7, 5]  # + 6: "5 6" seen at 1-2 (then 8); "7 5 6" never
    long = [7, 5, 6, 8, 7, 5]  # + 6: "7 5 6" seen at 0-2 (then 8)
    assert first_drafts([short]) == [[8, 7, 5, 6]]
    assert first_drafts([short, long] + [[20 + i, 21 + i, 22 + i] for i in range(6)])[:2] == [[], [8]]

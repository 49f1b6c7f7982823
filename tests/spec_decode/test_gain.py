"""The engine-wide switch (`SpeculationGain`): per batch-size bucket it alternates until both
kinds of step have samples, then keeps the faster (speculation only when it beats plain decoding
by the margin), probing the other every PROBE_EVERY steps; and end to end a scheduler fed step
times stops proposing drafts where they do not pay."""

from __future__ import annotations

from compiled_llm.spec_decode.gain import MIN_SAMPLES, PROBE_EVERY, SpeculationGain


def drive(gain: SpeculationGain, running: int, rate: dict[bool, float], steps: int) -> list[bool]:
    choices = []
    for _ in range(steps):
        speculated = gain.speculate(running)
        choices.append(speculated)
        gain.record(running, speculated, int(rate[speculated] * 10), 10.0)
    return choices


def test_each_bucket_keeps_the_faster_kind_and_probes_the_other():
    gain = SpeculationGain()
    pays = drive(gain, 1, {True: 90.0, False: 50.0}, 200)
    assert pays[: 2 * MIN_SAMPLES].count(True) == MIN_SAMPLES  # alternates while learning
    late = pays[2 * MIN_SAMPLES :]
    assert late.count(False) <= len(late) // PROBE_EVERY + 1  # only the probes decode plainly
    costs = drive(gain, 32, {True: 300.0, False: 400.0}, 200)
    late = costs[2 * MIN_SAMPLES :]
    assert late.count(True) <= len(late) // PROBE_EVERY + 1
    assert drive(gain, 1, {True: 90.0, False: 50.0}, 5).count(True) >= 4  # buckets are separate
    summary = gain.summary()
    assert summary[1][2] and not summary[63][2]


def test_a_gain_inside_the_margin_is_not_worth_speculating():
    gain = SpeculationGain()
    choices = drive(gain, 4, {True: 101.0, False: 100.0}, 100)
    assert choices[-PROBE_EVERY + 1 :].count(True) <= 1


def test_a_change_in_the_workload_is_followed():
    gain = SpeculationGain()
    drive(gain, 1, {True: 60.0, False: 100.0}, 100)  # text that does not repeat
    later = drive(gain, 1, {True: 200.0, False: 100.0}, 6 * PROBE_EVERY)  # then text that does
    assert later[-PROBE_EVERY:].count(True) >= PROBE_EVERY - 1


def test_a_scheduler_fed_step_times_stops_proposing_where_drafts_do_not_pay():
    from compiled_llm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from compiled_llm.core.scheduler import Scheduler
    from tests.spec_decode.test_scheduler_spec import BLOCK, add, finish

    s = Scheduler(SchedulerConfig(4, 64, 512), CacheConfig(block_size=BLOCK), 256,
                  SpeculativeConfig("ngram", 3, 1, 3, measure_gain=True))
    add(s, "a", [5, 6, 7] * 3, max_tokens=200)
    with_drafts = []
    while s.has_unfinished_requests():
        out = s.schedule()
        # One draft in three accepted: enough to keep the request's own back-off quiet.
        results = finish(s, out, accept=lambda rid, drafts: min(1, len(drafts)), next_token=lambda rid: 5)
        drafted = bool(out.scheduled_spec_decode_tokens)
        with_drafts.append(drafted)
        # A verification costs 2.5x a plain step and yields two tokens: 80 against 100 tokens/s.
        s.record_step_time(out, results, 0.025 if drafted else 0.010)
    late = with_drafts[3 * MIN_SAMPLES :]
    assert late.count(True) <= len(late) // PROBE_EVERY + 2

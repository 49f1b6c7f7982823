"""Speculative decoding's counters: the scheduler's stats count verifications, proposed and accepted
tokens (per position), and the frontend's Prometheus metrics carry them under vLLM's names."""

from __future__ import annotations

from prometheus_client import generate_latest

from compiled_llm.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from compiled_llm.core.request import Request
from compiled_llm.core.scheduler import Scheduler
from compiled_llm.engine.metrics import EngineMetrics
from compiled_llm.messages.runner_output import ModelRunnerOutput
from compiled_llm.sampling_params import SamplingParams


def test_scheduler_stats_reach_the_metrics():
    s = Scheduler(SchedulerConfig(4, 64, 64), CacheConfig(block_size=4), 32, SpeculativeConfig("ngram", 3, 1, 2))
    s.add_request(Request("a", [5, 6, 7, 8, 5, 6], SamplingParams(max_tokens=20), [2], 4))
    metrics = EngineMetrics("m")
    proposed, per_pos = [], [0, 0, 0]
    for accept in (0, 2, 0, 1, 3):  # of each step's drafts, after the prompt's step (the sampled 5 repeats)
        out = s.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        if drafts:
            proposed.append(len(drafts))
            for i in range(min(accept, len(drafts))):
                per_pos[i] += 1
        s.update_from_output(out, ModelRunnerOutput(["a"], [drafts[:accept] + [5]]))
        metrics.record_scheduler_stats(s.make_stats())
    totals = s.spec_totals
    assert len(proposed) >= 3 and (totals.num_drafts, totals.num_draft_tokens) == (len(proposed), sum(proposed))
    assert totals.num_accepted_tokens_per_pos == per_pos and totals.num_accepted_tokens == sum(per_pos)
    text = generate_latest(metrics.registry).decode()
    labels = '{engine="0",model_name="m"}'
    assert f"compiled_llm:spec_decode_num_drafts_total{labels} {float(len(proposed))}" in text
    assert f"compiled_llm:spec_decode_num_draft_tokens_total{labels} {float(sum(proposed))}" in text
    assert f"compiled_llm:spec_decode_num_accepted_tokens_total{labels} {float(sum(per_pos))}" in text
    for position, accepted in enumerate(per_pos):
        assert (f'compiled_llm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",'
                f'position="{position}"}} {float(accepted)}') in text

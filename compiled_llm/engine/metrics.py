"""Prometheus metrics of one frontend, under vLLM's names with the `compiled_llm:` prefix.

Fed from two places: the `SchedulerStats` that ride on every `EngineCoreOutputs` (queue lengths,
KV-cache usage, prefix-cache lookups) and the `OutputProcessor`'s `on_output` hook (tokens and
per-request latencies, measured where the user sees them). Each instance has its own
`CollectorRegistry`, so several servers (or tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from compiled_llm.engine.output_processor import RequestState
from compiled_llm.messages.engine_core import EngineCoreOutput, SchedulerStats

PREFIX = "compiled_llm:"

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class EngineMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=reg).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the model's running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted for lack of KV-cache blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self._request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.", ["model_name", "finished_reason"],
            registry=reg,
        )
        self._model_name = model_name
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two outputs of one request.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last output.", E2E_BUCKETS
        )
        self._last_output_time: dict[str, float] = {}
        self._preemptions_seen = 0

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits)
        # The scheduler's count is a running total.
        self.num_preemptions.inc(max(stats.num_preemptions - self._preemptions_seen, 0))
        self._preemptions_seen = stats.num_preemptions

    def on_output(self, state: RequestState, out: EngineCoreOutput) -> None:
        """`OutputProcessor.on_output`: called after each engine output has been applied to `state`."""
        m = state.metrics
        rid = state.request_id
        if out.new_token_ids and m.last_token_time is not None:
            previous = self._last_output_time.get(rid)
            if previous is None:
                self.prompt_tokens.inc(len(state.prompt_token_ids))
                if m.first_token_time is not None:
                    self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
            else:
                self.inter_token_latency.observe(m.last_token_time - previous)
            self._last_output_time[rid] = m.last_token_time
            self.generation_tokens.inc(len(out.new_token_ids))
        if m.finished_time is not None:
            self._last_output_time.pop(rid, None)
            # A finish the engine did not report is a stop string found here.
            reason = out.finish_reason or "stop"
            self._request_success.labels(self._model_name, reason).inc()
            self.e2e_request_latency.observe(m.finished_time - m.arrival_time)

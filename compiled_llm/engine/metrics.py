"""Prometheus metrics of one frontend, under vLLM's names with the `compiled_llm:` prefix (or
vLLM's own `vllm:`, with `serve --metrics-namespace vllm`, for dashboards and alerts made for vLLM).

Fed from two places: the `SchedulerStats` that ride on every `EngineCoreOutputs` (queue lengths,
KV-cache usage, prefix-cache lookups, the step's token count) and the `OutputProcessor`'s
`on_output` hook (tokens and per-request latencies, measured where the user sees them). Each
instance has its own `CollectorRegistry`, so several servers (or tests) can live in one process.

With several API server processes (`serve --api-server-count`), each records its own requests
into prometheus_client's multiprocess files and /metrics adds them all up (`exposition`); the
engine's scheduler stats reach process 0 alone (`OutputRouter`), so its gauges and counters are
counted once.

Every series carries vLLM's two labels, `model_name` and `engine` (the engine's index in a
data-parallel group, "0" with one engine): a group's totals are the sums over `engine`.

A request's phases, as vLLM splits them: queued (arrival to first scheduled, which the engine
core reports with the request's first output), prefill (scheduled to first token), decode (first
to last token); inference is prefill and decode together.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from compiled_llm.config import METRICS_NAMESPACES, CacheConfig
from compiled_llm.engine.admission import ADMISSION_REASONS
from compiled_llm.engine.output_processor import RequestState
from compiled_llm.messages.engine_core import EngineCoreOutput, SchedulerStats

DEFAULT_NAMESPACE = METRICS_NAMESPACES[0]

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
PREFILL_TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20, 50)
WAITING_REASONS = ("capacity", "deferred")


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class PerEngine:
    """One metric family's series for each engine, made on first use."""

    def __init__(self, family: Any, model_name: str) -> None:
        self.family = family
        self.model_name = model_name
        self._series: dict[int, Any] = {}

    def __getitem__(self, engine: int) -> Any:
        series = self._series.get(engine)
        if series is None:
            series = self._series[engine] = self.family.labels(self.model_name, str(engine))
        return series


class EngineMetrics:
    def __init__(self, model_name: str, max_model_len: int = 1 << 17, num_engines: int = 1,
                 namespace: str = DEFAULT_NAMESPACE) -> None:
        if namespace not in METRICS_NAMESPACES:
            raise ValueError(f"Unknown metrics namespace {namespace!r}; use one of {', '.join(METRICS_NAMESPACES)}.")
        self.prefix = prefix = namespace + ":"
        self.max_model_len = max_model_len
        self.registry = CollectorRegistry()
        reg, labels = self.registry, ["model_name", "engine"]
        self.engine = 0  # the engine whose outputs are being recorded (set by the output handler)

        def gauge(name: str, doc: str) -> PerEngine:
            # With several API server processes only process 0 sets them: its latest value is the one.
            return PerEngine(Gauge(prefix + name, doc, labels, registry=reg, multiprocess_mode="mostrecent"),
                             model_name)

        def counter(name: str, doc: str) -> PerEngine:
            return PerEngine(Counter(prefix + name, doc, labels, registry=reg), model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> PerEngine:
            return PerEngine(Histogram(prefix + name, doc, labels, buckets=buckets, registry=reg), model_name)

        token_buckets = buckets_1_2_5(max_model_len)
        self.num_requests_running = gauge("num_requests_running", "Requests in the model's running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self._waiting_by_reason = Gauge(
            prefix + "num_requests_waiting_by_reason", "Requests waiting to be scheduled, by reason: capacity (no "
            "room yet) or deferred (held back by a rule: an n > 1 request's samples beyond their share).",
            ["model_name", "engine", "reason"], registry=reg, multiprocess_mode="mostrecent")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Requests preempted for lack of KV-cache blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        # Speculative decoding (vLLM's names): verifications, proposed and accepted tokens.
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Speculative verifications (a request "
                                              "with at least one draft token in a step).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter(
            prefix + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
            ["model_name", "engine", "position"], registry=reg,
        )
        self._request_success = Counter(
            prefix + "request_success", "Finished requests, by finish reason.",
            ["model_name", "engine", "finished_reason"], registry=reg,
        )
        self._model_name = model_name
        # vLLM's frontend admission counter: requests refused by --max-num-queued-reqs/-tokens.
        self._admission_rejections = Counter(
            prefix + "admission_rejections", "Requests refused at admission by a queue limit, by reason.",
            ["model_name", "reason"], registry=reg)
        for reason in ADMISSION_REASONS:
            self._admission_rejections.labels(model_name, reason)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens (prompt and generated) per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens generated by each finished request.", token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Per finished user request, the most tokens any of its n samples generated.", token_buckets)
        self.request_params_n = histogram("request_params_n", "The n of each finished user request.", N_BUCKETS)
        self.request_num_preemptions = histogram(
            "request_num_preemptions", "Per finished request, the times it was preempted.", PREEMPTION_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "The max_tokens of each finished request.", token_buckets)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two outputs of one request.", ITL_BUCKETS
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Time between two outputs of one request (vLLM's older name of "
            "inter_token_latency_seconds, which dashboards still read).", ITL_BUCKETS
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Per finished request, its decode time per token after the "
            "first.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the last output.", E2E_BUCKETS
        )
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Time from arrival until first scheduled (waiting).", E2E_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "Time from first scheduled to the first token.", E2E_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "Time from the first token to the last.", E2E_BUCKETS)
        self.request_inference_time = histogram("request_inference_time_seconds",
                                                "Time from first scheduled to the last token (running).", E2E_BUCKETS)
        self.time_per_prefill_token = histogram("time_per_prefill_token_request_seconds",
                                                "Per finished request, prefill time per prompt token.",
                                                PREFILL_TOKEN_BUCKETS)
        self._last_output_time: dict[str, float] = {}
        self._scheduled_time: dict[str, float] = {}
        self._parents: dict[str, list[int]] = {}  # user request id -> its finished samples' token counts
        self._preemptions_seen: dict[int, int] = {}
        self._request_preemptions: dict[str, int] = {}  # request id -> times preempted, once it has been
        for engine in range(num_engines):  # every engine's gauges exist from the start, at 0
            for metric in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage_perc):
                metric[engine].set(0)
            for reason in WAITING_REASONS:
                self._waiting_by_reason.labels(model_name, str(engine), reason).set(0)

    def record_cache_config(self, cache_config: CacheConfig, num_blocks: int | None, num_engines: int = 1) -> None:
        """vLLM's `cache_config_info`: an info gauge (always 1) whose labels are the KV cache's
        settings, and the number of blocks the engine made of its budget."""
        size_tokens = num_blocks * cache_config.block_size if num_blocks else None
        info = {
            "block_size": cache_config.block_size,
            "enable_prefix_caching": cache_config.enable_prefix_caching,
            "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
            "gpu_memory_utilization": cache_config.gpu_memory_utilization,
            "num_gpu_blocks": num_blocks,
            # vLLM's: the tokens the cache holds, and how many requests of the full context fit in it.
            "kv_cache_size_tokens": size_tokens,
            "kv_cache_max_concurrency": round(size_tokens / self.max_model_len, 2) if size_tokens else None,
        }
        names = ["model_name", "engine", *info]
        gauge = Gauge(self.prefix + "cache_config_info", "Information of the KV cache's configuration (labels).", names,
                      registry=self.registry, multiprocess_mode="mostrecent")
        for engine in range(num_engines):
            gauge.labels(self._model_name, str(engine), *(str(v) for v in info.values())).set(1)

    def record_admission_rejection(self, reason: str) -> None:
        self._admission_rejections.labels(self._model_name, reason).inc()

    def record_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        self.num_requests_running[engine].set(stats.num_running_reqs)
        self.num_requests_waiting[engine].set(stats.num_waiting_reqs)
        deferred = min(stats.num_waiting_deferred, stats.num_waiting_reqs)
        self._waiting_by_reason.labels(self._model_name, str(engine), "capacity").set(stats.num_waiting_reqs - deferred)
        self._waiting_by_reason.labels(self._model_name, str(engine), "deferred").set(deferred)
        self.kv_cache_usage_perc[engine].set(stats.kv_cache_usage)
        self.prefix_cache_queries[engine].inc(stats.prefix_cache_queries)
        self.prefix_cache_hits[engine].inc(stats.prefix_cache_hits)
        # The scheduler's count is a running total.
        seen = self._preemptions_seen.get(engine, 0)
        self.num_preemptions[engine].inc(max(stats.num_preemptions - seen, 0))
        self._preemptions_seen[engine] = stats.num_preemptions
        spec = stats.spec_decoding
        if spec is not None and spec.num_drafts:
            self.spec_decode_num_drafts[engine].inc(spec.num_drafts)
            self.spec_decode_num_draft_tokens[engine].inc(spec.num_draft_tokens)
            self.spec_decode_num_accepted_tokens[engine].inc(spec.num_accepted_tokens)
            for position, accepted in enumerate(spec.num_accepted_tokens_per_pos):
                self._spec_per_pos.labels(self._model_name, str(engine), str(position)).inc(accepted)
        step_tokens = stats.num_prompt_tokens + stats.num_generation_tokens
        if step_tokens > 0:
            self.iteration_tokens[engine].observe(step_tokens)

    def on_output(self, state: RequestState, out: EngineCoreOutput) -> None:
        """`OutputProcessor.on_output`: called after each engine output has been applied to `state`."""
        m = state.metrics
        rid = state.request_id
        if out.scheduled_time:
            self._scheduled_time[rid] = out.scheduled_time
        if out.num_preemptions:
            self._request_preemptions[rid] = out.num_preemptions
        if out.new_token_ids and m.last_token_time is not None:
            previous = self._last_output_time.get(rid)
            if previous is None:
                self.prompt_tokens[self.engine].inc(len(state.prompt_token_ids))
                if m.first_token_time is not None:
                    self.time_to_first_token[self.engine].observe(m.first_token_time - m.arrival_time)
            else:
                self.inter_token_latency[self.engine].observe(m.last_token_time - previous)
                self.time_per_output_token[self.engine].observe(m.last_token_time - previous)
            self._last_output_time[rid] = m.last_token_time
            self.generation_tokens[self.engine].inc(len(out.new_token_ids))
        if m.finished_time is not None:
            self._last_output_time.pop(rid, None)
            # A finish the engine did not report is a stop string found here.
            reason = out.finish_reason or "stop"
            self._request_success.labels(self._model_name, str(self.engine), reason).inc()
            self.e2e_request_latency[self.engine].observe(m.finished_time - m.arrival_time)
            self._record_finished(state, self._scheduled_time.pop(rid, None))

    def _record_finished(self, state: RequestState, scheduled: float | None) -> None:
        m = state.metrics
        num_generated = len(state.token_ids)
        self.request_prompt_tokens[self.engine].observe(len(state.prompt_token_ids))
        self.request_generation_tokens[self.engine].observe(num_generated)
        self.request_num_preemptions[self.engine].observe(self._request_preemptions.pop(state.request_id, 0))
        if state.params.max_tokens is not None:
            self.request_params_max_tokens[self.engine].observe(state.params.max_tokens)
        self._record_user_request(state, num_generated)
        if scheduled is None:  # aborted before it ran
            return
        first = m.first_token_time or m.finished_time or scheduled
        last = m.last_token_time or first
        self.request_queue_time[self.engine].observe(max(scheduled - m.arrival_time, 0.0))
        self.request_prefill_time[self.engine].observe(max(first - scheduled, 0.0))
        self.request_decode_time[self.engine].observe(max(last - first, 0.0))
        self.request_inference_time[self.engine].observe(max(last - scheduled, 0.0))
        if state.prompt_token_ids:
            self.time_per_prefill_token[self.engine].observe(max(first - scheduled, 0.0) / len(state.prompt_token_ids))
        if num_generated > 1:
            self.request_time_per_output_token[self.engine].observe(max(last - first, 0.0) / (num_generated - 1))

    def _record_user_request(self, state: RequestState, num_generated: int) -> None:
        """n and the longest sample, once per user request (whose n samples run as n engine requests)."""
        n = state.parent.n if state.parent is not None else 1
        counts = self._parents.setdefault(state.external_id, [])
        counts.append(num_generated)
        if len(counts) < n:
            return
        del self._parents[state.external_id]
        self.request_params_n[self.engine].observe(n)
        self.request_max_num_generation_tokens[self.engine].observe(max(counts))


# Set (with PROMETHEUS_MULTIPROC_DIR) by `serve --api-server-count` for its API server processes.
GROUP_METRICS_ENV = "COMPILED_LLM_API_SERVER_GROUP"


def exposition(registry: CollectorRegistry) -> bytes:
    """What /metrics answers: this process's series, or, when several API server processes share
    the work (`serve --api-server-count`), theirs added up from prometheus_client's multiprocess
    files. (A PROMETHEUS_MULTIPROC_DIR set for other reasons does not change what one server says.)"""
    if os.environ.get(GROUP_METRICS_ENV) and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return generate_latest(registry)

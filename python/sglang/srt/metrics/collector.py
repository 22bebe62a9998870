"""Prometheus metrics of the serving front end (exposed at GET /metrics with --enable-metrics).

Metric names follow upstream SGLang (docs/references/production_metrics.md): a "sglang:" prefix and
a `model_name` label. Each server owns one CollectorRegistry, so several servers (or tests) in one
process never share or clash on metrics.

Writers: the TokenizerManager calls `observe_request_finished` once per finished request; the
HTTP layer calls `set_internal_state` with the scheduler's `get_internal_state()` dict at scrape
time.
"""

from __future__ import annotations

import threading

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

# Bucket bounds in seconds (upstream's defaults, rounded).
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 15.0, 20.0, 25.0, 30.0)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
               0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 80.0,
               100.0, 200.0, 400.0, 800.0)
# fmt: on

CONTENT_TYPE = CONTENT_TYPE_LATEST


class TokenizerMetricsCollector:
    """Counters, histograms and gauges for one server, in their own registry.

    Args:
        labels: constant label values, normally {"model_name": served_model_name}.
        registry: registry to register into (default: a fresh one).
    """

    def __init__(self, labels: dict[str, str], registry: CollectorRegistry | None = None) -> None:
        self.labels = dict(labels)
        self.registry = registry if registry is not None else CollectorRegistry()
        self._lock = threading.Lock()
        self._init_counters()
        self._init_histograms()
        self._init_gauges()

    # ---- construction -------------------------------------------------------------------
    def _counter(self, name: str, doc: str) -> Counter:
        c = Counter(name, doc, list(self.labels), registry=self.registry)
        return c.labels(**self.labels)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        h = Histogram(name, doc, list(self.labels), buckets=buckets, registry=self.registry)
        return h.labels(**self.labels)

    def _gauge(self, name: str, doc: str) -> Gauge:
        g = Gauge(name, doc, list(self.labels), registry=self.registry)
        return g.labels(**self.labels)

    def _init_counters(self) -> None:
        self.prompt_tokens = self._counter("sglang:prompt_tokens", "Number of prefill tokens.")
        self.generation_tokens = self._counter(
            "sglang:generation_tokens", "Number of generation tokens."
        )
        self.cached_tokens = self._counter(
            "sglang:cached_tokens", "Number of prompt tokens served from the prefix cache."
        )
        self.num_requests = self._counter("sglang:num_requests", "Number of finished requests.")

    def _init_histograms(self) -> None:
        self.ttft = self._histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token in seconds: from the request's arrival to the scheduler "
            "committing its first output token (streamed or not).",
            TTFT_BUCKETS,
        )
        self.itl = self._histogram(
            "sglang:inter_token_latency_seconds",
            "Inter-token latency in seconds, per token: the gap between streamed deliveries "
            "divided over the tokens of the later one.",
            ITL_BUCKETS,
        )
        self.tpot = self._histogram(
            "sglang:time_per_output_token_seconds",
            "Time per output token (after the first) in seconds: per request, "
            "(e2e latency - TTFT) / (completion tokens - 1).",
            ITL_BUCKETS,
        )
        self.spec_accept_length_hist = self._histogram(
            "sglang:spec_accept_length_per_request",
            "Per finished request: completion tokens per verify forward (speculative decoding).",
            (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0),
        )
        self.spec_mean_draft_len_hist = self._histogram(
            "sglang:spec_mean_draft_len_per_request",
            "Per finished request: proposed draft tokens per verify step (adaptive speculation "
            "lowers it under load; 0 = never drafted).",
            (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0),
        )
        self.e2e = self._histogram(
            "sglang:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            E2E_BUCKETS,
        )

    def _init_gauges(self) -> None:
        self.num_running_reqs = self._gauge("sglang:num_running_reqs", "Running requests.")
        self.num_queue_reqs = self._gauge("sglang:num_queue_reqs", "Requests in the waiting queue.")
        self.num_used_tokens = self._gauge(
            "sglang:num_used_tokens",
            "KV slots held by requests (tokens): pool size - available - evictable prefix "
            "cache. Cached prefixes no request holds are not counted (upstream's num_used).",
        )
        self.token_usage = self._gauge(
            "sglang:token_usage",
            "num_used_tokens / KV pool size (the evictable prefix cache is not counted).",
        )
        self.cache_hit_rate = self._gauge("sglang:cache_hit_rate", "Prefix cache hit rate.")
        self.spec_accept_length = self._gauge(
            "sglang:spec_accept_length", "Average speculative accept length (tokens per verify)."
        )

        self.spec_share_drafting = self._gauge(
            "sglang:spec_share_requests_drafting",
            "Share of running requests that drafted (d > 0) in the last decode step.",
        )

        self.spec_predicted_step_time = self._gauge(
            "sglang:spec_predicted_step_time_seconds",
            "Adaptive speculation: step time the policy predicted for the last decode step.",
        )
        self.spec_measured_step_time = self._gauge(
            "sglang:spec_measured_step_time_seconds",
            "Adaptive speculation: measured cost of the last decode step (wall time since the "
            "previous decode commit).",
        )
        self.spec_mean_draft_len = self._gauge(
            "sglang:spec_mean_draft_len", "Mean draft length per request-step so far."
        )
        self.spec_sum_draft_len = self._gauge(
            "sglang:spec_last_step_sum_draft_len", "Sum of draft lengths in the last decode step."
        )

    # ---- writers ----------------------------------------------------------------------------
    def observe_request_finished(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        cached_tokens: int,
        ttft_s: float | None,
        itls_s: list[float],
        e2e_s: float,
        spec_accept_length: float | None = None,
        spec_mean_draft_len: float | None = None,
    ) -> None:
        """Record one finished request. Times in seconds; ttft_s is None when the request
        produced no token; itls_s are per-token inter-token latencies: each delivery after the
        first gives one entry per token it carries, its gap since the previous delivery divided
        evenly over them (upstream's adjusted interval; none for a non-streamed request)."""
        with self._lock:
            self.num_requests.inc()
            self.prompt_tokens.inc(prompt_tokens)
            self.generation_tokens.inc(completion_tokens)
            self.cached_tokens.inc(cached_tokens)
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            for gap in itls_s:
                self.itl.observe(gap)
            if ttft_s is not None and completion_tokens > 1:
                self.tpot.observe((e2e_s - ttft_s) / (completion_tokens - 1))
            self.e2e.observe(e2e_s)
            if spec_accept_length is not None:
                self.spec_accept_length_hist.observe(spec_accept_length)
            if spec_mean_draft_len is not None:
                self.spec_mean_draft_len_hist.observe(spec_mean_draft_len)

    def set_internal_state(self, state: dict) -> None:
        """Set the gauges from TokenizerManager.get_internal_state() (missing keys skipped)."""
        with self._lock:
            if "num_running_reqs" in state:
                self.num_running_reqs.set(state["num_running_reqs"])
            if "num_waiting_reqs" in state:
                self.num_queue_reqs.set(state["num_waiting_reqs"])
            if "token_usage" in state:
                self.token_usage.set(state["token_usage"])
            if "cache_hit_rate" in state:
                self.cache_hit_rate.set(state["cache_hit_rate"])
            if "num_used_tokens" in state:
                self.num_used_tokens.set(state["num_used_tokens"])
            if state.get("avg_spec_accept_length") is not None:
                self.spec_accept_length.set(state["avg_spec_accept_length"])
            for key, gauge in (
                ("spec_predicted_step_time_s", self.spec_predicted_step_time),
                ("spec_measured_step_time_s", self.spec_measured_step_time),
                ("spec_mean_draft_len", self.spec_mean_draft_len),
                ("spec_last_step_sum_draft_len", self.spec_sum_draft_len),
            ):
                if isinstance(state.get(key), (int, float)):
                    gauge.set(state[key])
            if state.get("spec_last_step_share_drafting") is not None:
                self.spec_share_drafting.set(state["spec_last_step_share_drafting"])

    def render(self) -> bytes:
        """The registry in Prometheus text format (content type: CONTENT_TYPE)."""
        return generate_latest(self.registry)

"""Prometheus metrics for the server (`/metrics`).

The engine's state (queue lengths, KV pages, prefix-cache and preemption counts)
is read from a snapshot that the engine thread publishes after every step or
command, so a scrape never touches the engine itself (it is not thread-safe).
Per-request latencies (TTFT, inter-token latency) and token counts are recorded
by the engine thread as it hands out each delta.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxinfer.engine.engine import EngineStats

PREFIX = "jaxinfer_"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                    0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _RateWindow:
    """Events per second over the last `window` seconds."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, n: int, t: float):
        with self._lock:
            self._events.append((t, n))
            self._prune(t)

    def rate(self, t: float) -> float:
        with self._lock:
            self._prune(t)
            return sum(n for _, n in self._events) / self.window

    def _prune(self, t: float):
        while self._events and self._events[0][0] <= t - self.window:
            self._events.popleft()


class Metrics:
    """The server's collectors, in their own registry (several servers may share a process)."""

    def __init__(self, model_info: dict[str, float] | None = None):
        """model_info: the model's sizes, published as jaxinfer_model_<name> gauges
        (`jaxinfer bench serve` reads them for its roofline)."""
        self.model_info = model_info or {}
        self.registry = CollectorRegistry()
        self.snapshot = EngineStats()  # replaced whole by the engine thread
        self._throughput = _RateWindow()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from a request's arrival to its first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between output tokens of a request (a delta of n tokens "
                             "counts n times, each at 1/n of the gap).",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Output tokens handed to requests.", registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens",
                                     "Prompt tokens of the requests admitted.", registry=r)
        self.requests = Counter(PREFIX + "requests",
                                "Finished requests by finish reason (stop, length, abort: the "
                                "client went away, error: the engine failed).",
                                ["finish_reason"], registry=r)
        r.register(_EngineCollector(self))

    def on_request(self, num_prompt_tokens: int):
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_delta(self, arrival: float, last: float | None, num_tokens: int, t: float):
        """A delta of num_tokens tokens at time t; last = the previous delta's time, if any."""
        if num_tokens <= 0:
            return
        if last is None:
            self.ttft.observe(t - arrival)
        else:
            for _ in range(num_tokens):
                self.itl.observe((t - last) / num_tokens)
        self.generation_tokens.inc(num_tokens)
        self._throughput.add(num_tokens, t)

    def on_finish(self, reason: str):
        self.requests.labels(finish_reason=reason).inc()

    def tokens_per_second(self) -> float:
        return self._throughput.rate(time.monotonic())

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Exposes the latest `EngineStats` (and the throughput window) at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        s = self.metrics.snapshot

        def gauge(name, doc, value):
            return GaugeMetricFamily(PREFIX + name, doc, value=value)

        def counter(name, doc, value):
            return CounterMetricFamily(PREFIX + name, doc, value=value)

        yield gauge("num_requests_waiting", "Requests queued for admission.", s.num_waiting)
        yield gauge("num_requests_running", "Requests admitted to the batch.", s.num_running)
        yield gauge("kv_pages_total", "Pages in the KV cache.", s.num_pages)
        yield gauge("kv_pages_in_use", "KV pages held by requests (cached but unreferenced "
                    "pages count as free).", s.num_pages - s.num_free_pages)
        yield gauge("kv_cache_usage_ratio", "Fraction of KV pages in use.",
                    (s.num_pages - s.num_free_pages) / s.num_pages if s.num_pages else 0.0)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_query_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.prefix_hit_tokens)
        yield gauge("prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since "
                    "start.", s.prefix_hit_tokens / s.prefix_query_tokens
                    if s.prefix_query_tokens else 0.0)
        yield counter("num_preemptions", "Requests preempted (pages released, recomputed "
                      "later).", s.num_preemptions)
        yield counter("computed_tokens", "Tokens run through the model (prefill and decode).",
                      s.num_computed_tokens)
        yield counter("step_programs_compiled", "Step programs traced and compiled (warm-up, "
                      "background and on demand).", s.num_programs_compiled)
        yield counter("step_programs_loaded", "Step programs loaded from the executable "
                      "cache.", s.num_programs_loaded)
        yield counter("step_programs_compiled_on_demand", "Step programs a batch needed before "
                      "they were made: the batch waited for the compile.",
                      s.num_compiled_on_demand)
        for name, value in self.metrics.model_info.items():
            yield gauge("model_" + name, f"The served model's {name.replace('_', ' ')}.", value)
        yield gauge("generation_tokens_per_second", "Output tokens per second over the last "
                    f"{self.metrics._throughput.window:g} s.", self.metrics.tokens_per_second())

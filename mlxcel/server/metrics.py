"""Prometheus metrics of one serving node, in their own registry (embeddable, testable)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "mlxcel_requests",
            "HTTP API requests by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter("mlxcel_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("mlxcel_generated_tokens", "tokens generated", registry=r)
        self.latency = Histogram(
            "mlxcel_request_latency_seconds",
            "end-to-end request latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "mlxcel_time_to_first_token_seconds",
            "time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "mlxcel_queue_depth", "requests waiting for a generation slot", registry=r
        )
        self.inflight = Gauge(
            "mlxcel_inflight_sequences", "sequences holding KV caches", registry=r
        )
        self.inflight_requests = Gauge(
            "mlxcel_inflight_requests", "requests generating", registry=r
        )
        self.handler_errors = Gauge("mlxcel_bus_handler_errors", "bus handler failures", registry=r)

    def bind(
        self,
        queue_depth: Callable[[], float],
        inflight: Callable[[], float],
        inflight_requests: Callable[[], float],
        handler_errors: Callable[[], float],
    ) -> None:
        self.queue_depth.set_function(queue_depth)
        self.inflight.set_function(inflight)
        self.inflight_requests.set_function(inflight_requests)
        self.handler_errors.set_function(handler_errors)

    def bind_prompt_cache(self, stats: Callable[[], dict[str, int]]) -> None:
        """Expose the engine's prompt cache (its counters live on the engine)."""
        self.registry.register(_PromptCacheCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PromptCacheCollector:
    """Read at scrape time: the engine counts on its compute thread, not through here."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield CounterMetricFamily(
            "mlxcel_prompt_cache_hits", "prompts that started from a cached prefix", s["hits"]
        )
        yield CounterMetricFamily(
            "mlxcel_prompt_cache_misses", "prompts with no cached prefix", s["misses"]
        )
        yield CounterMetricFamily(
            "mlxcel_prompt_cache_reused_tokens",
            "prompt tokens taken from the prompt cache instead of prefilled",
            s["reused_tokens"],
        )
        yield GaugeMetricFamily("mlxcel_prompt_cache_bytes", "bytes the cache holds", s["bytes"])
        yield GaugeMetricFamily(
            "mlxcel_prompt_cache_entries", "cached token sequences", s["entries"]
        )

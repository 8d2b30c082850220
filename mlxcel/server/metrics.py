"""Prometheus metrics of one serving node, in their own registry (embeddable, testable)."""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Per token: from a millisecond up to seconds (a stream waiting behind a long prompt chunk).
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10)

# A `_created` timestamp beside every counter and histogram is noise on a dashboard.
disable_created_metrics()


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
        self.tpot = Histogram(
            "mlxcel_time_per_output_token_seconds",
            "per request: time after its first token, over the tokens after it",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "mlxcel_inter_token_latency_seconds",
            "time between a stream's tokens as they reach the HTTP layer (tokens handed over "
            "together count the wait once)",
            buckets=_TOKEN_BUCKETS,
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
        self.recent_ttft: deque[float] = deque(maxlen=200)  # the cluster view's TTFT p50
        self.requests_done = 0  # generation requests answered (the cluster view's count)
        self.prompt_total = self.generated_total = 0  # the counters' values, for the view
        # Called before each scrape (the cluster view, refreshed from its nodes).
        self.refresh: Callable[[], Awaitable[Any]] | None = None

    def tokens_out(self, n: int, gap: float | None) -> None:
        """``n`` tokens of a stream reached the HTTP layer, ``gap`` seconds after its previous
        ones (None: its first): counted as they go, so the figures move while streams run."""
        self.generated_tokens.inc(n)
        self.generated_total += n
        for wait in ([] if gap is None else [gap]) + [0.0] * (n - 1):  # a burst's others: 0
            self.itl.observe(wait)

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

    def bind_cluster(self, view: Callable[[], dict[str, Any]], model: str) -> None:
        """Per-node gauges from the latest cluster view (refreshed before each scrape)."""
        self.registry.register(_ClusterCollector(view, model))

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
        if "bytes" in s:  # one process; a split model's index counts positions
            yield GaugeMetricFamily(
                "mlxcel_prompt_cache_bytes", "bytes the cache holds", s["bytes"]
            )
        if "tokens" in s:
            yield GaugeMetricFamily(
                "mlxcel_prompt_cache_tokens", "positions the cached prefixes hold", s["tokens"]
            )
        yield GaugeMetricFamily(
            "mlxcel_prompt_cache_entries", "cached token sequences", s["entries"]
        )


class _ClusterCollector:
    """One series per node of the cluster view, labelled by node id and role (never by
    address), plus the requests running and waiting per model."""

    GAUGES = (
        ("up", "mlxcel_node_up", "1 while the node answers its probes"),
        ("last_seen_s", "mlxcel_node_last_seen_seconds", "seconds since the node last answered"),
        ("in_flight", "mlxcel_node_in_flight", "requests the node is working on"),
        ("sequences", "mlxcel_node_sequences", "sequences (KV caches) the node holds"),
        ("wire_bytes_out", "mlxcel_node_wire_bytes_out", "bytes the node wrote to the cluster"),
        ("completed", "mlxcel_node_completed", "requests the node completed"),
        ("failed", "mlxcel_node_failed", "requests that failed on the node"),
        ("kv_tokens", "mlxcel_node_kv_tokens", "KV-cache positions the node holds"),
        ("kv_usage", "mlxcel_node_kv_usage_ratio", "KV-cache positions held over capacity"),
        (
            "kv_capacity",
            "mlxcel_node_kv_capacity_tokens",
            "KV-cache positions held plus those that fit in the memory MLX may still allocate",
        ),
    )
    COUNTERS = (
        ("handoffs", "mlxcel_node_handoffs", "KV handoffs a prefill node had acknowledged"),
        (
            "handoff_s",
            "mlxcel_node_handoff_seconds",
            "time of those handoffs, from send to acknowledgement (divide by the count)",
        ),
    )

    def __init__(self, view: Callable[[], dict[str, Any]], model: str) -> None:
        self._view = view
        self._model = model

    def collect(self) -> Iterator[Metric]:
        v = self._view()
        for key, name, doc in self.GAUGES:
            g = GaugeMetricFamily(name, doc, labels=["node", "role"])
            for n in v.get("nodes", []):
                value = _kv_usage(n) if key == "kv_usage" else n.get(key)
                if value is not None:
                    g.add_metric([str(n["id"]), str(n["role"])], float(value))
            yield g
        for key, name, doc in self.COUNTERS:
            c = CounterMetricFamily(name, doc, labels=["node", "role"])
            for n in v.get("nodes", []):
                if n.get(key) is not None:
                    c.add_metric([str(n["id"]), str(n["role"])], float(n[key]))
            yield c
        totals = v.get("totals", {})
        for key, name, doc in (
            ("running", "mlxcel_requests_running", "requests generating, per model"),
            ("waiting", "mlxcel_requests_waiting", "requests waiting for a slot, per model"),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model"])
            g.add_metric([self._model], float(totals.get(key, 0)))
            yield g


def _kv_usage(node: dict[str, Any]) -> float | None:
    used, capacity = node.get("kv_tokens"), node.get("kv_capacity")
    return used / capacity if used is not None and capacity else None

"""Server metrics through `prometheus_client`, the middleware that counts responses, and the
merging of several replicas' metric families (`prometheus_client` objects, never text)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from delspec.decoding.generate import Result

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """A server's metrics in a registry of their own (`generate_latest` renders it). Thread-safe."""

    def __init__(self, num_layers: int) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "delspec_requests",
            "HTTP requests by endpoint and status.",
            ("endpoint", "status"),
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "delspec_prompt_tokens", "Prompt tokens processed.", registry=registry
        )
        self.cached_tokens = Counter(
            "delspec_prompt_cached_tokens",
            "Prompt tokens whose cache entries were reused, not computed (the prompt cache).",
            registry=registry,
        )
        self.prefilled_tokens = Counter(
            "delspec_prompt_prefilled_tokens",
            "Prompt tokens computed (not taken from the prompt cache).",
            registry=registry,
        )
        self.prompt_cache_bytes = Gauge(
            "delspec_prompt_cache_bytes",
            "Bytes of evicted prompt prefixes kept (serve --prompt-cache-mb).",
            registry=registry,
        )
        self.generated_tokens = Counter(
            "delspec_generated_tokens", "Tokens generated.", registry=registry
        )
        self.drafted = Counter("delspec_draft_tokens", "Draft tokens proposed.", registry=registry)
        self.accepted = Counter(
            "delspec_accepted_draft_tokens", "Draft tokens accepted.", registry=registry
        )
        self._pool_metrics(registry)
        self.tokens_per_s = Gauge(
            "delspec_tokens_per_second",
            "Decoding speed of the last generation.",
            registry=registry,
        )
        self.acceptance_rate = Gauge(
            "delspec_acceptance_rate",
            "Draft acceptance rate of the last generation that drafted.",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "delspec_queue_depth", "Requests waiting for a slot.", registry=registry
        )
        self.active = Gauge("delspec_active", "Generations running now.", registry=registry)
        self.busy = Gauge("delspec_busy", "1 while a generation runs.", registry=registry)
        self.exit_layer = Histogram(
            "delspec_exit_layer",
            "Exit layer of each drafting round.",
            buckets=range(1, num_layers + 1),
            registry=registry,
        )
        self.batch_size = Histogram(
            "delspec_batch_size",
            "Generations in each step.",
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=registry,
        )
        self.queue_wait = Histogram(
            "delspec_queue_wait_seconds",
            "Time a request waited for a slot.",
            buckets=_SECONDS,
            registry=registry,
        )
        self.first_token = Histogram(
            "delspec_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            buckets=_SECONDS,
            registry=registry,
        )

    def _pool_metrics(self, registry: CollectorRegistry) -> None:
        """The draft pool's metrics (`DraftPool`: context drafts from earlier replies)."""
        self.pool_drafted = Counter(
            "delspec_pool_draft_tokens",
            "Draft tokens proposed from the draft pool of earlier replies (serve "
            "--draft-pool-tokens; counted in delspec_draft_tokens too).",
            registry=registry,
        )
        self.pool_accepted = Counter(
            "delspec_pool_accepted_draft_tokens",
            "Draft tokens from the draft pool that were accepted.",
            registry=registry,
        )
        self.pool_tokens = Gauge(
            "delspec_draft_pool_tokens",
            "Tokens of earlier replies the draft pool holds (serve --draft-pool-tokens).",
            registry=registry,
        )

    def count_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def observe_batch(self, size: int) -> None:
        self.batch_size.observe(size)

    def observe_wait(self, seconds: float) -> None:
        self.queue_wait.observe(seconds)

    def observe_first_token(self, seconds: float) -> None:
        self.first_token.observe(seconds)

    def observe(self, result: Result) -> None:
        """Records a finished generation (which must have been traced)."""
        stats = result.stats
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.prefilled_tokens.inc(stats.prompt_tokens - stats.cached_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.pool_drafted.inc(stats.pool_drafted)
        self.pool_accepted.inc(stats.pool_accepted)
        self.tokens_per_s.set(stats.tokens_per_s)
        if stats.acceptance_rate is not None:
            self.acceptance_rate.set(stats.acceptance_rate)
        for entry in result.trace or ():
            if entry["drafted"]:
                self.exit_layer.observe(entry["exit_layer"])

    def current(
        self, queue_depth: int, active: int, cache_bytes: int = 0, pool_tokens: int = 0
    ) -> CollectorRegistry:
        """The registry, its gauges of the queue, the prompt cache and the draft pool set to
        the state given."""
        self.prompt_cache_bytes.set(cache_bytes)
        self.pool_tokens.set(pool_tokens)
        self.queue_depth.set(queue_depth)
        self.active.set(active)
        self.busy.set(int(active > 0))
        return self.registry


class RequestCounter:
    """ASGI middleware counting HTTP responses by endpoint and status (499: client went away);
    paths other than `endpoints` count as "other"."""

    def __init__(self, app: Any, metrics: Metrics, endpoints: tuple[str, ...]) -> None:
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def record(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record)
        finally:
            endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
            self.metrics.count_request(endpoint, status)


# gauges of a single generation or a yes/no state: a mean or a maximum over replicas, not a sum
_MERGED_BY: dict[str, Callable[[list[float]], float]] = {
    "delspec_tokens_per_second": statistics.fmean,
    "delspec_acceptance_rate": statistics.fmean,
    "delspec_busy": max,
}

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]  # a sample's name and sorted labels


class MergedMetrics(Collector):
    """Several replicas' metric families (each replica's `registry.collect()`) as one: every
    sample (counters, histogram buckets, queue depth, active) summed over the replicas that have
    it, except the last generation's speed and acceptance (mean), `busy` (max) and the
    `_created` timestamps (the earliest); `delspec_replicas` says how many replicas were merged."""

    def __init__(self, replicas: list[list[Metric]]) -> None:
        self.replicas = replicas

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "delspec_replicas", "Server replicas these metrics cover.", value=len(self.replicas)
        )
        # family name -> (its first replica's family, sample name and labels -> values)
        merged: dict[str, tuple[Metric, dict[_SampleKey, list[float]]]] = {}
        for families in self.replicas:
            for family in families:
                _, values = merged.setdefault(family.name, (family, {}))
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    values.setdefault(key, []).append(sample.value)
        for first, values in merged.values():
            family = Metric(first.name, first.documentation, first.type, first.unit)
            for (name, labels), each in values.items():
                total = _MERGED_BY.get(name, min if name.endswith("_created") else sum)
                family.add_sample(name, dict(labels), total(each))
            yield family

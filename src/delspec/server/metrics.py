"""Server metrics through `prometheus_client`, the middleware that counts responses, and the
merging of several replicas' metrics."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from delspec.generate import Result

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """A server's metrics in a registry of their own, rendered in the Prometheus text format
    (version 0.0.4). Thread-safe."""

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
        self.generated_tokens = Counter(
            "delspec_generated_tokens", "Tokens generated.", registry=registry
        )
        self.drafted = Counter("delspec_draft_tokens", "Draft tokens proposed.", registry=registry)
        self.accepted = Counter(
            "delspec_accepted_draft_tokens", "Draft tokens accepted.", registry=registry
        )
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
        self.generated_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.tokens_per_s.set(stats.tokens_per_s)
        if stats.drafted:
            self.acceptance_rate.set(stats.acceptance_rate)
        for entry in result.trace or ():
            if entry["drafted"]:
                self.exit_layer.observe(entry["exit_layer"])

    def render(self, queue_depth: int, active: int) -> str:
        """The Prometheus text of every metric, with the queue's state as given."""
        self.queue_depth.set(queue_depth)
        self.active.set(active)
        self.busy.set(int(active > 0))
        return generate_latest(self.registry).decode()


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


def merge_metrics(texts: list[str]) -> str:
    """The Prometheus texts of several replicas as one: every sample (counters, histogram
    buckets, queue depth, active) summed over replicas, except the last generation's speed and
    acceptance (mean), `busy` (max) and the `_created` timestamps (the earliest);
    `delspec_replicas` says how many were merged. Works on the text (prometheus_client's
    multiprocess mode shares files between the processes of one machine, not replicas)."""
    families: dict[str, list[str]] = {}  # metric name -> its comment lines and sample keys
    values: dict[str, list[float]] = {}
    for text in [f"delspec_replicas {len(texts)}", *texts]:
        for line in filter(None, text.splitlines()):
            if line.startswith("#"):
                family = families.setdefault(line.split()[2], [])
                if line not in family:
                    family.append(line)
                continue
            key, value = line.rsplit(" ", 1)
            if key not in values:
                values[key] = []
                families.setdefault(_family(key, families), []).append(key)
            values[key].append(float(value))
    merged = [
        "# HELP delspec_replicas Server replicas these metrics cover.",
        "# TYPE delspec_replicas gauge",
    ]
    for line in (line for family in families.values() for line in family):
        if line in values:
            name = line.split("{")[0]
            total = _MERGED_BY.get(name, min if name.endswith("_created") else sum)(values[line])
            line = f"{line} {int(total) if total.is_integer() else total}"
        merged.append(line)
    return "\n".join(merged) + "\n"


def _family(key: str, families: dict[str, list[str]]) -> str:
    """The metric a sample belongs to: its name, less a histogram's _bucket/_sum/_count."""
    name = key.split("{")[0]
    base = name.rsplit("_", 1)[0]
    return base if base in families and name.endswith(("_bucket", "_sum", "_count")) else name

"""Server counters in the Prometheus text format, and the middleware that counts responses."""

from __future__ import annotations

import statistics
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from delspec.generate import Result


class Histogram:
    """A Prometheus histogram: counts of observations at or below each bound, sum, count."""

    def __init__(self, name: str, help_text: str, bounds: tuple[float, ...]) -> None:
        self.name, self.help_text, self.bounds = name, help_text, bounds
        self.counts = [0] * len(bounds)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out = _metric(self.name, "histogram", self.help_text)
        pairs = zip(self.bounds, self.counts, strict=True)
        out += [f'{self.name}_bucket{{le="{b:g}"}} {n}' for b, n in pairs]
        return [
            *out,
            f'{self.name}_bucket{{le="+Inf"}} {self.count}',
            f"{self.name}_sum {self.sum:g}",
            f"{self.name}_count {self.count}",
        ]


_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Server counters, rendered in the Prometheus text exposition format (version 0.0.4)."""

    def __init__(self, num_layers: int) -> None:
        self._lock = threading.Lock()
        self.batch_size = Histogram(
            "delspec_batch_size", "Generations in each step.", (1, 2, 4, 8, 16, 32, 64)
        )
        self.queue_wait = Histogram(
            "delspec_queue_wait_seconds", "Time a request waited for a slot.", _SECONDS
        )
        self.first_token = Histogram(
            "delspec_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            _SECONDS,
        )
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = self.generated_tokens = self.drafted = self.accepted = 0
        self.last_tokens_per_s = self.last_acceptance_rate = 0.0
        self.exit_layer = Histogram(
            "delspec_exit_layer",
            "Exit layer of each drafting round.",
            tuple(range(1, num_layers + 1)),
        )

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] += 1

    def observe_batch(self, size: int) -> None:
        with self._lock:
            self.batch_size.observe(size)

    def observe_wait(self, seconds: float) -> None:
        with self._lock:
            self.queue_wait.observe(seconds)

    def observe_first_token(self, seconds: float) -> None:
        with self._lock:
            self.first_token.observe(seconds)

    def observe(self, result: Result) -> None:
        """Records a finished generation (which must have been traced)."""
        stats = result.stats
        with self._lock:
            self.prompt_tokens += stats.prompt_tokens
            self.generated_tokens += stats.new_tokens
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            self.last_tokens_per_s = stats.tokens_per_s
            if stats.drafted:
                self.last_acceptance_rate = stats.acceptance_rate
            for entry in result.trace or ():
                if entry["drafted"]:
                    self.exit_layer.observe(entry["exit_layer"])

    def render(self, queue_depth: int, active: int) -> str:
        with self._lock:
            lines = _metric(
                "delspec_requests_total", "counter", "HTTP requests by endpoint and status."
            )
            lines += [
                f'delspec_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                for (e, s), n in sorted(self.requests.items())
            ]
            for name, kind, help_text, value in [
                ("prompt_tokens_total", "counter", "Prompt tokens processed.", self.prompt_tokens),
                ("generated_tokens_total", "counter", "Tokens generated.", self.generated_tokens),
                ("draft_tokens_total", "counter", "Draft tokens proposed.", self.drafted),
                ("accepted_draft_tokens_total", "counter", "Draft tokens accepted.", self.accepted),
                (
                    "tokens_per_second",
                    "gauge",
                    "Decoding speed of the last generation.",
                    self.last_tokens_per_s,
                ),
                (
                    "acceptance_rate",
                    "gauge",
                    "Draft acceptance rate of the last generation that drafted.",
                    self.last_acceptance_rate,
                ),
                ("queue_depth", "gauge", "Requests waiting for a slot.", queue_depth),
                ("active", "gauge", "Generations running now.", active),
                ("busy", "gauge", "1 while a generation runs.", int(active > 0)),
            ]:
                lines += [*_metric(f"delspec_{name}", kind, help_text), f"delspec_{name} {value}"]
            for histogram in (self.exit_layer, self.batch_size, self.queue_wait, self.first_token):
                lines += histogram.lines()
        return "\n".join(lines) + "\n"


def _metric(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


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
    acceptance (mean) and `busy` (max); `delspec_replicas` says how many were merged."""
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
    merged = _metric("delspec_replicas", "gauge", "Server replicas these metrics cover.")
    for line in (line for family in families.values() for line in family):
        if line in values:
            total = _MERGED_BY.get(line.split("{")[0], sum)(values[line])
            line = f"{line} {int(total) if total.is_integer() else total}"
        merged.append(line)
    return "\n".join(merged) + "\n"


def _family(key: str, families: dict[str, list[str]]) -> str:
    """The metric a sample belongs to: its name, less a histogram's _bucket/_sum/_count."""
    name = key.split("{")[0]
    base = name.rsplit("_", 1)[0]
    return base if base in families and name.endswith(("_bucket", "_sum", "_count")) else name

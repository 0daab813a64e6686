"""Server counters in the Prometheus text format, and the middleware that counts responses."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from delspec.generate import Result


class Metrics:
    """Server counters, rendered in the Prometheus text exposition format (version 0.0.4)."""

    def __init__(self, num_layers: int) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = self.generated_tokens = self.drafted = self.accepted = 0
        self.last_tokens_per_s = self.last_acceptance_rate = 0.0
        self.exit_layers = [0] * (num_layers + 1)  # drafting rounds per exit layer
        self.exit_layer_sum = 0

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[endpoint, status] += 1

    def observe(self, result: Result) -> None:
        """Records a finished generation (which must have been traced)."""
        stats = result.stats
        with self._lock:
            self.prompt_tokens += stats.prompt_tokens
            self.generated_tokens += stats.new_tokens
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            self.last_tokens_per_s = stats.tokens_per_s
            self.last_acceptance_rate = stats.acceptance_rate
            for entry in result.trace or ():
                if entry["drafted"]:
                    self.exit_layers[entry["exit_layer"]] += 1
                    self.exit_layer_sum += entry["exit_layer"]

    def render(self, queue_depth: int, busy: bool) -> str:
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
                    "Draft acceptance rate of the last generation.",
                    self.last_acceptance_rate,
                ),
                ("queue_depth", "gauge", "Requests waiting for the model.", queue_depth),
                ("busy", "gauge", "1 while a generation runs.", int(busy)),
            ]:
                lines += [*_metric(f"delspec_{name}", kind, help_text), f"delspec_{name} {value}"]
            lines += _metric(
                "delspec_exit_layer", "histogram", "Exit layer of each drafting round."
            )
            total = 0
            for layer, count in enumerate(self.exit_layers[1:], start=1):
                total += count
                lines.append(f'delspec_exit_layer_bucket{{le="{layer}"}} {total}')
            lines += [
                f'delspec_exit_layer_bucket{{le="+Inf"}} {total}',
                f"delspec_exit_layer_sum {self.exit_layer_sum}",
                f"delspec_exit_layer_count {total}",
            ]
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

"""Scale-out: N copies of the server behind one OpenAI API through Ray Serve (`delspec[ray]`).

Each replica is a Ray actor process holding its own model, thread budget and batching worker
(the app of `create_app`); Ray's HTTP proxy spreads requests over them. `/metrics` on any
replica answers for all of them (`MergedMetrics`). On one machine Ray starts a local cluster;
`ray_address` joins a running one (`ray start --head` on one node, `ray start --address
HEAD:6379` on the others, delspec installed on every node).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import Metric

from delspec.errors import ConfigError
from delspec.machine.batching import BATCH_SIZES
from delspec.server.app import DEFAULT_MAX_QUEUE, create_app
from delspec.server.metrics import MergedMetrics
from delspec.weights.loading import load_model

INSTALL_HINT = "serving replicas needs Ray Serve: pip install 'delspec[ray]'"
APP_NAME = "delspec"


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica loads (`load_model`'s arguments) and serves with (`create_app`'s)."""

    model: str
    device: str = "cpu"
    dtype: str | None = None
    weights: str | None = None
    threads: int = 1
    app_options: dict[str, Any] = field(default_factory=dict)
    huge_pages: bool = False


class Replica:
    """One server process: its model, threads and app; Ray Serve routes HTTP to the app."""

    def __init__(self, spec: ReplicaSpec) -> None:
        lm = load_model(
            spec.model,
            device=spec.device,
            dtype=spec.dtype,
            weights=spec.weights,
            huge_pages=spec.huge_pages,
            threads=spec.threads,
        )
        options = {"aliases": (lm.name, spec.model), **spec.app_options}
        self.server = create_app(lm, **options)
        self.server.state.gather_metrics = self.all_metrics

    def __serve_build_asgi_app__(self) -> Any:
        return self.server

    def local_metrics(self) -> list[Metric]:
        """This replica's metric families."""
        return list(self.server.state.local_metrics().collect())

    async def all_metrics(self) -> MergedMetrics:
        """The metrics of every replica that answers (one that fails, e.g. dying, is left out)."""
        from ray import serve

        context = serve.get_replica_context()
        handle = serve.get_deployment_handle(context.deployment, context.app_name)
        parts = await handle.broadcast("local_metrics").results_async(return_exceptions=True)
        return MergedMetrics([part for part in parts if not isinstance(part, BaseException)])


def _ray() -> tuple[Any, Any]:
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return ray, serve


@contextmanager
def replicas_serving(
    spec: ReplicaSpec,
    replicas: int,
    host: str = "127.0.0.1",
    port: int | None = None,
    ray_address: str | None = None,
) -> Iterator[str]:
    """Runs `replicas` copies of the server on Ray Serve at `host`:`port` (default: a free
    port) and yields its base URL. On exit, stops the Ray it started, or on a Ray that was
    running already (`ray_address`, or `ray.init` done by the caller) deletes its application."""
    if replicas < 1:
        raise ConfigError(f"replicas must be >= 1, got {replicas}")
    ray, serve = _ray()
    port = port or _free_port(host)
    started_ray = not ray.is_initialized()
    if started_ray:
        _check_reachable(ray_address)
        try:
            ray.init(address=ray_address, include_dashboard=False, log_to_driver=False)
        except (ConnectionError, ValueError, RuntimeError) as exc:
            where = f"join the Ray cluster at {ray_address}" if ray_address else "start Ray"
            raise ConfigError(f"could not {where}: {exc}") from None
    try:
        serve.start(http_options={"host": host, "port": port})
        # Ray holds back no request: each replica's own queue bounds them (429 beyond it)
        options = spec.app_options
        admitted = options.get("max_queue", DEFAULT_MAX_QUEUE) + (
            options.get("max_batch") or BATCH_SIZES[-1]
        )
        deployment = serve.deployment(
            name="Replica",
            num_replicas=replicas,
            ray_actor_options={"num_cpus": spec.threads},
            max_ongoing_requests=admitted,
        )(serve.ingress()(Replica))
        try:
            serve.run(deployment.bind(spec), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:
            raise ConfigError(
                f"the replicas did not start ({exc}); their logs: "
                "/tmp/ray/session_latest/logs/serve/"
            ) from None
        yield f"http://{host}:{port}"
    finally:
        if started_ray:
            serve.shutdown()
            ray.shutdown()
        else:  # a cluster others may use: only this application goes
            serve.delete(APP_NAME)


def serve_replicas(spec: ReplicaSpec, replicas: int, **where: Any) -> None:
    """Serve `replicas` copies until interrupted; `where`: `replicas_serving`'s host, port,
    ray_address."""
    with replicas_serving(spec, replicas, **where) as url:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stops as Ctrl-C does: Ray too
        print(f"delspec: {replicas} replicas serving at {url} (Ctrl-C stops)", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


def default_threads(replicas: int) -> int:
    """Threads per replica when not given: this machine's cores shared out."""
    return max(1, (os.cpu_count() or 1) // replicas)


def _check_reachable(ray_address: str | None) -> None:
    """`ConfigError` at once if `ray_address` is HOST:PORT and nothing listens there (Ray itself
    would retry for minutes)."""
    host, _, port = (ray_address or "").removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # None (a local Ray), "auto", or a form Ray resolves itself
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as exc:
        raise ConfigError(f"no Ray cluster answers at {ray_address}: {exc}") from None


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]

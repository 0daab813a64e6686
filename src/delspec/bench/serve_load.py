"""`delspec bench-serve`: concurrent streaming clients against the OpenAI server.

For each server setup (a strategy and a batch size, e.g. `ar@1` or `del-fast`: the measured
batch size) and each number of clients C, C clients each send their share of task prompts one
after another as streaming chat completions. Reported per (setup, C): aggregate generated
tokens per second over the run's wall time, time to first token and time per output token after
it (p50, p95), errors. Each setup's server is started as its own process (`delspec serve` on
a free loopback port), as a user would run it, on the same machine as the clients; or the
server at `--url` is measured as it is.
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from delspec.bench.serve_clients import Streamed, chat_body, stream_chat
from delspec.bench.tasks import TASKS, load_task
from delspec.decode_config import DecodeConfig
from delspec.errors import ConfigError
from delspec.kernels.build import cpu_name

TIMEOUT = 600.0


@dataclass(frozen=True)
class Setup:
    """A server configuration: its strategy and batch size (None: measured at start)."""

    strategy: str
    max_batch: int | None

    @property
    def label(self) -> str:
        return self.strategy + ("" if self.max_batch is None else f"@{self.max_batch}")


def parse_setups(text: str) -> list[Setup]:
    """Setups from `STRATEGY[@BATCH],...`, e.g. `ar@1,ar,del-fast@1,del-fast`."""
    setups = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        strategy, _, batch = item.partition("@")
        try:
            size = int(batch) if batch else None
        except ValueError:
            raise ConfigError(
                f"bad server setup {item!r}: the batch size is not a number"
            ) from None
        DecodeConfig(strategy=strategy)  # an unknown strategy is refused here
        setups.append(Setup(strategy, size))
    if not setups:
        raise ConfigError("no server setups given")
    return setups


@dataclass
class Outcome:
    """One request as its client saw it."""

    tokens: int = 0
    first_token_s: float | None = None  # from sending to the first content
    per_token_s: float | None = None  # after the first content, per further token
    error: str | None = None


@dataclass
class Run:
    """One (setup, clients) measurement."""

    setup: str
    clients: int
    requests: int
    errors: int
    wall_s: float
    tokens_per_s: float
    first_token_p50_s: float
    first_token_p95_s: float
    per_token_p50_ms: float
    per_token_p95_ms: float
    outcomes: list[dict[str, Any]] = field(default_factory=list, repr=False)


def _outcome(streamed: Streamed) -> Outcome:
    """What `measure` keeps of one streamed request: tokens and timings, or its error."""
    outcome = Outcome(tokens=streamed.tokens, error=streamed.error)
    if streamed.times:
        outcome.first_token_s = streamed.first_token_s
        if streamed.tokens > 1:
            span = streamed.times[-1] - streamed.times[0]
            outcome.per_token_s = span / (streamed.tokens - 1)
    return outcome


async def _clients(url: str, bodies: list[list[dict[str, Any]]]) -> list[Outcome]:
    """Each client sends its bodies one after another; all clients at once."""
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as http:

        async def client(own: list[dict[str, Any]]) -> list[Outcome]:
            return [_outcome(await stream_chat(http, url, body)) for body in own]

        results = await asyncio.gather(*(client(own) for own in bodies))
    return [outcome for own in results for outcome in own]


def measure(
    url: str, setup: str, clients: int, prompts: list[str], per_client: int, max_tokens: int
) -> Run:
    """`clients` clients with `per_client` prompts each (cycling through `prompts`)."""
    turns = range(per_client)
    bodies = [
        [chat_body(prompts[(c * per_client + i) % len(prompts)], max_tokens) for i in turns]
        for c in range(clients)
    ]
    start = time.perf_counter()
    outcomes = asyncio.run(_clients(url, bodies))
    wall = time.perf_counter() - start
    good = [o for o in outcomes if o.error is None]
    first = [o.first_token_s for o in good if o.first_token_s is not None]
    per_token = [o.per_token_s for o in good if o.per_token_s is not None]
    return Run(
        setup,
        clients,
        len(outcomes),
        len(outcomes) - len(good),
        wall,
        sum(o.tokens for o in good) / wall,
        quantile(first, 0.5),
        quantile(first, 0.95),
        quantile(per_token, 0.5) * 1e3,
        quantile(per_token, 0.95) * 1e3,
        [asdict(o) for o in outcomes],
    )


def quantile(values: list[float], q: float) -> float:
    """The `q` quantile of `values` (inclusive percentiles; nan for none)."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def task_prompts(count: int, seed: int = 42) -> list[str]:
    """`count` prompts spread over the benchmark tasks."""
    per_task = -(-count // len(TASKS))
    pools = [load_task(name, per_task, seed) for name in TASKS]
    mixed = [pool[i].text for i in range(per_task) for pool in pools if i < len(pool)]
    return mixed[:count]


def run_bench_serve(
    serve_args: list[str],
    setups: list[Setup],
    clients: list[int],
    *,
    per_client: int = 2,
    max_tokens: int = 64,
    url: str | None = None,
    out: Path | None = None,
    prompts: list[str] | None = None,
) -> list[Run]:
    """Measure every setup at every client count, each setup's server started with
    `delspec serve` and `serve_args` (model, weights, threads); writes results.json,
    summary.json, table.md and a plot to `out` when given. With `url`, the server there is
    measured as it is (one setup: its own). `prompts` default to the benchmark tasks'."""
    prompts = prompts or task_prompts(max(clients) * per_client)
    runs: list[Run] = []
    model = None
    for setup in setups if url is None else [Setup("as served", None)]:
        with _server(serve_args, setup, max(clients)) if url is None else nullcontext(url) as at:
            model = httpx.get(at + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
            batch = httpx.get(at + "/health", timeout=TIMEOUT).json().get("max_batch")
            label = setup.label if setup.max_batch is not None else f"{setup.label} ({batch})"
            if url is None:
                measure(at, label, 1, prompts, 1, 8)  # warm-up: profiles, first calls
            for count in clients:
                run = measure(at, label, count, prompts, per_client, max_tokens)
                print(
                    f"{label:18s} C={count:<3d} {run.tokens_per_s:8.1f} tok/s  "
                    f"TTFT p95 {run.first_token_p95_s:6.2f} s  errors {run.errors}",
                    flush=True,
                )
                runs.append(run)
    if out is not None:
        _write(runs, model, max_tokens, per_client, out)
    return runs


@contextmanager
def _server(serve_args: list[str], setup: Setup, max_queue: int) -> Iterator[str]:
    """`delspec serve` for `setup` in a process of its own on a free loopback port."""
    options = ["--strategy", setup.strategy, "--max-queue", str(max_queue)]
    if setup.max_batch is not None:
        options += ["--max-batch", str(setup.max_batch)]
    with serve_process([*serve_args, *options], setup.label) as (url, _):
        yield url


@contextmanager
def serve_process(serve_args: list[str], label: str = "the server") -> Iterator[tuple[str, int]]:
    """`delspec serve` with `serve_args` in a process of its own on a free loopback port, until
    it answers /health; yields its URL and process id, and stops it after."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "delspec.cli", "serve", *serve_args, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            _wait_for(url, process, log, label)
            yield url, process.pid
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_for(url: str, process: subprocess.Popen, log: Any, label: str) -> None:
    """Until the server answers /health; `ConfigError` (with its last words) if it exits or
    takes too long."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        if process.poll() is not None:
            log.seek(0)
            said = log.read().decode(errors="replace")[-500:]
            raise ConfigError(f"the server for {label} exited: {said}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ConfigError(f"the server for {label} did not start")
        time.sleep(0.2)


def describe(url: str, serve_args: list[str] | None) -> dict[str, Any]:
    """Where a measurement of the server at `url` ran: its model (as it names it), the CPU,
    the date, and the server's options (None: a server the bench did not start)."""
    model = httpx.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
    return {
        "model": model,
        "cpu": cpu_name(),
        "date": time.strftime("%Y-%m-%d"),
        "serve_args": None if serve_args is None else " ".join(serve_args),
    }


def _write(runs: list[Run], model: str | None, max_tokens: int, per_client: int, out: Path) -> None:
    import torch

    from delspec.bench.plots import serve_plot

    out.mkdir(parents=True, exist_ok=True)
    environment = {
        "model": model,
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "max_tokens": max_tokens,
        "requests_per_client": per_client,
    }
    (out / "results.json").write_text(
        json.dumps({"environment": environment, "runs": [asdict(r) for r in runs]}, indent=1)
    )
    summary = [{k: v for k, v in asdict(r).items() if k != "outcomes"} for r in runs]
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"# delspec bench-serve: {environment['model']}",
        "",
        f"{environment['date']} · {environment['cpu']} · {environment['threads']} thread(s) · "
        f"torch {environment['torch']} · {per_client} streaming chat requests per client, "
        f"at most {max_tokens} new tokens, greedy; server and clients on one machine.",
        "",
        "| setup | clients | tok/s | TTFT p50 (s) | TTFT p95 (s) | per token p50 (ms) "
        "| per token p95 (ms) | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.setup} | {r.clients} | {r.tokens_per_s:.1f} | {r.first_token_p50_s:.2f} | "
        f"{r.first_token_p95_s:.2f} | {r.per_token_p50_ms:.1f} | {r.per_token_p95_ms:.1f} | "
        f"{r.errors} |"
        for r in runs
    ]
    lines += [
        "",
        "setup: strategy@batch size (no @: the batch size the server measured at start, in "
        "brackets). "
        "tok/s: generated tokens of all requests over the wall time; TTFT: from sending a "
        "request to its first text; per token: after that, per further token.",
    ]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    serve_plot(summary, out / "throughput.png")

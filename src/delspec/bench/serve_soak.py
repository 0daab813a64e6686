"""`delspec bench-serve --soak SECONDS`: a bounded soak of the server on loopback.

First every prompt's solo answer is asked for (one request at a time, greedy). Then for SECONDS,
all at once: `clients` clients stream chat answers to task prompts, one request after another;
one client sends long prompts (about `long_tokens` tokens); one starts streams and vanishes
after a few pieces of text; one sends hostile requests (`HOSTILE`: bodies past the server's
body limit, malformed JSON, invalid sampling parameters), each expecting a 4xx. Every second
the server's queue depth (/metrics) and resident memory (/proc/PID/status, when its process id
is known) are sampled.

Reported: requests by kind, 5xx answers, hostile requests answered otherwise than expected,
answers that differ from their solo answers, queue depth and RSS over time, and the RSS growth
after warm-up: the peak RSS of the last fifth of the soak over the peak of its first fifth.
Bounded: no request starts after the deadline, each has its own timeout, and the soak sends at
most `MAX_REQUESTS` requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from delspec.bench.serve_clients import (
    chat_body,
    long_prompt,
    queue_depth,
    rss_mib,
    stream_chat,
)
from delspec.bench.serve_load import describe, serve_process, task_prompts

DEFAULT_MAX_BODY_MB = 4.0  # the server's unless --max-body-mb says (server.app)
MAX_REQUESTS = 100_000
REQUEST_TIMEOUT = 120.0  # seconds, for any one request of the soak
SAMPLE_S = 1.0
MAX_EXAMPLES = 5  # unexpected answers kept in the report, of each kind
CHAT = "/v1/chat/completions"


def _oversized(limit_mb: float) -> tuple[str, bytes]:
    """A chat body half a MiB past the limit (sent with its length)."""
    filler = "x" * int((limit_mb + 0.5) * 2**20)
    return "oversized body", json.dumps(chat_body(filler, 4)).encode()


def _oversized_chunked(limit_mb: float) -> tuple[str, Callable[[], AsyncIterator[bytes]]]:
    """A body past the limit sent in chunks, without a Content-Length."""
    chunk = b"x" * 2**16
    count = int((limit_mb + 0.5) * 2**20) // len(chunk)

    async def body() -> AsyncIterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(count):
            yield chunk
        yield b'"}]}'

    return "oversized chunked body", body


# (what, body): bodies a server must refuse with a 4xx
HOSTILE: list[tuple[str, Any]] = [
    ("malformed JSON", b'{"messages": [{"role": "user", "content": "Hi"'),
    ("not UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    ("no messages", {"max_tokens": 4}),
    ("negative temperature", {**chat_body("Hi", 4), "temperature": -1}),
    ("top_p above 1", {**chat_body("Hi", 4), "top_p": 1.5}),
    ("max_tokens 0", {**chat_body("Hi", 4), "max_tokens": 0}),
    ("max_tokens past the context", {**chat_body("Hi", 4), "max_tokens": 10**9}),
    ("n=2", {**chat_body("Hi", 4), "n": 2}),
    ("unknown strategy", {**chat_body("Hi", 4), "delspec": {"strategy": "warp"}}),
]


@dataclass
class Sample:
    """The server at one moment of the soak."""

    t_s: float  # since the soak began
    queue_depth: float | None
    rss_mib: float | None


@dataclass
class Soak:
    """What a soak found (see the module docstring)."""

    seconds: float
    wall_s: float
    requests: dict[str, int]
    server_errors: int  # 5xx answers (and 5xx error events in streams)
    unexpected: int  # hostile requests not answered with a 4xx, or normal ones failing
    wrong_answers: int  # answers that differ from their solo answers
    vanished: int
    queue_depth_max: float | None
    rss_warm_mib: float | None  # peak over the first fifth
    rss_end_mib: float | None  # peak over the last fifth
    rss_growth_pct: float | None
    examples: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)


class _Tally:
    """What the soak's clients saw, as they see it."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.kinds: Counter[str] = Counter()
        self.server_errors = self.unexpected = self.wrong = self.vanished = 0
        self.examples: list[str] = []

    def more(self, kind: str) -> bool:
        """Whether a client may send one more request of `kind` (and counts it)."""
        if time.monotonic() >= self.deadline or self.kinds.total() >= MAX_REQUESTS:
            return False
        self.kinds[kind] += 1
        return True

    def note(self, what: str) -> None:
        if len(self.examples) < 4 * MAX_EXAMPLES:
            self.examples.append(what)


async def _answers(
    http: httpx.AsyncClient,
    url: str,
    tally: _Tally,
    kind: str,
    prompts: list[str],
    solo: dict[str, str],
    max_tokens: int,
) -> None:
    """Streams answers to `prompts` in turn until the deadline; each compared with its solo."""
    i = 0
    while tally.more(kind):
        prompt = prompts[i % len(prompts)]
        i += 1
        got = await stream_chat(http, url, chat_body(prompt, max_tokens))
        tally.server_errors += got.server_error
        if got.error is not None:
            tally.unexpected += 1
            tally.note(f"{kind}: {got.error}")
        elif got.text != solo[prompt]:
            tally.wrong += 1
            tally.note(f"{kind}: {got.text[:60]!r} instead of {solo[prompt][:60]!r}")


async def _vanishing(http: httpx.AsyncClient, url: str, tally: _Tally, prompts: list[str]) -> None:
    """Starts streams and leaves each after 1..4 pieces of text."""
    i = 0
    while tally.more("vanishing"):
        got = await stream_chat(http, url, chat_body(prompts[i % len(prompts)], 64), 1 + i % 4)
        i += 1
        tally.server_errors += got.server_error
        tally.vanished += 1


async def _hostile(http: httpx.AsyncClient, url: str, tally: _Tally, limit_mb: float) -> None:
    """Sends `HOSTILE` bodies and oversized ones in turn; each must get a 4xx."""
    bodies = [*HOSTILE, _oversized(limit_mb), _oversized_chunked(limit_mb)]
    headers = {"content-type": "application/json"}
    i = 0
    while tally.more("hostile"):
        what, body = bodies[i % len(bodies)]
        i += 1
        try:
            if isinstance(body, dict):
                response = await http.post(url + CHAT, json=body)
            else:
                content = body() if callable(body) else body
                response = await http.post(url + CHAT, content=content, headers=headers)
            status = response.status_code
        except httpx.HTTPError as exc:  # a refused chunked body may end the connection
            tally.note(f"hostile {what}: {type(exc).__name__}")
            continue
        if status >= 500:
            tally.server_errors += 1
        if not 400 <= status < 500:
            tally.unexpected += 1
            tally.note(f"hostile {what}: HTTP {status}")
        await asyncio.sleep(0.05)


async def _sampler(
    http: httpx.AsyncClient, url: str, pid: int | None, start: float, deadline: float
) -> list[Sample]:
    samples = []
    while time.monotonic() < deadline:
        try:
            depth = queue_depth((await http.get(url + "/metrics")).text)
        except httpx.HTTPError:
            depth = None
        rss = None if pid is None else rss_mib(pid)
        samples.append(Sample(round(time.monotonic() - start, 3), depth, rss))
        await asyncio.sleep(SAMPLE_S)
    return samples


async def soak(
    url: str,
    seconds: float,
    *,
    pid: int | None = None,
    clients: int = 3,
    max_tokens: int = 32,
    long_tokens: int = 1500,
    max_body_mb: float = 4.0,
    prompts: list[str] | None = None,
) -> Soak:
    """Soak the server at `url` (process `pid`, for its RSS) for `seconds`; see the module
    docstring. `max_body_mb`: the server's body limit (oversized bodies pass it). `prompts`
    (default: the benchmark tasks'): the normal clients'."""
    prompts = prompts or task_prompts(2 * clients)
    longs = [long_prompt(long_tokens, seed) for seed in (7, 8)]
    limits = httpx.Limits(max_connections=clients + 8)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as http:
        solo = {}
        for prompt in prompts + longs:
            got = await stream_chat(http, url, chat_body(prompt, max_tokens))
            if got.error is not None:
                raise RuntimeError(f"a solo request failed before the soak: {got.error}")
            solo[prompt] = got.text
        start = time.monotonic()
        tally = _Tally(start + seconds)
        tasks = [
            *(
                _answers(http, url, tally, "normal", prompts[c::clients], solo, max_tokens)
                for c in range(clients)
            ),
            _answers(http, url, tally, "long prompt", longs, solo, max_tokens),
            _vanishing(http, url, tally, prompts),
            _hostile(http, url, tally, max_body_mb),
        ]
        sampling = asyncio.create_task(_sampler(http, url, pid, start, tally.deadline))
        await asyncio.gather(*tasks)
        samples = await sampling
    wall = time.monotonic() - start
    rss = [(s.t_s, s.rss_mib) for s in samples if s.rss_mib is not None]
    warm = max((r for t, r in rss if t <= seconds / 5), default=None)
    end = max((r for t, r in rss if t >= seconds * 4 / 5), default=None)
    depths = [s.queue_depth for s in samples if s.queue_depth is not None]
    return Soak(
        seconds,
        round(wall, 3),
        dict(tally.kinds),
        tally.server_errors,
        tally.unexpected,
        tally.wrong,
        tally.vanished,
        max(depths, default=None),
        warm,
        end,
        None if warm is None or end is None else round(100 * (end - warm) / warm, 2),
        tally.examples,
        samples,
    )


SOAK_SERVER = ["--max-body-mb", "1", "--max-queue", "64"]  # cheap oversized bodies


def run_soak(
    serve_args: list[str],
    seconds: float,
    out: Path,
    *,
    url: str | None = None,
    max_tokens: int = 32,
    long_tokens: int = 1500,
) -> Soak:
    """A soak of `delspec serve` started with `serve_args` (and `SOAK_SERVER`) in a process of
    its own, or of the server at `url` (no RSS then; its body limit taken as the default);
    writes results.json and table.md to `out`."""
    with (
        serve_process([*serve_args, *SOAK_SERVER]) if url is None else nullcontext((url, None)) as (
            at,
            pid,
        )
    ):
        limit = 1.0 if url is None else DEFAULT_MAX_BODY_MB
        result = asyncio.run(
            soak(at, seconds, pid=pid, max_tokens=max_tokens, long_tokens=long_tokens,
                 max_body_mb=limit)
        )  # fmt: skip
        environment = describe(at, serve_args + SOAK_SERVER if url is None else None)
    write_soak(result, environment, out)
    return result


def write_soak(result: Soak, environment: dict[str, Any], out: Path) -> None:
    """results.json and table.md of a soak in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"environment": environment, "soak": asdict(result)}
    (out / "results.json").write_text(json.dumps(data, indent=1))
    r = result
    requests = ", ".join(f"{kind}: {count}" for kind, count in sorted(r.requests.items()))
    rss = "n/a" if r.rss_warm_mib is None else f"{r.rss_warm_mib:.0f} -> {r.rss_end_mib:.0f}"
    growth = "n/a" if r.rss_growth_pct is None else f"{r.rss_growth_pct:+.1f}"
    lines = [
        f"# delspec bench-serve --soak {r.seconds:g}: {environment.get('model')}",
        "",
        f"{environment.get('date')} · {environment.get('cpu')} · server: "
        f"`{environment.get('serve_args')}`; clients on the same machine.",
        "",
        "| requests | 5xx | unexpected | answers not solo | vanished clients | queue depth max "
        "| RSS MiB (first fifth -> last fifth) | RSS growth % |",
        "|---|---|---|---|---|---|---|---|",
        f"| {requests} | {r.server_errors} | {r.unexpected} | {r.wrong_answers} | {r.vanished} "
        f"| {r.queue_depth_max} | {rss} | {growth} |",
        "",
        "normal: streaming greedy chats of task prompts; long prompt: ~1500-token prompts; "
        "vanishing: streams left after 1-4 pieces; hostile: oversized (413), malformed and "
        "invalid bodies (4xx expected). Answers not solo: greedy answers that differ from the "
        "same prompt's answer with no other request running. RSS growth: peak in the last "
        "fifth of the soak over the peak in the first fifth.",
    ]
    if r.examples:
        lines += ["", "Unexpected:", "", *(f"- {e}" for e in r.examples)]
    (out / "table.md").write_text("\n".join(lines) + "\n")

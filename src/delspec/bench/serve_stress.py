"""`delspec bench-serve --stress`: how the server holds up while heavy requests come in.

Two measurements on one server, each after its prompts' solo answers (one request at a time,
greedy) are known:

- A long prompt joins running streams: `streams` clients keep streaming chat answers (each
  client sends its next request when one ends) while a prompt of about `long_tokens` tokens
  joins. Reported: the running streams' gaps between two pieces of text before it joins (p50,
  max) and while it is prefilled (max, up to its first token), its time to first token, and
  whether every answer equals its solo answer.
- Large bodies: `clients` clients each send `bodies` chat bodies of `body_mb` MB, one after
  another, while /health is polled every `POLL_S` and a small chat is sent again and again.
  Reported: the big bodies' HTTP statuses, /health latency (p50, p99, max) and the small chats'
  time to first token, and whether their answers equal the solo answer.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from delspec.bench.serve_clients import Streamed, chat_body, long_prompt, stream_chat
from delspec.bench.serve_load import TIMEOUT, describe, quantile, serve_process, task_prompts

POLL_S = 0.05  # between two /health polls
SMALL_TOKENS = 16  # the small chats' answers


@dataclass
class LongJoin:
    """Running streams while a long prompt joins them (see the module docstring)."""

    streams: int
    long_prompt_tokens: int | None  # as the server counted them
    gap_before_p50_ms: float
    gap_before_max_ms: float
    gap_during_max_s: float  # the longest gap of a running stream while the long prompt joined
    long_first_token_s: float
    requests: int
    wrong_answers: int
    errors: list[str] = field(default_factory=list)


@dataclass
class BigBodies:
    """/health and a small chat while large bodies arrive (see the module docstring)."""

    clients: int
    bodies: int  # per client
    body_mb: float
    statuses: dict[str, int]
    health_polls: int
    health_p50_ms: float
    health_p99_ms: float
    health_max_ms: float
    small_chats: int
    small_first_token_max_s: float
    small_first_token_p50_s: float
    wrong_answers: int
    errors: list[str] = field(default_factory=list)


async def solo_answers(
    http: httpx.AsyncClient, url: str, prompts: list[str], max_tokens: int
) -> dict[str, str]:
    """Each prompt's answer with no other request running (one at a time, greedy)."""
    answers = {}
    for prompt in dict.fromkeys(prompts):
        streamed = await stream_chat(http, url, chat_body(prompt, max_tokens))
        if streamed.error is not None:
            raise RuntimeError(f"a solo request failed: {streamed.error}")
        answers[prompt] = streamed.text
    return answers


async def long_join(
    url: str,
    streams: int = 4,
    long_tokens: int = 3000,
    max_tokens: int = 64,
    prompts: list[str] | None = None,
) -> LongJoin:
    """The long-prompt measurement (see the module docstring); `prompts` (default: the
    benchmark tasks'): the running streams'."""
    prompts = prompts or task_prompts(streams * 2)
    long = long_prompt(long_tokens)
    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as http:
        solo = await solo_answers(http, url, prompts, max_tokens)
        solo_long = await solo_answers(http, url, [long], 16)
        done = asyncio.Event()
        seen: list[tuple[str, Streamed]] = []

        async def client(own: list[str]) -> None:
            for i in range(10_000):  # until the long prompt's answer is in (bounded)
                if done.is_set():
                    return
                prompt, streamed = own[i % len(own)], Streamed()
                seen.append((prompt, streamed))
                await stream_chat(http, url, chat_body(prompt, max_tokens), into=streamed)

        clients = [asyncio.create_task(client(prompts[c::streams])) for c in range(streams)]
        deadline = time.monotonic() + TIMEOUT
        while sum(len(s.times) >= 3 for _, s in seen) < streams:  # the streams are going
            if time.monotonic() > deadline or any(s.error for _, s in seen):
                done.set()
                await asyncio.gather(*clients)
                raise RuntimeError(f"the running streams did not start: {seen[-1][1].error}")
            await asyncio.sleep(0.02)
        joined = time.monotonic()
        joining = await stream_chat(http, url, chat_body(long, 16))
        done.set()
        await asyncio.gather(*clients)
        usage = await _prompt_tokens(http, url, long)
    first = joining.times[0] if joining.times else time.monotonic()
    pairs = [pair for _, s in seen for pair in s.pairs]
    before = [b - a for a, b in pairs if b <= joined]
    during = [b - a for a, b in pairs if b > joined and a < first]
    answers = [(p, s) for p, s in seen if s.error is None] + [(long, joining)]
    expected = {**solo, **solo_long}
    errors = [s.error for _, s in seen if s.error] + ([joining.error] if joining.error else [])
    return LongJoin(
        streams,
        usage,
        quantile(before, 0.5) * 1e3,
        max(before, default=float("nan")) * 1e3,
        max(during, default=float("nan")),
        joining.first_token_s or float("nan"),
        len(seen) + 1,
        sum(s.text != expected[p] for p, s in answers),
        errors,
    )


async def _prompt_tokens(http: httpx.AsyncClient, url: str, prompt: str) -> int | None:
    """How many tokens the server counts in chat `prompt` (its usage)."""
    response = await http.post(url + "/v1/chat/completions", json=chat_body(prompt, 1, False))
    return response.json().get("usage", {}).get("prompt_tokens") if response.is_success else None


async def big_bodies(
    url: str, clients: int = 3, bodies: int = 2, body_mb: float = 10.0, small: str | None = None
) -> BigBodies:
    """The large-body measurement (see the module docstring); `small` (default: a benchmark
    task's): the small chat's prompt."""
    small = small or task_prompts(1)[0]
    words = "hello world " * int(body_mb * 1e6 / 12)
    payload = json.dumps(chat_body(words, 8)).encode()
    headers = {"content-type": "application/json"}
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as http:
        solo = (await solo_answers(http, url, [small], SMALL_TOKENS))[small]
        statuses: list[str] = []
        latencies: list[float] = []
        chats: list[Streamed] = []
        done = asyncio.Event()

        async def big() -> None:
            for _ in range(bodies):
                try:
                    sent = await http.post(
                        url + "/v1/chat/completions", content=payload, headers=headers
                    )
                    statuses.append(str(sent.status_code))
                except httpx.HTTPError as exc:
                    statuses.append(type(exc).__name__)

        async def poll() -> None:
            while not done.is_set():
                start = time.monotonic()
                try:
                    await http.get(url + "/health")
                    latencies.append(time.monotonic() - start)
                except httpx.HTTPError:
                    latencies.append(float("inf"))
                await asyncio.sleep(POLL_S)

        async def chat() -> None:
            while not done.is_set():
                chats.append(await stream_chat(http, url, chat_body(small, SMALL_TOKENS)))

        background = [asyncio.create_task(poll()), asyncio.create_task(chat())]
        await asyncio.sleep(2 * POLL_S)
        await asyncio.gather(*(big() for _ in range(clients)))
        done.set()
        await asyncio.gather(*background)
    firsts = [c.first_token_s for c in chats if c.first_token_s is not None]
    return BigBodies(
        clients,
        bodies,
        body_mb,
        {s: statuses.count(s) for s in sorted(set(statuses))},
        len(latencies),
        quantile(latencies, 0.5) * 1e3,
        quantile(latencies, 0.99) * 1e3,
        max(latencies, default=float("nan")) * 1e3,
        len(chats),
        max(firsts, default=float("nan")),
        quantile(firsts, 0.5),
        sum(c.text != solo for c in chats if c.error is None),
        [c.error for c in chats if c.error],
    )


def stress(
    url: str, long_tokens: int = 3000, streams: int = 4, body_mb: float = 10.0
) -> dict[str, Any]:
    """Both measurements against the server at `url`, as a dict of their results."""
    joined = asyncio.run(long_join(url, streams, long_tokens))
    bodies = asyncio.run(big_bodies(url, body_mb=body_mb))
    return {"long_prompt_joins": asdict(joined), "big_bodies": asdict(bodies)}


# Room for the streams and the long prompt; 10 MB bodies are read and tokenized (then refused
# for their length), the harder case than a 413 at once.
STRESS_SERVER = ["--max-batch", "5", "--max-body-mb", "16", "--max-queue", "16"]


def run_stress(
    serve_args: list[str], out: Path, *, url: str | None = None, long_tokens: int = 3000
) -> dict[str, Any]:
    """`stress` of `delspec serve` started with `serve_args` (and `STRESS_SERVER`: 4 streams,
    10 MB bodies) in a process of its own, or of the server at `url`; writes results.json and
    table.md to `out`."""
    args = [*serve_args, *STRESS_SERVER]
    with serve_process(args) if url is None else nullcontext((url, None)) as (at, _):
        results = stress(at, long_tokens)
        environment = describe(at, args if url is None else None)
    out.mkdir(parents=True, exist_ok=True)
    data = {"environment": environment, **results}
    (out / "results.json").write_text(json.dumps(data, indent=1))
    title = f"# delspec bench-serve --stress: {environment['model']}"
    where = (
        f"{environment['date']} · {environment['cpu']} · server: `{environment['serve_args']}`; "
        "clients on the same machine."
    )
    (out / "table.md").write_text("\n".join([title, "", where, "", *stress_table(results)]) + "\n")
    return results


def stress_table(results: dict[str, Any]) -> list[str]:
    """Markdown lines for `run_stress`'s results."""
    j, b = results["long_prompt_joins"], results["big_bodies"]
    return [
        f"## A prompt of {j['long_prompt_tokens']} tokens joins {j['streams']} running streams",
        "",
        "| gap before p50 (ms) | gap before max (ms) | longest gap while it joins (s) "
        "| its first token (s) | requests | answers not solo | errors |",
        "|---|---|---|---|---|---|---|",
        f"| {j['gap_before_p50_ms']:.1f} | {j['gap_before_max_ms']:.1f} "
        f"| {j['gap_during_max_s']:.3f} | {j['long_first_token_s']:.2f} | {j['requests']} "
        f"| {j['wrong_answers']} | {len(j['errors'])} |",
        "",
        f"## {b['clients']} clients send {b['bodies']} bodies of {b['body_mb']:g} MB each, "
        "while /health is polled and a small chat is sent again and again",
        "",
        "| big bodies' statuses | /health polls | p50 (ms) | p99 (ms) | max (ms) "
        "| small chats | first token p50 (s) | max (s) | answers not solo |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {', '.join(f'{k}: {v}' for k, v in b['statuses'].items())} | {b['health_polls']} "
        f"| {b['health_p50_ms']:.1f} | {b['health_p99_ms']:.1f} | {b['health_max_ms']:.1f} "
        f"| {b['small_chats']} | {b['small_first_token_p50_s']:.2f} "
        f"| {b['small_first_token_max_s']:.2f} | {b['wrong_answers']} |",
    ]

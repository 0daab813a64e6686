"""Clients and probes for measuring a running server (`bench-serve --stress`, `--soak`): a
streaming chat request that keeps its text and the arrival time of every piece, the server's
queue depth from /metrics, a process's resident memory, a prompt of about N tokens."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from delspec.bench.tasks import TASKS, load_task

CHARS_PER_TOKEN = 3.2  # about, for the task texts (prose and code) in the usual BPE vocabularies


@dataclass
class Streamed:
    """A streaming chat request as its client saw it: the HTTP status, the text, the arrival
    time (`time.monotonic()`) of each piece, and an error (HTTP status, an error event, or a
    transport error) if any, and the usage the server reported."""

    status: int | None = None
    text: str = ""
    times: list[float] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)  # the last chunk's, where it has one
    sent: float = 0.0
    error: str | None = None
    server_error: bool = False  # a 5xx status, or an error event of type server_error

    @property
    def tokens(self) -> int:
        """Completion tokens, as the server counted them (0 without a usage chunk)."""
        return int(self.usage.get("completion_tokens", 0))

    @property
    def first_token_s(self) -> float | None:
        """From sending to the first piece of text."""
        return self.times[0] - self.sent if self.times else None

    @property
    def pairs(self) -> list[tuple[float, float]]:
        """The arrival times of every two successive pieces."""
        return list(itertools.pairwise(self.times))


def chat_body(prompt: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    """A greedy chat request for `prompt`, streaming (with the usage in a last chunk) unless
    `stream` is false."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    return {**body, "stream_options": {"include_usage": True}} if stream else body


async def stream_chat(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    pieces: int | None = None,
    into: Streamed | None = None,
) -> Streamed:
    """Send streaming chat `body` to the server at `url` and read its answer (into `into` if
    given, so that others may watch it arrive); with `pieces`, vanish (close the connection)
    after that many pieces of text."""
    out = into or Streamed()
    out.sent = time.monotonic()
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            out.status = response.status_code
            if response.status_code != 200:
                said = (await response.aread()).decode(errors="replace")
                out.error = f"HTTP {response.status_code}: {said[:300]}"
                out.server_error = response.status_code >= 500
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    error = chunk["error"]
                    out.error = f"{error.get('type')}: {error.get('code')}"
                    out.server_error = error.get("type") == "server_error"
                    continue
                if chunk.get("usage"):  # null but in the last chunk
                    out.usage = chunk["usage"]
                choices = chunk.get("choices") or [{}]
                piece = choices[0].get("delta", {}).get("content")
                if piece:
                    out.times.append(time.monotonic())
                    out.text += piece
                    if pieces is not None and len(out.times) >= pieces:
                        return out  # leaving the block closes the connection mid-stream
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__
    return out


def queue_depth(metrics_text: str) -> float | None:
    """`delspec_queue_depth` from the server's /metrics text (None if absent)."""
    for line in metrics_text.splitlines():
        if line.startswith("delspec_queue_depth "):
            return float(line.split()[1])
    return None


def rss_mib(pid: int) -> float | None:
    """The resident memory of process `pid` in MiB (Linux /proc; None where unreadable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def long_prompt(tokens: int, seed: int = 7) -> str:
    """A prompt of about `tokens` tokens: benchmark task texts one after another, then a
    question about them."""
    texts = [item.text for name in TASKS for item in load_task(name, 20, seed)]
    words: list[str] = []
    budget = int(tokens * CHARS_PER_TOKEN)
    while sum(len(w) + 1 for w in words) < budget:
        words += " ".join(texts).split()
    text = " ".join(words)[:budget]
    return text + "\n\nIn one sentence: what is the text above about?"

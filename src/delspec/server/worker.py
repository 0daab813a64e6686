"""The single worker thread that runs generations one at a time from a bounded queue."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from delspec.decode_config import DecodeConfig
from delspec.errors import DelspecError
from delspec.generate import generate
from delspec.server.metrics import Metrics

if TYPE_CHECKING:
    from delspec.loading import LoadedModel

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One generation: the inputs for `generate` (`config`, and `options` such as
    `max_new_tokens`) and the events it sends back.

    Events, delivered to the request's event loop in order: ("start", None), then ("text",
    piece)... if `stream`, then ("done", Result) or ("error", exception).
    """

    prompt_ids: list[int]
    config: DecodeConfig
    options: dict[str, Any]
    stream: bool
    deadline: float  # time.monotonic() by which the generation must end
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False

    def emit(self, kind: str, value: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def should_stop(self) -> bool:
        if time.monotonic() >= self.deadline:
            self.timed_out = True
        return self.timed_out or self.cancelled.is_set()


class QueueFull(Exception):
    """The worker has `max_queue` jobs waiting already."""


class Worker:
    """Runs jobs one at a time, in arrival order, on one background thread."""

    def __init__(self, lm: LoadedModel, max_queue: int, metrics: Metrics) -> None:
        self.lm, self.max_queue, self.metrics = lm, max_queue, metrics
        self.running: Job | None = None
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="delspec-worker", daemon=True)

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the running one)."""
        return len(self._waiting)

    def start(self) -> None:
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Drops waiting jobs, stops the running one at its next round, joins the thread."""
        with self._cond:
            self._closed = True
            for job in [*self._waiting, *([self.running] if self.running else [])]:
                job.cancelled.set()
            self._waiting.clear()
            self._cond.notify()
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queues `job`; raises `QueueFull` if `max_queue` jobs wait behind a running one."""
        with self._cond:
            if len(self._waiting) + (self.running is not None) > self.max_queue:
                raise QueueFull
            self._waiting.append(job)
            self._cond.notify()

    def withdraw(self, job: Job) -> None:
        """Forgets `job` if it is waiting; stops it at its next round if it is running."""
        with self._cond:
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self.running = self._waiting.popleft()
            try:
                self._run(job)
            finally:
                with self._cond:
                    self.running = None

    def _run(self, job: Job) -> None:
        job.emit("start")
        try:
            result = generate(
                self.lm,
                job.prompt_ids,
                job.config,
                on_text=(lambda piece, _kind: job.emit("text", piece)) if job.stream else None,
                should_stop=job.should_stop,
                trace=True,
                **job.options,
            )
        except Exception as exc:  # reported to its client; the worker goes on serving
            if not isinstance(exc, DelspecError):
                log.exception("generation failed")
            job.emit("error", exc)
            return
        self.metrics.observe(result)
        job.emit("done", result)

"""The worker thread: continuous batching of generations over the model's KV cache slots.

Up to `max_batch` generations run at once, each in its own cache slot. A waiting request joins
at the next round boundary: its prompt is prefilled in its slot in chunks of `prefill_chunk`
rows (fewer further on in the prompt, where rows cost more: `delspec.decoding.prefill`), one chunk
between two steps of the running generations, so that a long prompt does not hold their
streams up; several joining prompts share a chunk. A generation leaves as soon as it ends or
its client goes away (the slot is free for the next one). While one generation runs alone it
takes its own strategy's rounds (drafts and all); while several run, they share one batched
pass over the weights per step (`step_together`): on a CPU the weights a step streams then
serve every sequence, which is most of the saving speculation would buy. A sequence whose
strategy drafts from its context may add rows for its context draft tokens to that pass, as
many as the measured cost of the batch's rows pays for (`BatchDrafts`). Either way every
sequence gets exactly its solo tokens (greedy) or its solo distribution.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from delspec.decoding.batch import step_together
from delspec.decoding.generate import TextDecoding
from delspec.decoding.prefill import Prefill, prefill_chunk
from delspec.decoding.prefix import EMPTY, Held
from delspec.decoding.run import ResolvedConfig
from delspec.drafting.batch_drafts import BatchDrafts
from delspec.drafting.context_drafts import POOL, SEQUENCE
from delspec.drafting.draft_pool import DraftPool
from delspec.errors import DelspecError
from delspec.server.metrics import Metrics
from delspec.server.prompt_cache import PromptCache

if TYPE_CHECKING:
    from delspec.weights.loading import LoadedModel

log = logging.getLogger(__name__)

DEFAULT_PROMPT_CACHE_MB = 256.0  # MiB of evicted prompt prefixes kept unless told otherwise
# Tokens of earlier replies the draft pool keeps (`DraftPool`): a few hundred replies, tens of
# MiB of index; small beside the KV cache.
DEFAULT_DRAFT_POOL_TOKENS = 32768

# Prompt rows prefilled between two steps of the running jobs (fewer further on in a prompt:
# `delspec.decoding.prefill.chunk_rows`): short enough that the running jobs' steps are not
# held up long, long enough that prefilling in chunks is no slower in all than one pass.
DEFAULT_PREFILL_CHUNK = 128


@dataclass(eq=False)
class Job:
    """One generation: the inputs of a `TextDecoding` (`run`: the request's config resolved, and
    `options`: sampling, max_new_tokens, stop, logprobs, grammar) and the events it sends back.

    Events, delivered to the request's event loop in order: ("start", None), then ("text",
    piece)... if `stream`, then ("done", Result) or ("error", exception).
    """

    prompt_ids: list[int]
    run: ResolvedConfig
    options: dict[str, Any]
    stream: bool
    deadline: float  # time.monotonic() by which the generation must end
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    timed_out: bool = False
    queued_at: float = field(default_factory=time.monotonic)

    def emit(self, kind: str, value: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def should_stop(self) -> bool:
        if time.monotonic() >= self.deadline:
            self.timed_out = True
        return self.timed_out or self.cancelled.is_set()


class QueueFull(Exception):
    """The worker has `max_queue` jobs waiting already."""


@dataclass(eq=False)
class _Running:
    """A job in a slot: its prompt being prefilled (`prefill`), then generating."""

    job: Job
    text: TextDecoding
    prefill: Prefill
    first_token: bool = False

    @property
    def slot(self) -> int:
        return self.text.slot

    @property
    def held(self) -> Held:
        """What its slot holds now: the prompt rows prefilled so far, then the sequence's
        positions that are computed (all but its newest token)."""
        prefill = self.prefill
        return self.text.held(None if prefill.finished else prefill.done_rows)


class Worker:
    """Runs jobs on one background thread, up to `max_batch` at a time in arrival order, each
    in a cache slot of `slot_positions` positions (prompt and reply), prompts prefilled
    `prefill_chunk` rows at a time, their prefixes reused from what the slots hold or from up
    to `prompt_cache_mb` MiB of prefixes evicted from them (`PromptCache`). Every job whose
    strategy drafts from its context shares one `DraftPool` of the newest `draft_pool_tokens`
    tokens of finished replies (0: no pool). See the module docstring."""

    def __init__(
        self,
        lm: LoadedModel,
        max_queue: int,
        metrics: Metrics,
        max_batch: int,
        slot_positions: int,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        attention_span: float = math.inf,
        drafts: BatchDrafts | None = None,
        prompt_cache_mb: float = DEFAULT_PROMPT_CACHE_MB,
        draft_pool_tokens: int = DEFAULT_DRAFT_POOL_TOKENS,
    ) -> None:
        self.lm, self.max_queue, self.metrics = lm, max_queue, metrics
        self.drafts = drafts or BatchDrafts({})  # context drafts in batched steps
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.slot_positions = slot_positions  # positions a job may use: its prompt and reply
        self.attention_span = attention_span  # see `delspec.decoding.prefill.chunk_rows`
        self._joining: list[_Running] = []  # in their slots, prompts being prefilled
        self._running: list[_Running] = []  # generating
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="delspec-worker", daemon=True)
        self.prompt_cache = PromptCache(lm.model, max_batch, int(prompt_cache_mb * 2**20))
        self.draft_pool = DraftPool(draft_pool_tokens) if draft_pool_tokens else None

    @property
    def depth(self) -> int:
        """Jobs waiting for a slot."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Jobs in a slot now: generating, or their prompts being prefilled."""
        return len(self._joining) + len(self._running)

    @property
    def prefilling(self) -> int:
        """Jobs whose prompts are being prefilled."""
        return len(self._joining)

    def start(self) -> None:
        with torch.inference_mode():  # the slots, written by the engines in inference mode
            self.lm.model.setup_cache(self.slot_positions, self.max_batch)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        """Drops waiting jobs, stops the running ones at their next round, joins the thread."""
        with self._cond:
            self._closed = True
            for job in [*self._waiting, *(r.job for r in self._joining + self._running)]:
                job.cancelled.set()
            self._waiting.clear()
            self._cond.notify()
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        """Queues `job`; raises `QueueFull` if `max_queue` jobs wait already."""
        with self._cond:
            if len(self._waiting) >= self.max_queue + max(0, self.max_batch - self.active):
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
                while not self._waiting and not self.active and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                arriving = []
                while self._waiting and self.active + len(arriving) < self.max_batch:
                    arriving.append(self._waiting.popleft())
            if arriving:
                self._join(arriving)
            self._leave_stopped()
            if self._joining:
                self._prefill()
            if self._running:
                self._step()

    def _join(self, jobs: list[Job]) -> None:
        """Give `jobs` free slots and their decodings (their prompts to be prefilled), and
        send their start events."""
        for job in jobs:
            self.metrics.observe_wait(time.monotonic() - job.queued_at)
            job.emit("start")
            busy = {r.slot: r.held for r in self._joining + self._running}
            free = [s for s in range(self.max_batch) if s not in busy]
            slot, cached = self.prompt_cache.place(job.prompt_ids, free, busy)
            try:
                options = {**job.options, "trace": True, "draft_pool": self.draft_pool}
                text = TextDecoding(job.run, job.prompt_ids, slot=slot, **options)
                self._joining.append(_Running(job, text, Prefill(text.decoding, cached)))
            except Exception as exc:  # reported to its client; the worker goes on serving
                self.prompt_cache.release(slot, EMPTY)
                self._fail(job, exc)

    def _prefill(self) -> None:
        """One chunk of the joining jobs' prompts; those whose prompts are cached now start
        generating (in this loop's step)."""
        joining = self._joining
        try:
            prefill_chunk([r.prefill for r in joining], self.prefill_chunk, self.attention_span)
        except Exception as exc:  # every job in the chunk gets the error
            for entry in joining:
                self.prompt_cache.release(entry.slot, EMPTY)
                self._fail(entry.job, exc)
            self._joining = []
            return
        ready = [r for r in joining if r.prefill.finished]
        self._joining = [r for r in joining if not r.prefill.finished]
        self._running += ready

    def _step(self) -> None:
        """One round for the running jobs: a lone one's own round, or one batched step."""
        running = self._running
        self.metrics.observe_batch(len(running))
        try:
            if len(running) == 1:
                pieces = [running[0].text.advance()]
            else:
                decodings = [r.text.decoding for r in running]
                proposals = [d.proposal(self.drafts.limit) for d in decodings]
                sources = [POOL if d.pool_offered else SEQUENCE for d in decodings]
                drafts = self.drafts.choose(proposals, sources)
                committed = step_together(decodings, drafts)
                self.drafts.observe(drafts, [accepted for _, accepted in committed], sources)
                pieces = [r.text.take(*c) for r, c in zip(running, committed, strict=True)]
        except Exception as exc:  # the whole step failed: every job in it gets the error
            for entry in running:
                self.prompt_cache.release(entry.slot, EMPTY)
                self._fail(entry.job, exc)
            self._running = []
            return
        for entry, texts in zip(list(running), pieces, strict=True):
            if not entry.first_token:
                entry.first_token = True
                self.metrics.observe_first_token(time.monotonic() - entry.job.queued_at)
            if entry.job.stream:
                for piece, _kind in texts:
                    entry.job.emit("text", piece)
            if entry.text.done:
                self._running.remove(entry)
                self._finish(entry)

    def _leave_stopped(self) -> None:
        """Jobs whose client went away or whose time is up end now (their slots free)."""
        for entry in [r for r in self._joining + self._running if r.job.should_stop()]:
            (self._joining if entry in self._joining else self._running).remove(entry)
            if entry.job.cancelled.is_set():
                self.prompt_cache.release(entry.slot, entry.held)
            else:  # its time is up: it ends with what it has
                entry.text.stop()
                self._finish(entry)

    def _finish(self, entry: _Running) -> None:
        """Send the rest of the job's text and its result (it has left its slot)."""
        self.prompt_cache.release(entry.slot, entry.held)
        pieces, result = entry.text.finish()
        if entry.job.stream:
            for piece, _kind in pieces:
                entry.job.emit("text", piece)
        self.metrics.observe(result)
        entry.job.emit("done", result)

    def _fail(self, job: Job, exc: Exception) -> None:
        if not isinstance(exc, DelspecError):
            log.error("generation failed", exc_info=exc)
        job.emit("error", exc)

"""An OpenAI-compatible HTTP server for one model, decoding with DEL (or any strategy).

Requests are validated and tokenised on the event loop, then wait in a bounded queue for the
single worker thread that runs `generate` one sequence at a time. A full queue answers 429; a
request that waits in the queue too long answers 503, one whose generation runs past the request
timeout answers 504 (streams get an error event instead); a client that goes away, a timeout,
or a shutdown stops its generation at the next round. Every error is an OpenAI error object.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from delspec.errors import ConfigError, ContextLengthError, DelspecError
from delspec.generate import Result, encode_prompt, generate
from delspec.policies import DEFAULT_STRATEGY, make_policy

if TYPE_CHECKING:
    from delspec.loading import LoadedModel

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_POLL_S = 0.25  # how often a waiting request checks whether its client is still there


# ---------------------------------------------------------------------------------------------
# Requests


class _GenerationRequest(BaseModel):
    """Fields both endpoints share. Types are strict; unknown OpenAI fields are ignored."""

    model_config = ConfigDict(strict=True)

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)  # None: 1.0, as OpenAI
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)  # None: 1.0
    top_k: int | None = Field(default=None, ge=0)  # an extension (as in vLLM); 0 = off
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list)
    n: int = 1
    stream: bool = False

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("stop must be a string or a list of strings")


class ChatMessage(BaseModel):
    """One conversation turn; content is text or a list of text parts."""

    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant"]
    content: str

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        if all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in value
        ):
            return "".join(p["text"] for p in value)
        raise ValueError("content must be a string or a list of {'type': 'text', 'text': ...}")


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer name of max_tokens


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or (
            isinstance(value, list) and all(type(t) is int for t in value)
        ):
            return value
        raise ValueError("prompt must be a string or a list of token ids (one prompt per request)")


# ---------------------------------------------------------------------------------------------
# Errors


class APIError(Exception):
    """An error answered with `status` and an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers
        self.param, self.code, self.kind = param, code, kind

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _as_api_error(exc: Exception) -> APIError:
    """The error object a generation exception is reported as."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, DelspecError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {exc!r}", kind="server_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's validation error as a 400 that names the offending field."""
    error = exc.errors()[0]
    path = list(error["loc"][1:])  # drop the leading "body"
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", "invalid JSON")
        where = f" at character {path[0]}" if path else ""
        return APIError(400, f"the request body is not valid JSON: {reason}{where}")
    reason = str(error["msg"]).removeprefix("Value error, ")
    if not path:
        return APIError(400, f"the request body must be a JSON object: {reason}")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    if error["type"] == "missing":
        return APIError(400, f"missing required parameter '{param}'", param=param)
    return APIError(400, f"invalid value for '{param}': {reason}", param=param)


# ---------------------------------------------------------------------------------------------
# Metrics


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


class _RequestCounter:
    """ASGI middleware counting HTTP responses by endpoint and status (499: client went away)."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

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
            endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
            self.metrics.count_request(endpoint, status)


# ---------------------------------------------------------------------------------------------
# The worker


@dataclass(eq=False)
class Job:
    """One generation: the inputs for `generate` and the events it sends back.

    Events, delivered to the request's event loop in order: ("start", None), then ("text",
    piece)... if `stream`, then ("done", Result) or ("error", exception).
    """

    prompt_ids: list[int]
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

    def __init__(
        self,
        lm: LoadedModel,
        strategy: str,
        strategy_options: dict[str, Any],
        max_queue: int,
        metrics: Metrics,
    ) -> None:
        self.lm, self.strategy, self.strategy_options = lm, strategy, strategy_options
        self.max_queue, self.metrics = max_queue, metrics
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
                strategy=self.strategy,
                on_text=(lambda piece, _kind: job.emit("text", piece)) if job.stream else None,
                should_stop=job.should_stop,
                trace=True,
                **job.options,
                **self.strategy_options,
            )
        except Exception as exc:  # reported to its client; the worker goes on serving
            if not isinstance(exc, DelspecError):
                log.exception("generation failed")
            job.emit("error", exc)
            return
        self.metrics.observe(result)
        job.emit("done", result)


# ---------------------------------------------------------------------------------------------
# Responses


class _Reply:
    """Builds the OpenAI response objects of one chat or text completion."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def response(self, result: Result) -> dict[str, Any]:
        content = (
            {"message": {"role": "assistant", "content": result.text}}
            if self.chat
            else {"text": result.text, "logprobs": None}
        )
        return self._wrap(False, {**content, "finish_reason": result.finish_reason}, result)

    def opening(self) -> dict[str, Any]:
        """The chat stream's first chunk, which names the role."""
        return self._wrap(True, {"delta": {"role": "assistant", "content": ""}})

    def piece(self, text: str) -> dict[str, Any]:
        return self._wrap(True, self._delta(text))

    def closing(self, result: Result) -> dict[str, Any]:
        """The last chunk: finish reason, usage and delspec statistics."""
        return self._wrap(
            True, {**self._delta(None), "finish_reason": result.finish_reason}, result
        )

    def _delta(self, text: str | None) -> dict[str, Any]:
        if self.chat:
            return {"delta": {} if text is None else {"content": text}}
        return {"text": text or "", "logprobs": None}

    def _wrap(self, chunk: bool, choice: dict[str, Any], result: Result | None = None) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        out: dict[str, Any] = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "finish_reason": None, **choice}],
        }
        if result is not None:
            stats = result.stats
            out["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": len(result.token_ids),
                "total_tokens": self.prompt_tokens + len(result.token_ids),
            }
            out["delspec"] = {
                "strategy": result.strategy,
                "acceptance_rate": round(stats.acceptance_rate, 4),
                "mean_exit_layer": round(stats.mean_exit_layer, 3),
                "tokens_per_s": round(stats.tokens_per_s, 3),
            }
        return out


def _sse(data: dict[str, Any] | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


# ---------------------------------------------------------------------------------------------
# The application


class _ClientGone(Exception):
    """The client disconnected while its request waited."""


class _Service:
    """The request handling behind the routes: validation, queueing, waiting, replying."""

    def __init__(
        self,
        lm: LoadedModel,
        worker: Worker,
        name: str,
        request_timeout: float,
        queue_timeout: float,
    ) -> None:
        self.lm, self.worker, self.name = lm, worker, name
        self.request_timeout, self.queue_timeout = request_timeout, queue_timeout
        self.context = lm.model.config.max_position

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        self._check_common(body)
        messages = [m.model_dump() for m in body.messages]
        prompt_ids = encode_prompt(self.lm, messages)
        self._check_prompt(prompt_ids, "messages")
        limit = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        return await self._complete(request, body, prompt_ids, limit, param, chat=True)

    async def completion(self, request: Request, body: CompletionRequest) -> Response:
        self._check_common(body)
        try:
            prompt_ids = encode_prompt(self.lm, body.prompt)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt") from exc
        self._check_prompt(prompt_ids, "prompt")
        limit = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        return await self._complete(request, body, prompt_ids, limit, "max_tokens", chat=False)

    def _check_common(self, body: _GenerationRequest) -> None:
        if body.model is not None and body.model != self.name:
            raise APIError(
                404,
                f"the model '{body.model}' does not exist; this server serves '{self.name}'",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise APIError(
                400,
                f"n={body.n} is not supported: this server returns one choice (n=1)",
                param="n",
            )

    def _check_prompt(self, prompt_ids: list[int], param: str) -> None:
        if not prompt_ids:
            raise APIError(400, f"the {param} is empty", param=param)
        if len(prompt_ids) >= self.context:
            raise APIError(
                400,
                f"the {param} has {len(prompt_ids)} tokens but the model's context is "
                f"{self.context} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def _complete(
        self,
        request: Request,
        body: _GenerationRequest,
        prompt_ids: list[int],
        limit: int | None,
        limit_param: str,
        chat: bool,
    ) -> Response:
        if limit is not None and limit > self.context:
            raise APIError(
                400,
                f"{limit_param}={limit} is more than the model's context of {self.context} tokens",
                param=limit_param,
            )
        options = {  # generate() checks them again (ConfigError -> 400)
            "max_new_tokens": limit or self.context - len(prompt_ids),
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_k": body.top_k or 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "seed": body.seed,
            "stop": body.stop,
        }
        deadline = time.monotonic() + self.request_timeout
        job = Job(prompt_ids, options, body.stream, deadline, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy: its queue of {self.worker.max_queue} waiting requests "
                "is full (the model serves one request at a time); retry later",
                code="queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            ) from None
        reply = _Reply(chat, self.name, len(prompt_ids))
        streaming = False
        try:
            await self._started(job, request)
            if body.stream:
                streaming = True
                return StreamingResponse(
                    self._stream(job, reply),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            kind, value = await self._next_event(job, request)  # "done" or "error"
            if kind == "error":
                raise _as_api_error(value)
            if job.timed_out:
                raise self._timeout_error()
            return JSONResponse(reply.response(value))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if not streaming:
                self.worker.withdraw(job)

    async def _started(self, job: Job, request: Request) -> None:
        """Waits for the worker to start `job`; 503 when it waited too long in the queue."""
        limit = min(self.queue_timeout, job.deadline - time.monotonic())
        try:
            await asyncio.wait_for(self._next_event(job, request), limit)  # the "start" event
        except TimeoutError:
            raise APIError(
                503,
                f"the request waited {limit:g} s in the queue without reaching the model (it "
                "serves one request at a time); retry later",
                code="queue_timeout",
                kind="server_error",
            ) from None

    async def _next_event(self, job: Job, request: Request) -> tuple[str, Any]:
        """The job's next event; raises `_ClientGone` if the client disconnects meanwhile.

        Only for the quiet stretches of a job (queued, or generating without streaming): each
        `_POLL_S` without an event checks the connection.
        """
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), _POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    raise _ClientGone from None

    async def _stream(self, job: Job, reply: _Reply) -> AsyncIterator[str]:
        """Server-sent events: chunks, then `[DONE]`; an error event ends a failed stream.

        Starlette cancels this generator when the client disconnects; that stops the job.
        """
        try:
            if reply.chat:
                yield _sse(reply.opening())
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield _sse(reply.piece(value))
                elif kind == "error":
                    yield _sse(_as_api_error(value).body())
                    return
                elif job.timed_out:  # "done", but cut short
                    yield _sse(self._timeout_error().body())
                    return
                else:  # "done"
                    yield _sse(reply.closing(value))
                    yield _sse("[DONE]")
                    return
        finally:
            self.worker.withdraw(job)

    def _timeout_error(self) -> APIError:
        return APIError(
            504,
            f"the generation did not finish within the request timeout of "
            f"{self.request_timeout:g} s and was stopped; ask for fewer tokens or raise the "
            "timeout",
            code="timeout",
            kind="server_error",
        )


def create_app(
    lm: LoadedModel,
    *,
    strategy: str = DEFAULT_STRATEGY,
    strategy_options: dict[str, Any] | None = None,
    max_queue: int = 16,
    request_timeout: float = 600.0,
    queue_timeout: float | None = None,
    model_name: str | None = None,
) -> FastAPI:
    """The FastAPI application serving `lm` with `strategy` (and its options).

    `max_queue` requests may wait while one generates; `request_timeout` bounds a request from
    arrival to its last token, `queue_timeout` (default: `request_timeout`) its wait in the
    queue. `model_name` (default `lm.name`) is the id clients pass as `model`. Raises
    `ConfigError` for invalid settings.
    """
    options = dict(strategy_options or {})
    make_policy(strategy, lm.model.num_layers, **options)  # fail now, not at the first request
    if max_queue < 0:
        raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
    queue_timeout = request_timeout if queue_timeout is None else queue_timeout
    if request_timeout <= 0 or queue_timeout <= 0:
        raise ConfigError(
            f"timeouts must be > 0 seconds, got {request_timeout} and {queue_timeout}"
        )
    name = model_name or lm.name
    metrics = Metrics(lm.model.num_layers)
    worker = Worker(lm, strategy, options, max_queue, metrics)
    service = _Service(lm, worker, name, request_timeout, queue_timeout)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.close)

    app = FastAPI(title="delspec", lifespan=lifespan)
    app.add_middleware(_RequestCounter, metrics=metrics)
    _add_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": name,
            "queue_depth": worker.depth,
            "busy": worker.running is not None,
        }

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(
            metrics.render(worker.depth, worker.running is not None),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": started, "owned_by": "delspec"}],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await service.chat(request, body)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await service.completion(request, body)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error object."""

    def handle(kind: type[Exception], to_error: Callable[[Request, Any], APIError]) -> None:
        async def handler(request: Request, exc: Exception) -> Response:
            return to_error(request, exc).response()

        app.add_exception_handler(kind, handler)

    handle(APIError, lambda _, exc: exc)
    handle(RequestValidationError, lambda _, exc: _validation_error(exc))
    handle(DelspecError, lambda _, exc: _as_api_error(exc))
    handle(
        StarletteHTTPException,
        lambda request, exc: APIError(
            exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"
        ),
    )
    handle(Exception, lambda _, exc: _as_api_error(exc))


def serve(lm: LoadedModel, host: str = "127.0.0.1", port: int = 8000, **app_options: Any) -> None:
    """Serve `lm` over HTTP until interrupted; `app_options` go to `create_app`."""
    uvicorn.run(create_app(lm, **app_options), host=host, port=port)


__all__ = ["create_app", "serve"]

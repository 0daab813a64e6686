"""The FastAPI application: routes, request handling (validate, queue, wait, reply), errors."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from delspec.decode_config import DecodeConfig
from delspec.decoding import measured_max_batch
from delspec.draft_head import draft_head
from delspec.errors import ConfigError, DelspecError
from delspec.generate import encode_prompt
from delspec.policies import make_policy
from delspec.sampling import Sampling
from delspec.server.metrics import Metrics, RequestCounter
from delspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    Reply,
    as_api_error,
    sse,
    validation_error,
)
from delspec.server.worker import Job, QueueFull, Worker

if TYPE_CHECKING:
    from delspec.loading import LoadedModel

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CONTEXT = 4096  # positions per request (and cache slot) unless --context says
_POLL_S = 0.25  # how often a waiting request checks whether its client is still there


class _ClientGone(Exception):
    """The client disconnected while its request waited."""


class _Service:
    """The request handling behind the routes: validation, queueing, waiting, replying."""

    def __init__(
        self,
        lm: LoadedModel,
        config: DecodeConfig,
        worker: Worker,
        names: tuple[str, ...],
        request_timeout: float,
        queue_timeout: float,
    ) -> None:
        self.lm, self.config, self.worker = lm, config, worker
        self.name, self.names = names[0], names
        self.request_timeout, self.queue_timeout = request_timeout, queue_timeout
        self.context = worker.context  # positions a request may use: prompt and reply

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        self._check_common(body)
        messages = [m.model_dump() for m in body.messages]
        prompt_ids = encode_prompt(self.lm, messages)
        self._check_prompt(prompt_ids, "messages")
        limit = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await self._complete(request, body, prompt_ids, limit, param, top, chat=True)

    async def completion(self, request: Request, body: CompletionRequest) -> Response:
        self._check_common(body)
        try:
            prompt_ids = encode_prompt(self.lm, body.prompt)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="prompt") from exc
        self._check_prompt(prompt_ids, "prompt")
        limit = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        top = body.logprobs
        return await self._complete(request, body, prompt_ids, limit, "max_tokens", top, chat=False)

    def _check_common(self, body: GenerationRequest) -> None:
        if body.model is not None and body.model not in self.names:
            known = "', '".join(self.names)
            raise APIError(
                404,
                f"the model '{body.model}' does not exist; this server serves '{known}'",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise APIError(
                400,
                f"n={body.n} is not supported: this server returns one choice (n=1)",
                param="n",
            )

    def _decode_config(self, body: GenerationRequest) -> DecodeConfig:
        """The server's config updated with the request's `delspec` options. Adapters files
        are the server's to choose (`delspec serve --adapters`): a request may ask for "auto"
        or "none" only."""
        options = body.delspec or {}
        if options.get("adapters", "auto") not in ("auto", "none", None):
            raise APIError(
                400,
                "delspec.adapters may be 'auto' or 'none'; adapters files are chosen when the "
                "server starts (delspec serve --adapters)",
                param="delspec.adapters",
            )
        try:
            config = self.config.updated(**options)
            make_policy(config, self.lm.model.num_layers)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="delspec") from exc
        return config

    def _check_prompt(self, prompt_ids: list[int], param: str) -> None:
        if not prompt_ids:
            raise APIError(400, f"the {param} is empty", param=param)
        if len(prompt_ids) >= self.context:
            raise APIError(
                400,
                f"the {param} has {len(prompt_ids)} tokens but the context is {self.context} "
                "tokens (for a request's prompt and reply: the model's, or serve --context)",
                param=param,
                code="context_length_exceeded",
            )

    async def _complete(
        self,
        request: Request,
        body: GenerationRequest,
        prompt_ids: list[int],
        limit: int | None,
        limit_param: str,
        logprobs: int | None,
        chat: bool,
    ) -> Response:
        job = self._submit(body, prompt_ids, limit, limit_param, logprobs)
        reply = Reply(chat, self.name, len(prompt_ids), self.lm.tokenizer)
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
                raise as_api_error(value)
            if job.timed_out:
                raise self._timeout_error()
            return JSONResponse(reply.response(value))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if not streaming:
                self.worker.withdraw(job)

    def _submit(
        self,
        body: GenerationRequest,
        prompt_ids: list[int],
        limit: int | None,
        limit_param: str,
        logprobs: int | None,
    ) -> Job:
        """Queue the generation `body` asks for (at most `limit` new tokens, which request
        field `limit_param` set; `logprobs` top tokens per token, or None); 429 when the queue
        is full."""
        if limit is not None and len(prompt_ids) + limit > self.context:
            raise APIError(
                400,
                f"{limit_param}={limit} after a prompt of {len(prompt_ids)} tokens is more than "
                f"the {self.context} positions a request may use (delspec serve --context)",
                param=limit_param,
                code="context_length_exceeded",
            )
        config = self._decode_config(body)
        sampling = Sampling(
            1.0 if body.temperature is None else body.temperature,
            body.top_k or 0,
            1.0 if body.top_p is None else body.top_p,
            body.seed,
        )
        options = {
            "sampling": sampling,
            "max_new_tokens": limit or self.context - len(prompt_ids),
            "stop": body.stop,
            "logprobs": logprobs,
        }
        deadline = time.monotonic() + self.request_timeout
        loop = asyncio.get_running_loop()
        job = Job(prompt_ids, config, options, body.stream, deadline, loop)
        try:
            self.worker.submit(job)
        except QueueFull:
            raise APIError(
                429,
                f"the server is busy: its queue of {self.worker.max_queue} waiting requests "
                f"is full (it generates for {self.worker.max_batch} at a time); retry later",
                code="queue_full",
                kind="rate_limit_error",
                headers={"Retry-After": "1"},
            ) from None
        return job

    async def _started(self, job: Job, request: Request) -> None:
        """Waits for the worker to start `job`; 503 when it waited too long in the queue."""
        limit = min(self.queue_timeout, job.deadline - time.monotonic())
        try:
            await asyncio.wait_for(self._next_event(job, request), limit)  # the "start" event
        except TimeoutError:
            raise APIError(
                503,
                f"the request waited {limit:g} s in the queue without reaching the model (it "
                f"generates for {self.worker.max_batch} at a time); retry later",
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

    async def _stream(self, job: Job, reply: Reply) -> AsyncIterator[str]:
        """Server-sent events: chunks, then `[DONE]`; an error event ends a failed stream.

        Starlette cancels this generator when the client disconnects; that stops the job.
        """
        try:
            if reply.chat:
                yield sse(reply.opening())
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    yield sse(reply.piece(value))
                elif kind == "error":
                    yield sse(as_api_error(value).body())
                    return
                elif job.timed_out:  # "done", but cut short
                    yield sse(self._timeout_error().body())
                    return
                else:  # "done"
                    yield sse(reply.closing(value))
                    yield sse("[DONE]")
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
    config: DecodeConfig | None = None,
    max_queue: int = 16,
    max_batch: int | None = None,
    context: int | None = None,
    request_timeout: float = 600.0,
    queue_timeout: float | None = None,
    model_name: str | None = None,
    aliases: tuple[str, ...] = (),
) -> FastAPI:
    """The FastAPI application serving `lm` with `config` (default `DecodeConfig()`), which a
    request's `delspec` options update.

    Up to `max_batch` requests generate at once (default: as many as a batched step pays for on
    this machine, `measured_max_batch`), each with `context` positions for prompt and reply
    (default: the model's context, at most `DEFAULT_CONTEXT`); `max_queue` more may wait.
    `request_timeout` bounds a request from arrival to its last token, `queue_timeout`
    (default: `request_timeout`) its wait in the queue. `model_name` (default `lm.name`) is the
    id the server lists; clients may also name the model by any of `aliases` (e.g. the name it
    was loaded by). Raises `ConfigError` for invalid settings.
    """
    config = config or DecodeConfig()
    make_policy(config, lm.model.num_layers)  # fail now, not at the first request:
    draft_head(lm, config)  # a bad option or adapters file
    if max_queue < 0:
        raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
    queue_timeout = request_timeout if queue_timeout is None else queue_timeout
    if request_timeout <= 0 or queue_timeout <= 0:
        raise ConfigError(
            f"timeouts must be > 0 seconds, got {request_timeout} and {queue_timeout}"
        )
    limit = lm.model.config.max_position
    context = min(limit, DEFAULT_CONTEXT) if context is None else context
    if not 2 <= context <= limit:
        raise ConfigError(f"context must be 2..{limit} (the model's), got {context}")
    if max_batch is None:
        max_batch = measured_max_batch(lm.model)
        print(f"delspec: generating for up to {max_batch} requests at once", file=sys.stderr)
    if max_batch < 1:
        raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
    names = tuple(dict.fromkeys([model_name or lm.name, *aliases]))
    metrics = Metrics(lm.model.num_layers)
    worker = Worker(lm, max_queue, metrics, max_batch, context)
    service = _Service(lm, config, worker, names, request_timeout, queue_timeout)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.close)

    app = FastAPI(title="delspec", lifespan=lifespan)
    app.add_middleware(RequestCounter, metrics=metrics, endpoints=ENDPOINTS)
    _add_error_handlers(app)
    _add_routes(app, service, metrics)
    return app


def _add_routes(app: FastAPI, service: _Service, metrics: Metrics) -> None:
    """The `ENDPOINTS`: health, Prometheus metrics, the model list and the completions."""
    worker, name = service.worker, service.name
    started = int(time.time())

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "model": name,
            "queue_depth": worker.depth,
            "active": worker.active,
            "max_batch": worker.max_batch,
            "busy": worker.active > 0,
        }

    @app.get("/metrics")
    async def metrics_text() -> Response:
        return Response(
            metrics.render(worker.depth, worker.active),
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


def _add_error_handlers(app: FastAPI) -> None:
    """Every error leaves as an OpenAI error object."""

    def handle(kind: type[Exception], to_error: Callable[[Request, Any], APIError]) -> None:
        async def handler(request: Request, exc: Exception) -> Response:
            return to_error(request, exc).response()

        app.add_exception_handler(kind, handler)

    handle(APIError, lambda _, exc: exc)
    handle(RequestValidationError, lambda _, exc: validation_error(exc))
    handle(DelspecError, lambda _, exc: as_api_error(exc))
    handle(
        StarletteHTTPException,
        lambda request, exc: APIError(
            exc.status_code, f"{exc.detail}: {request.method} {request.url.path}"
        ),
    )
    handle(Exception, lambda _, exc: as_api_error(exc))


@contextmanager
def serving(app: FastAPI, host: str = "127.0.0.1") -> Iterator[str]:
    """Serves `app` on `host` (a free port) in a background thread; yields the base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(60)


def serve(lm: LoadedModel, host: str = "127.0.0.1", port: int = 8000, **app_options: Any) -> None:
    """Serve `lm` over HTTP until interrupted; `app_options` go to `create_app`."""
    uvicorn.run(create_app(lm, **app_options), host=host, port=port)

"""The FastAPI application: settings checked, routes, errors; `Service` handles requests."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import generate_latest
from prometheus_client.registry import Collector
from starlette.exceptions import HTTPException as StarletteHTTPException

from delspec.decode_config import DecodeConfig
from delspec.decoding.run import ResolvedConfig, resolve
from delspec.drafting.batch_drafts import BatchDrafts
from delspec.errors import ConfigError, DelspecError, is_integer
from delspec.machine.batching import paying_batch
from delspec.server.metrics import Metrics, RequestCounter
from delspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    as_api_error,
    validation_error,
)
from delspec.server.service import Service
from delspec.server.worker import (
    DEFAULT_DRAFT_POOL_TOKENS,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PROMPT_CACHE_MB,
    Worker,
)

if TYPE_CHECKING:
    from delspec.weights.loading import LoadedModel

ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")
DEFAULT_MAX_QUEUE = 16  # requests that may wait for a slot unless max_queue says
DEFAULT_CONTEXT = 4096  # positions per request (and cache slot) unless --context says
DEFAULT_MAX_BODY_MB = 4.0  # request bodies past this many MiB get 413 unless --max-body-mb says


def create_app(
    lm: LoadedModel,
    *,
    config: DecodeConfig | None = None,
    max_queue: int = DEFAULT_MAX_QUEUE,
    max_batch: int | None = None,
    context: int | None = None,
    request_timeout: float = 600.0,
    queue_timeout: float | None = None,
    model_name: str | None = None,
    aliases: tuple[str, ...] = (),
    max_body_mb: float | None = None,
    prefill_chunk: int | None = None,
    prompt_cache_mb: float | None = None,
    draft_pool_tokens: int | None = None,
) -> FastAPI:
    """The FastAPI application serving `lm` with `config` (default `DecodeConfig()`), which a
    request's `delspec` options update.

    Up to `max_batch` requests generate at once (default: as many as a batched step pays for on
    this machine, `measured_max_batch`), each with `context` positions for prompt and reply
    (default: the model's context, at most `DEFAULT_CONTEXT`); `max_queue` more may wait.
    `request_timeout` bounds a request from arrival to its last token, `queue_timeout`
    (default: `request_timeout`) its wait in the queue. `model_name` (default `lm.name`) is the
    id the server lists; clients may also name the model by any of `aliases` (e.g. the name it
    was loaded by). A request body of more than `max_body_mb` MiB (default:
    `DEFAULT_MAX_BODY_MB`) gets 413 (`BodyLimit`). A joining request's prompt is prefilled at
    most `prefill_chunk` tokens (default: `DEFAULT_PREFILL_CHUNK`) between two steps of the
    running ones, and reuses the cache entries of its longest prefix that a slot holds or that
    up to `prompt_cache_mb` MiB of prefixes evicted from slots keep (default:
    `DEFAULT_PROMPT_CACHE_MB`; 0 keeps none). All requests share one pool of context drafts: the
    newest `draft_pool_tokens` tokens of replies (`DEFAULT_DRAFT_POOL_TOKENS`; 0: none).
    Raises `ConfigError` for invalid settings."""
    run, context, queue_timeout = check_options(
        lm,
        config,
        max_queue,
        max_batch,
        context,
        request_timeout,
        queue_timeout,
        max_body_mb,
        prefill_chunk,
        prompt_cache_mb,
        draft_pool_tokens,
    )
    # the decoding's cost profile read, or measured thoroughly, now: inside the first request
    # it would hold that request and every one queued behind it
    run.warm_up()
    # a batched step's seconds by row count: what batches and their context drafts cost here
    batch_seconds = lm.machine.batch_seconds if max_batch != 1 else {}
    if max_batch is None:
        max_batch = paying_batch(batch_seconds) if batch_seconds else 1
        print(f"delspec: generating for up to {max_batch} requests at once", file=sys.stderr)
    names = tuple(dict.fromkeys([model_name or lm.name, *aliases]))
    metrics = Metrics(lm.model.num_layers)
    chunk = prefill_chunk or DEFAULT_PREFILL_CHUNK
    span = lm.machine.attention_span
    drafts = BatchDrafts(batch_seconds)
    cache_mb = DEFAULT_PROMPT_CACHE_MB if prompt_cache_mb is None else prompt_cache_mb
    pool = DEFAULT_DRAFT_POOL_TOKENS if draft_pool_tokens is None else draft_pool_tokens
    worker = Worker(lm, max_queue, metrics, max_batch, context, chunk, span, drafts, cache_mb, pool)
    service = Service(lm, run, worker, names, request_timeout, queue_timeout)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        yield
        await asyncio.to_thread(worker.close)

    app = FastAPI(title="delspec", lifespan=lifespan)
    max_bytes = int((max_body_mb or DEFAULT_MAX_BODY_MB) * 2**20)
    app.add_middleware(BodyLimit, max_bytes=max_bytes)  # inside the counter, which counts 413s
    app.add_middleware(RequestCounter, metrics=metrics, endpoints=ENDPOINTS)
    _add_error_handlers(app)
    _add_routes(app, service, metrics)
    return app


def check_options(
    lm: LoadedModel,
    config: DecodeConfig | None,
    max_queue: int,
    max_batch: int | None,
    context: int | None,
    request_timeout: float,
    queue_timeout: float | None,
    max_body_mb: float | None = None,
    prefill_chunk: int | None = None,
    prompt_cache_mb: float | None = None,
    draft_pool_tokens: int | None = None,
) -> tuple[ResolvedConfig, int, float]:
    """`create_app`'s settings checked (`ConfigError` for the first bad one) and completed:
    the config resolved against `lm`, the context and the queue timeout, defaults filled in."""
    run = resolve(config or DecodeConfig(), lm)
    _ = run.draft_head  # built now: an adapters file that cannot be used fails here, not later
    if max_queue < 0:
        raise ConfigError(f"max_queue must be >= 0, got {max_queue}")
    if max_batch is not None and max_batch < 1:
        raise ConfigError(f"max_batch must be >= 1, got {max_batch}")
    if max_body_mb is not None and not 0 < max_body_mb < float("inf"):
        raise ConfigError(f"max_body_mb must be > 0, got {max_body_mb}")
    if prefill_chunk is not None and (not is_integer(prefill_chunk) or prefill_chunk < 1):
        raise ConfigError(f"prefill_chunk must be an integer >= 1, got {prefill_chunk!r}")
    if prompt_cache_mb is not None and (
        isinstance(prompt_cache_mb, bool)
        or not isinstance(prompt_cache_mb, int | float)
        or not 0 <= prompt_cache_mb < float("inf")
    ):
        raise ConfigError(f"prompt_cache_mb must be a number >= 0, got {prompt_cache_mb!r}")
    if draft_pool_tokens is not None and (
        not is_integer(draft_pool_tokens) or draft_pool_tokens < 0
    ):
        raise ConfigError(f"draft_pool_tokens must be an integer >= 0, got {draft_pool_tokens!r}")
    queue_timeout = request_timeout if queue_timeout is None else queue_timeout
    if request_timeout <= 0 or queue_timeout <= 0:
        raise ConfigError(
            f"timeouts must be > 0 seconds, got {request_timeout} and {queue_timeout}"
        )
    limit = lm.model.config.max_position
    context = min(limit, DEFAULT_CONTEXT) if context is None else context
    if not 2 <= context <= limit:
        raise ConfigError(f"context must be 2..{limit} (the model's), got {context}")
    return run, context, queue_timeout


class BodyLimit:
    """ASGI middleware: a request whose body is more than `max_bytes` gets 413 (an OpenAI error
    object) without the body being read whole: at once when its Content-Length says so, else as
    soon as the bytes received pass the limit (a chunked body). The application then sees the
    client disconnect, and what it would answer is dropped; the server discards the rest of the
    body as it arrives."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        received, refused = 0, False

        async def limited_receive() -> dict:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._refuse(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

    async def _refuse(self, scope: dict, receive: Callable, send: Callable) -> None:
        limit = f"{self.max_bytes / 2**20:g} MiB"
        error = APIError(
            413,
            f"the request body is larger than this server's limit of {limit} "
            "(delspec serve --max-body-mb)",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)


def _add_routes(app: FastAPI, service: Service, metrics: Metrics) -> None:
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

    def local_metrics() -> Collector:
        pool = worker.draft_pool
        pooled = 0 if pool is None else len(pool)
        return metrics.current(worker.depth, worker.active, worker.prompt_cache.nbytes, pooled)

    app.state.local_metrics = local_metrics
    app.state.gather_metrics = None  # or async () -> Collector: all replicas' (`server.replicas`)

    @app.get("/metrics")
    async def metrics_text() -> Response:
        gather = app.state.gather_metrics
        return Response(
            generate_latest(await gather() if gather else local_metrics()),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    card = {"id": name, "object": "model", "created": started, "owned_by": "delspec"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        service.check_model(model)  # an alias too: its card is the served model's
        return card

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
    handle(StarletteHTTPException, _http_error)
    handle(Exception, lambda _, exc: as_api_error(exc))


def _http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    """Starlette's and FastAPI's own errors: an unknown route or method, or a body FastAPI
    could not read as JSON for a reason other than its syntax (bytes that are not UTF-8)."""
    if exc.status_code == 400 and isinstance(exc.__cause__, ValueError):
        return APIError(400, f"the request body is not valid JSON: {exc.__cause__}")
    return APIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")

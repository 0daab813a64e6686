"""Request handling behind the routes: validate, queue, wait for the worker, reply."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from delspec.decoding.generate import Prompt, encode_prompt
from delspec.decoding.grammar import Grammar
from delspec.decoding.run import ResolvedConfig, resolve
from delspec.decoding.sampling import Sampling
from delspec.errors import ConfigError
from delspec.server.openai_types import Tool
from delspec.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    Reply,
    as_api_error,
    sse,
)
from delspec.server.structured import (
    CallFilter,
    check_tools,
    conversation,
    format_grammar,
    parse_calls,
    template_takes_tools,
    tool_grammar,
)
from delspec.server.worker import Job, QueueFull, Worker

if TYPE_CHECKING:
    from delspec.weights.loading import LoadedModel

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_POLL_S = 0.25  # how often a waiting request checks whether its client is still there


class _ClientGone(Exception):
    """The client disconnected while its request waited."""


class Service:
    """The request handling behind the routes: validation, queueing, waiting, replying.
    `run`: the server's decoding config, resolved, which a request's `delspec` options update."""

    def __init__(
        self,
        lm: LoadedModel,
        run: ResolvedConfig,
        worker: Worker,
        names: tuple[str, ...],
        request_timeout: float,
        queue_timeout: float,
    ) -> None:
        self.lm, self.run, self.worker = lm, run, worker
        self.name, self.names = names[0], names
        self.request_timeout, self.queue_timeout = request_timeout, queue_timeout
        self.slot_positions = worker.slot_positions  # a request's: its prompt and reply
        # A token never stands for more text than its longest vocabulary entry (4 times that,
        # for normalizers that drop characters): a text longer than the context holds in such
        # tokens is refused without the seconds of tokenizing it.
        longest = max(map(len, lm.tokenizer.get_vocab()), default=1)
        self.max_prompt_chars = 4 * longest * self.slot_positions

    async def chat(self, request: Request, body: ChatCompletionRequest) -> Response:
        self._check_common(body)
        choice = check_tools(body.tools, body.tool_choice)
        tools = body.tools if choice != "none" else None
        text_format = body.response_format is None or body.response_format.type == "text"
        if tools and choice != "auto" and not text_format:
            raise APIError(
                400,
                "response_format cannot be combined with a required or named tool_choice "
                "(the reply is then the call's JSON)",
                param="response_format",
            )
        native = template_takes_tools(self.lm.tokenizer)
        messages, specs = conversation(body.messages, tools, native)
        prompt_ids = await self._encode(messages, "messages", specs)
        self._check_prompt(prompt_ids, "messages", "the conversation")
        limit = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        top = (body.top_logprobs or 0) if body.logprobs else None
        grammar = None
        if tools:
            grammar = await asyncio.to_thread(tool_grammar, self.lm, tools, choice)
        calls = None if not tools else _Calls(tools, grammar is not None)
        return await self._complete(
            request, body, prompt_ids, limit, param, top, chat=True, grammar=grammar, calls=calls
        )

    async def completion(self, request: Request, body: CompletionRequest) -> Response:
        self._check_common(body)
        prompt_ids = await self._encode(body.prompt, "prompt")
        self._check_prompt(prompt_ids, "prompt", "the prompt")
        limit = body.max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
        top = body.logprobs
        return await self._complete(request, body, prompt_ids, limit, "max_tokens", top, chat=False)

    def check_model(self, model: str) -> None:
        """404 unless this server serves `model` (by its name or an alias)."""
        if model not in self.names:
            known = "', '".join(self.names)
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{known}'",
                param="model",
                code="model_not_found",
            )

    def _check_common(self, body: GenerationRequest) -> None:
        if body.model is not None:
            self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise APIError(
                400, "stream_options is only allowed with stream: true", param="stream_options"
            )
        if body.n != 1:
            raise APIError(
                400,
                f"n={body.n} is not supported: this server returns one choice (n=1)",
                param="n",
            )

    def _resolved(self, body: GenerationRequest) -> ResolvedConfig:
        """The server's config updated with the request's `delspec` options, resolved (the
        server's own when it has none). Adapters files are the server's to choose (`delspec
        serve --adapters`): a request may ask for "auto" or "none" only."""
        options = body.delspec or {}
        if options.get("adapters", "auto") not in ("auto", "none", None):
            raise APIError(
                400,
                "delspec.adapters may be 'auto' or 'none'; adapters files are chosen when the "
                "server starts (delspec serve --adapters)",
                param="delspec.adapters",
            )
        if not options:
            return self.run
        try:
            return resolve(self.run.config.updated(**options), self.lm)
        except ConfigError as exc:
            raise APIError(400, str(exc), param="delspec") from exc

    async def _encode(
        self, prompt: Prompt, param: str, tools: list[dict] | None = None
    ) -> list[int]:
        """`encode_prompt` on a worker thread (a long text or chat template must not hold up
        the event loop); a `ConfigError` is a 400 naming request field `param`, and so is a
        text that cannot fit in the context, found before tokenizing it."""
        if isinstance(prompt, str):
            chars = len(prompt)
        else:
            chars = sum(len(m.get("content") or "") for m in prompt if isinstance(m, dict))
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"{'the conversation' if param == 'messages' else 'the prompt'} has {chars} "
                f"characters, more than a context of {self.slot_positions} tokens can hold",
                param=param,
                code="context_length_exceeded",
            )
        try:
            return await asyncio.to_thread(encode_prompt, self.lm, prompt, False, tools)
        except ConfigError as exc:
            raise APIError(400, str(exc), param=param) from exc

    def _check_prompt(self, prompt_ids: list[int], param: str, name: str) -> None:
        """400 unless the prompt of request field `param` (`name` in messages) has tokens
        and leaves room in the context."""
        if not prompt_ids:
            raise APIError(400, f"{name} is empty", param=param)
        if len(prompt_ids) >= self.slot_positions:
            raise APIError(
                400,
                f"{name} has {len(prompt_ids)} tokens but the context is {self.slot_positions} "
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
        grammar: Grammar | None = None,
        calls: _Calls | None = None,
    ) -> Response:
        """Generate and reply, under `grammar` (else the request's `response_format`'s), the
        reply's text read for tool `calls`."""
        shaped = body.response_format is not None and body.response_format.type != "text"
        if grammar is None and shaped:  # off the event loop: a first use reads the vocabulary
            grammar = await asyncio.to_thread(format_grammar, self.lm, body.response_format)
        job = self._submit(body, prompt_ids, limit, limit_param, logprobs, grammar)
        usage = body.stream_options is not None and body.stream_options.include_usage
        reply = Reply(chat, self.name, len(prompt_ids), self.lm.tokenizer, usage)
        streaming = False
        try:
            await self._started(job, request)
            if body.stream:
                streaming = True
                return StreamingResponse(
                    self._stream(job, reply, calls),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                )
            kind, value = await self._next_event(job, request)  # "done" or "error"
            if kind == "error":
                raise as_api_error(value)
            if job.timed_out:
                raise self._timeout_error()
            if calls is not None:
                content, found = parse_calls(value.text, calls.tools, calls.forced)
                return JSONResponse(reply.response(value, found, content))
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
        grammar: Grammar | None,
    ) -> Job:
        """Queue the generation `body` asks for (at most `limit` new tokens, which request
        field `limit_param` set; `logprobs` top tokens per token, or None); 429 when the queue
        is full."""
        if limit is not None and len(prompt_ids) + limit > self.slot_positions:
            raise APIError(
                400,
                f"{limit_param}={limit} after a prompt of {len(prompt_ids)} tokens is more than "
                f"the {self.slot_positions} positions a request may use (delspec serve --context)",
                param=limit_param,
                code="context_length_exceeded",
            )
        run = self._resolved(body)
        sampling = request_sampling(body, self.lm.model.config.vocab_size)
        options = {
            "sampling": sampling,
            "max_new_tokens": limit or self.slot_positions - len(prompt_ids),
            "stop": body.stop,
            "logprobs": logprobs,
            "grammar": grammar,
        }
        deadline = time.monotonic() + self.request_timeout
        loop = asyncio.get_running_loop()
        job = Job(prompt_ids, run, options, body.stream, deadline, loop)
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

    async def _stream(
        self, job: Job, reply: Reply, calls: _Calls | None = None
    ) -> AsyncIterator[str]:
        """Server-sent events: chunks, then `[DONE]`; an error event ends a failed stream.
        With tool `calls`, text that may be a call is held back, and calls come as one chunk
        before the last.

        Starlette cancels this generator when the client disconnects; that stops the job.
        """
        held = None if calls is None else CallFilter(calls.forced)
        try:
            if reply.chat:
                yield sse(reply.opening())
            while True:
                kind, value = await job.events.get()
                if kind == "text":
                    text = value if held is None else held.push(value)
                    if text:
                        yield sse(reply.piece(text))
                elif kind == "error":
                    yield sse(as_api_error(value).body())
                    return
                elif job.timed_out:  # "done", but cut short
                    yield sse(self._timeout_error().body())
                    return
                else:  # "done"
                    finish = None
                    if held is not None:
                        rest, found = held.finish(calls.tools)
                        if rest:
                            yield sse(reply.piece(rest))
                        if found:
                            yield sse(reply.calls_chunk(found))
                            finish = "tool_calls"
                    yield sse(reply.closing(value, finish))
                    if reply.usage:
                        yield sse(reply.usage_chunk(value))
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


@dataclass(frozen=True)
class _Calls:
    """A chat request whose reply may call `tools`: `forced` when the reply is one call's
    JSON (tool_choice "required" or a named function)."""

    tools: list[Tool]
    forced: bool


def request_sampling(body: GenerationRequest, vocab_size: int) -> Sampling:
    """The `Sampling` a request asks for (OpenAI's defaults for the fields it leaves out);
    400 naming `logit_bias` for a token id outside the vocabulary (`Sampling.check_vocabulary`).
    The fields' ranges are checked by the request model."""
    sampling = Sampling(
        1.0 if body.temperature is None else body.temperature,
        body.top_k or 0,
        1.0 if body.top_p is None else body.top_p,
        body.seed,
        min_p=body.min_p or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=body.logit_bias or {},
    )
    try:
        sampling.check_vocabulary(vocab_size)
    except ConfigError as exc:
        raise APIError(400, str(exc), param="logit_bias") from exc
    return sampling

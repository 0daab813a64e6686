"""The OpenAI wire format: request bodies, error objects, and the response objects of a
completion, whole or streamed as server-sent events."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from delspec.decoding.generate import Result, checked_stop
from delspec.decoding.sampling import checked_bias
from delspec.errors import ConfigError, ContextLengthError, DelspecError
from delspec.server.openai_types import ResponseFormat, Tool, ToolCall, ToolChoice


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`: `include_usage` asks for a last chunk with the usage."""

    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share. Types are strict; OpenAI fields that would change the reply
    and are not implemented are refused (`UNSUPPORTED`); other unknown fields are ignored."""

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
    # OpenAI's penalties over the reply's tokens so far, and biases by token id
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # None: 0
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)  # None: 0
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}
    # vLLM's (and llama.cpp's) extensions
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # None: 0 (off)
    repetition_penalty: float | None = Field(default=None, gt=0.0)  # None: 1 (off)
    stream_options: StreamOptions | None = None  # only with stream, as OpenAI
    # delspec's extension: `DecodeConfig` options over the server's (preset, strategy, ...)
    delspec: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None  # text, json_object or json_schema
    # OpenAI fields that are not implemented: refused when given (and not their neutral value)
    audio: Any = None
    modalities: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    @field_validator(
        "audio", "modalities", "functions", "function_call", "prediction",
        "web_search_options", "reasoning_effort",
        mode="before",
    )  # fmt: skip
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return refused(value, info)

    @field_validator("logit_bias")
    @classmethod
    def _token_biases(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        try:
            checked_bias(value or {})
        except ConfigError as exc:  # a 400 naming logit_bias, as every field's
            raise ValueError(str(exc)) from None
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str | list):
            return checked_stop(value)
        raise ValueError("stop must be a string or a list of strings")


# Each refused field's neutral value, which is accepted (and means what the server does anyway).
UNSUPPORTED: dict[str, Any] = {
    "audio": None,
    "modalities": ["text"],
    "tools": [],
    "tool_choice": "none",
    "functions": [],
    "function_call": "none",
    "prediction": None,
    "web_search_options": None,
    "reasoning_effort": None,
    "best_of": 1,
    "echo": False,
    "suffix": None,
}


def refused(value: Any, info: ValidationInfo) -> None:
    """An unsupported field's value: None when it is absent or neutral; else ValueError."""
    if value is None or value == UNSUPPORTED[info.field_name]:
        return None
    raise ValueError(f"{info.field_name} is not supported by this server")


class ChatMessage(BaseModel):
    """One conversation turn; content is text or a list of text parts (or null in an
    assistant's turn that calls tools); a `tool` turn answers the call `tool_call_id`."""

    model_config = ConfigDict(strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _turn(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message may have tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (null only in an assistant's tool calls)")
        return self

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


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)  # newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)  # top tokens per token
    best_of: Any = None  # not implemented: refused unless 1
    echo: Any = None  # not implemented: refused unless false
    suffix: Any = None  # not implemented: refused unless null
    tools: Any = None  # chat only: refused unless []
    tool_choice: Any = None  # chat only: refused unless "none"

    @field_validator("best_of", "echo", "suffix", "tools", "tool_choice", mode="before")
    @classmethod
    def _unsupported_completion(cls, value: Any, info: ValidationInfo) -> Any:
        return refused(value, info)

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: Any) -> Any:
        if isinstance(value, str) or (
            isinstance(value, list) and all(type(t) is int for t in value)
        ):
            return value
        raise ValueError("prompt must be a string or a list of token ids (one prompt per request)")


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
        return _ASCIIJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII characters as \\u escapes: an error message that quotes a request's
    text can always be sent, a lone surrogate in it too (UTF-8 cannot encode one)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def as_api_error(exc: Exception) -> APIError:
    """The error object a generation exception is reported as."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, DelspecError):
        return APIError(400, str(exc))
    return APIError(500, f"internal error: {exc!r}", kind="server_error")


def validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's validation error as a 400 that names the offending field."""
    error = exc.errors()[0]
    path = list(error["loc"][1:])  # drop the leading "body"
    if error["type"] == "json_invalid":
        reason = error.get("ctx", {}).get("error", "invalid JSON")
        where = f" at character {path[0]}" if path else ""
        return APIError(400, f"the request body is not valid JSON: {reason}{where}")
    reason = str(error["msg"]).removeprefix("Value error, ")
    if not path and error["type"] == "missing":
        return APIError(400, "the request body is empty: send a JSON object")
    if not path and isinstance(error.get("input"), bytes):  # not sent as application/json
        try:
            json.loads(error["input"])
        except ValueError as invalid:
            return APIError(400, f"the request body is not valid JSON: {invalid}")
        return APIError(400, "send the request body with Content-Type: application/json")
    if not path:
        return APIError(400, f"the request body must be a JSON object: {reason}")
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    if error["type"] == "missing":
        return APIError(400, f"missing required parameter '{param}'", param=param)
    return APIError(400, f"invalid value for '{param}': {reason}", param=param)


class Reply:
    """Builds the OpenAI response objects of one chat or text completion. Log-probabilities
    (when asked for) come whole with the response, or with a stream's chunk that carries the
    finish reason."""

    def __init__(
        self, chat: bool, model: str, prompt_tokens: int, tokenizer: Any, usage: bool = False
    ) -> None:
        self.chat, self.model, self.prompt_tokens = chat, model, prompt_tokens
        self.tokenizer = tokenizer
        self.usage = usage  # a stream's `stream_options.include_usage`
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def response(
        self, result: Result, calls: list[dict[str, Any]] | None = None, content: str | None = None
    ) -> dict[str, Any]:
        """The whole reply; with tool `calls` (OpenAI's objects), the message carries them and
        `content` (the text apart from them), and the finish reason is "tool_calls"."""
        logprobs = self._logprobs(result)
        finish = "tool_calls" if calls else result.finish_reason
        if not self.chat:
            body = {"text": result.text, "logprobs": logprobs}
        elif calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            body = {"message": message, "logprobs": logprobs}
        else:
            body = {"message": {"role": "assistant", "content": result.text}, "logprobs": logprobs}
        return self._wrap(False, {**body, "finish_reason": finish}, result)

    def calls_chunk(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """A chat stream's chunk of tool calls, each whole (its name and all its arguments)."""
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        return self._wrap(True, {"delta": {"tool_calls": deltas}})

    def opening(self) -> dict[str, Any]:
        """The chat stream's first chunk, which names the role."""
        return self._wrap(True, {"delta": {"role": "assistant", "content": ""}})

    def piece(self, text: str) -> dict[str, Any]:
        return self._wrap(True, self._delta(text))

    def closing(self, result: Result, finish: str | None = None) -> dict[str, Any]:
        """The chunk that ends the choice: finish reason (the result's unless `finish`),
        log-probabilities and delspec statistics."""
        choice = {**self._delta(None), "finish_reason": finish or result.finish_reason}
        choice["logprobs"] = self._logprobs(result)
        return self._wrap(True, choice, result)

    def usage_chunk(self, result: Result) -> dict[str, Any]:
        """A stream's last chunk when `usage` was asked for: no choices, the usage (OpenAI's
        `stream_options.include_usage`)."""
        chunk = self._wrap(True, {})
        chunk["choices"] = []
        chunk["usage"] = self._usage(result)
        return chunk

    def _usage(self, result: Result) -> dict[str, Any]:
        """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens whose cache
        entries were reused (the server's prompt cache), not computed."""
        completion = len(result.token_ids)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": result.stats.cached_tokens},
        }

    def _delta(self, text: str | None) -> dict[str, Any]:
        if self.chat:
            return {"delta": {} if text is None else {"content": text}}
        return {"text": text or "", "logprobs": None}

    def _logprobs(self, result: Result) -> dict[str, Any] | None:
        """OpenAI's log-probability object of the generated tokens (chat or completions)."""
        if result.logprobs is None:
            return None
        tokens = result.token_ids[: len(result.logprobs)]
        names = [self._token(t) for t in tokens]
        if self.chat:
            content = []
            for name, (value, top) in zip(names, result.logprobs, strict=True):
                best = [self._entry(self._token(t), v) for t, v in top]
                content.append({**self._entry(name, value), "top_logprobs": best})
            return {"content": content}
        offsets, at = [], 0
        for name in names:
            offsets.append(at)
            at += len(name)
        return {
            "tokens": names,
            "token_logprobs": [value for value, _ in result.logprobs],
            "top_logprobs": [{self._token(t): v for t, v in top} for _, top in result.logprobs],
            "text_offset": offsets,
        }

    def _token(self, token: int) -> str:
        return self.tokenizer.decode([token])

    @staticmethod
    def _entry(name: str, value: float) -> dict[str, Any]:
        return {"token": name, "logprob": value, "bytes": list(name.encode())}

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
        if chunk and self.usage:
            out["usage"] = None  # in every chunk but the last, as OpenAI's
        elif not chunk and result is not None:
            out["usage"] = self._usage(result)
        if result is not None:
            stats = result.stats
            out["delspec"] = {
                "strategy": result.strategy,
                "acceptance_rate": _rounded(stats.acceptance_rate, 4),
                "mean_exit_layer": _rounded(stats.mean_exit_layer, 3),
                "tokens_per_s": round(stats.tokens_per_s, 3),
            }
        return out


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def sse(data: dict[str, Any] | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"

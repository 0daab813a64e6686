"""The OpenAI-compatible server over real HTTP: each app runs in a uvicorn server on a free local
port, in a background thread of the test process. Every network call has a timeout. `smollm2`
is the session fixture of conftest.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from helpers import (
    CHAT,
    CUT_OFF_PROMPTS,
    MESSAGES,
    TEXT,
    TIMEOUT,
    answer,
    assert_error,
    sse,
    tiny_lm,
    wait_until,
)
from openai.types.chat import ChatCompletion

from delspec.decode_config import DEFAULT_STRATEGY, DecodeConfig
from delspec.decoding.generate import generate
from delspec.decoding.sampling import Sampling
from delspec.errors import ConfigError
from delspec.server import create_app, serve
from delspec.server import serving as running
from delspec.weights.loading import LoadedModel

PLAIN = {"delspec": {"strategy": "ar"}}


@pytest.fixture(scope="module")
def reference(smollm2: LoadedModel) -> LoadedModel:
    """The tiny model for direct `generate` calls, apart from the one a server uses."""
    return tiny_lm(smollm2)


@pytest.fixture(scope="module")
def tiny_url(smollm2: LoadedModel) -> Iterator[str]:
    with running(create_app(tiny_lm(smollm2))) as url:
        yield url


@pytest.mark.slow
def test_openai_client_streams_and_matches_autoregressive(smollm2: LoadedModel) -> None:
    n = 12
    prompt = "The capital of France is"
    expect_chat = generate(smollm2, MESSAGES, strategy="ar", max_new_tokens=n)
    expect_text = generate(smollm2, prompt, strategy="ar", max_new_tokens=n)
    with running(create_app(smollm2)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT)
        [model] = client.models.list().data
        assert model.id == smollm2.name
        args: dict[str, Any] = dict(model=model.id, max_tokens=n, temperature=0)

        chat = client.chat.completions.create(messages=MESSAGES, **args)
        assert chat.choices[0].message.content == expect_chat.text
        assert chat.choices[0].finish_reason == expect_chat.finish_reason
        prompt_tokens = expect_chat.stats.prompt_tokens
        assert chat.usage.prompt_tokens == prompt_tokens
        assert chat.usage.completion_tokens == len(expect_chat.token_ids)
        assert chat.usage.total_tokens == prompt_tokens + len(expect_chat.token_ids)
        stats = chat.model_extra["delspec"]
        assert stats["strategy"] == DEFAULT_STRATEGY
        assert {"acceptance_rate", "mean_exit_layer", "tokens_per_s"} <= set(stats)

        usage = {"include_usage": True}
        chunks = list(
            client.chat.completions.create(
                messages=MESSAGES, stream=True, stream_options=usage, **args
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == expect_chat.text
        assert chunks[-2].choices[0].finish_reason == expect_chat.finish_reason
        assert chunks[-2].model_extra["delspec"]["strategy"] == DEFAULT_STRATEGY
        assert chunks[-1].choices == []
        assert chunks[-1].usage.completion_tokens == len(expect_chat.token_ids)

        text = client.completions.create(prompt=prompt, **args)
        assert text.choices[0].text == expect_text.text
        assert text.usage.completion_tokens == len(expect_text.token_ids)
        chunks = list(client.completions.create(prompt=prompt, stream=True, **args))
        assert "".join(c.choices[0].text for c in chunks) == expect_text.text
        assert chunks[-1].choices[0].finish_reason == expect_text.finish_reason


def test_concurrent_clients_get_their_own_answers(tiny_url: str, reference: LoadedModel) -> None:
    n = 20
    prompts = [f"Request {i}: tell me about the number {i}." for i in range(8)]
    chats = [i % 4 >= 2 for i in range(8)]
    expected = [
        generate(reference, p, chat=c, strategy="ar", max_new_tokens=n)
        for p, c in zip(prompts, chats, strict=True)
    ]

    def ask(i: int) -> tuple[str, str]:
        body: dict[str, Any] = {"max_tokens": n, "temperature": 0, "stream": i % 2 == 1}
        if chats[i]:
            body["messages"] = [{"role": "user", "content": prompts[i]}]
            return answer(tiny_url, CHAT, body)
        return answer(tiny_url, TEXT, {**body, "prompt": prompts[i]})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert answers == [(e.text, e.finish_reason) for e in expected]


def test_stop_strings_and_sampling_options(tiny_url: str, reference: LoadedModel) -> None:
    prompt = "Hello there"
    full = generate(reference, prompt, strategy="ar", max_new_tokens=12).text
    stop = full[len(full) // 2 :][:3]
    cut = generate(reference, prompt, strategy="ar", max_new_tokens=12, stop=[stop])
    assert cut.finish_reason == "stop" and stop not in cut.text
    options = {"temperature": 0.9, "top_p": 0.9, "seed": 7}
    sampled = generate(reference, prompt, sampling=Sampling(**options), max_new_tokens=12)
    for stream in (False, True):
        body = {"prompt": prompt, "max_tokens": 12, "stream": stream}
        greedy = {**body, "temperature": 0, "stop": stop}
        assert answer(tiny_url, TEXT, greedy) == (cut.text, "stop")
        assert answer(tiny_url, TEXT, {**body, **options}) == (sampled.text, sampled.finish_reason)


SEEDED = {"temperature": 1.5, "seed": 3}
# greedy, all token 1000s (a penalty makes 1001 win after a 1000)
REPEATING = {"temperature": 0.0, "logit_bias": {"1000": 100, "1001": 99}}
# Each control, with a value that changes the tiny model's reply after `base` (checked below).
CONTROLS: list[tuple[str, Any, dict[str, Any]]] = [
    ("frequency_penalty", 2.0, REPEATING),
    ("presence_penalty", 2.0, REPEATING),
    ("repetition_penalty", 3.0, REPEATING),
    ("logit_bias", {"1000": 100}, SEEDED),
    ("min_p", 0.5, SEEDED),
]


@pytest.mark.parametrize(("field", "value", "base"), CONTROLS)
def test_sampling_controls_through_the_openai_client(
    tiny_url: str, reference: LoadedModel, field: str, value: Any, base: dict[str, Any]
) -> None:
    """Each control, through the openai client (vLLM's as `extra_body`), gives `generate`'s
    text with the same `Sampling`, and another text than without it."""
    client = openai.OpenAI(base_url=tiny_url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT)
    n = 16

    def expected(prompt: Any, options: dict[str, Any]) -> str:
        sampling = Sampling(**options)  # (it takes JSON's token id strings too)
        return generate(reference, prompt, sampling=sampling, max_new_tokens=n).text

    assert expected(MESSAGES, {**base, field: value}) != expected(MESSAGES, base)
    openai_field = field in ("frequency_penalty", "presence_penalty", "logit_bias")
    args: dict[str, Any] = {field: value} if openai_field else {"extra_body": {field: value}}
    args.update(base)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=n, **args)
    assert chat.choices[0].message.content == expected(MESSAGES, {**base, field: value})
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=n, **args)
    assert text.choices[0].text == expected("Once upon a time", {**base, field: value})


def test_unsupported_fields_at_their_neutral_values_are_accepted(tiny_url: str) -> None:
    neutral = {"modalities": ["text"], "tool_choice": "none", "response_format": {"type": "text"}}
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, **neutral}
    assert httpx.post(tiny_url + CHAT, json=body, timeout=TIMEOUT).status_code == 200
    body = {"prompt": "hi", "max_tokens": 2, "echo": False, "best_of": 1, "suffix": None}
    assert httpx.post(tiny_url + TEXT, json=body, timeout=TIMEOUT).status_code == 200


def test_seeded_sampling_gives_ar_s_text_under_every_strategy_in_a_batch(
    tiny_url: str, reference: LoadedModel
) -> None:
    """Concurrent seeded requests, one per strategy (batched by the server where it can), each
    get the text `ar` gives alone with that seed."""
    strategies = ["ar", "del", "del-fast", "lookup", "static", "dele"]
    prompt, n = "One two three one two three one two", 24
    options = {"temperature": 0.8, "top_p": 0.9, "frequency_penalty": 0.5}
    expected = [
        generate(reference, prompt, strategy="ar", max_new_tokens=n, seed=i, **options).text
        for i in range(len(strategies))
    ]

    def ask(i: int) -> str:
        body = {"prompt": prompt, "max_tokens": n, "seed": i, **options, "stream": i % 2 == 0}
        return answer(tiny_url, TEXT, {**body, "delspec": {"strategy": strategies[i]}})[0]

    with ThreadPoolExecutor(len(strategies)) as pool:
        assert list(pool.map(ask, range(len(strategies)))) == expected


def test_full_queue_answers_429_and_disconnects_free_the_engine(
    smollm2: LoadedModel, reference: LoadedModel
) -> None:
    short = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
    expected = generate(reference, "Hello", strategy="ar", max_new_tokens=4).text
    # one token a round, so that it runs long (context drafts would take it in a few rounds)
    long = {"prompt": "Once upon a time", "max_tokens": 250, "temperature": 0, **PLAIN}
    app = create_app(tiny_lm(smollm2, delay_s=0.01), max_queue=1)
    with running(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        with ThreadPoolExecutor(1) as pool:
            with http.stream("POST", TEXT, json={**long, "stream": True}) as stream:
                assert stream.status_code == 200  # headers come once generation has started
                waiting = pool.submit(httpx.post, url + TEXT, json=short, timeout=TIMEOUT)
                wait_until(lambda: http.get("/health").json()["queue_depth"] == 1)
                full = http.post(TEXT, json=short)
                error = assert_error(full, 429)
                assert error["code"] == "queue_full" and "queue" in error["message"]
                assert full.headers["retry-after"] == "1"
                next(stream.iter_lines())  # the client reads a little, then goes away
            served = waiting.result(timeout=TIMEOUT)
        assert served.status_code == 200 and served.json()["choices"][0]["text"] == expected
        # the long generation was dropped unfinished: only the short one's tokens are counted
        assert "delspec_generated_tokens_total 4.0" in http.get("/metrics").text

        with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
            http.post(TEXT, json=long, timeout=0.5)
        assert http.post(TEXT, json=short).json()["choices"][0]["text"] == expected
        metrics = http.get("/metrics").text
        assert "delspec_generated_tokens_total 8.0" in metrics
        assert f'delspec_requests_total{{endpoint="{TEXT}",status="429"}} 1.0' in metrics


def test_timeouts_answer_503_and_504_and_stop_generation(smollm2: LoadedModel) -> None:
    app = create_app(tiny_lm(smollm2, delay_s=0.01), request_timeout=2.0, queue_timeout=0.5)
    # one token a round, so that it runs long (context drafts would take it in a few rounds)
    long = {"prompt": "Once upon a time", "max_tokens": 250, "temperature": 0, **PLAIN}
    with running(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(http.post, TEXT, json=long)
            wait_until(lambda: http.get("/health").json()["busy"])
            queued = http.post(TEXT, json={**long, "max_tokens": 2})
            error = assert_error(queued, 503)
            assert error["code"] == "queue_timeout" and "0.5 s" in error["message"]
            error = assert_error(slow.result(timeout=TIMEOUT), 504)
            assert error["code"] == "timeout" and "2 s" in error["message"]

        with http.stream("POST", TEXT, json={**long, "stream": True}) as stream:
            events = sse(stream)
        assert events[-1]["error"]["code"] == "timeout" and "[DONE]" not in events
        assert http.post(TEXT, json={**long, "max_tokens": 2}).status_code == 200


BAD_REQUESTS: list[tuple[str, Any, int, str | None, str]] = [
    (CHAT, b'{"messages": [', 400, None, "not valid JSON"),
    (CHAT, b"[1, 2]", 400, None, "JSON object"),
    (CHAT, b'{"messages": "\xff"}', 400, None, "not valid JSON: 'utf-8' codec can't decode"),
    (CHAT, {}, 400, "messages", "missing"),
    (CHAT, {"messages": "hi"}, 400, "messages", "list"),
    (CHAT, {"messages": []}, 400, "messages", "at least 1"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role", "user"),
    (CHAT, {"messages": MESSAGES, "max_tokens": 10**6}, 400, "max_tokens", "context"),
    (
        CHAT,
        {"messages": [{"role": "user", "content": "word " * 300}]},
        400,
        "messages",
        "the conversation has",
    ),
    (CHAT, {"messages": MESSAGES, "stop": ["x", ""]}, 400, "stop", "non-empty"),
    (CHAT, {"messages": MESSAGES, "model": "gpt-4o"}, 404, "model", "gpt-4o"),
    (CHAT, {"messages": MESSAGES, "n": 2}, 400, "n", "n=2"),
    (
        CHAT,
        {"messages": MESSAGES, "tools": [{"type": "function"}]},
        400,
        "tools[0].function",
        "missing",
    ),
    (TEXT, {"prompt": "hi", "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    (CHAT, {"messages": MESSAGES, "audio": {"voice": "x"}}, 400, "audio", "not supported"),
    (CHAT, {"messages": MESSAGES, "modalities": ["audio"]}, 400, "modalities", "not supported"),
    (
        CHAT,
        {"messages": MESSAGES, "response_format": {"type": "json_xml"}},
        400,
        "response_format.type",
        "json_schema",
    ),
    (CHAT, {"messages": MESSAGES, "frequency_penalty": 3}, 400, "frequency_penalty", "2"),
    (CHAT, {"messages": MESSAGES, "presence_penalty": -2.5}, 400, "presence_penalty", "-2"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"5": 101}}, 400, "logit_bias", "[-100, 100]"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"99999": 1}}, 400, "logit_bias", "vocabulary"),
    (CHAT, {"messages": MESSAGES, "min_p": 1.5}, 400, "min_p", "less than or equal to 1"),
    (CHAT, {"messages": MESSAGES, "repetition_penalty": 0}, 400, "repetition_penalty", "0"),
    (TEXT, {"prompt": "hi", "best_of": 2}, 400, "best_of", "not supported"),
    (TEXT, {"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    (TEXT, {"prompt": "hi", "suffix": "end"}, 400, "suffix", "not supported"),
    (TEXT, {"max_tokens": 3}, 400, "prompt", "missing"),
    (TEXT, {"prompt": 5}, 400, "prompt", "string or a list of token ids"),
    (TEXT, {"prompt": ""}, 400, "prompt", "empty"),
    (TEXT, {"prompt": [1, 10**6]}, 400, "prompt", "vocabulary"),
    (TEXT, {"prompt": "word " * 300}, 400, "prompt", "context is 256 tokens"),
    (TEXT, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "greater than or equal to 1"),
    (TEXT, {"prompt": "hi", "max_tokens": "16"}, 400, "max_tokens", "integer"),
    (TEXT, {"prompt": "hi", "temperature": -1}, 400, "temperature", "greater than or equal"),
    (TEXT, {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "number"),
    (TEXT, {"prompt": "hi", "top_p": 0}, 400, "top_p", "greater than 0"),
    (TEXT, {"prompt": "hi", "stop": 5}, 400, "stop", "stop must be"),
    (TEXT, {"prompt": "hi", "stop": ""}, 400, "stop", "stop strings must be non-empty"),
    (TEXT, {"prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    (TEXT, {"prompt": "hi", "delspec": "fast"}, 400, "delspec", "dictionary"),
    (TEXT, {"prompt": "hi", "delspec": {"strategy": "nope"}}, 400, "delspec", "unknown strategy"),
    (TEXT, {"prompt": "hi", "delspec": {"preset": "nope"}}, 400, "delspec", "unknown preset"),
    (TEXT, {"prompt": "hi", "delspec": {"exit_layer": 2}}, 400, "delspec", "'exit_layer'"),
    (TEXT, {"prompt": "hi", "delspec": {"strategy": "del", "omega": 2}}, 400, "delspec", "omega"),
    (
        TEXT,
        {"prompt": "hi", "delspec": {"strategy": "static", "exit_layer": 9}},
        400,
        "delspec",
        "exit layer must be in 1..4",
    ),
    (
        TEXT,
        {"prompt": "hi", "delspec": {"strategy": "static", "exit_layer": "2"}},
        400,
        "delspec",
        "exit_layer must be an integer",
    ),
    (
        TEXT,
        {"prompt": "hi", "delspec": {"adapters": "/etc/hosts"}},
        400,
        "delspec.adapters",
        "chosen when the server starts",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "fragment"), BAD_REQUESTS)
def test_bad_requests_get_openai_errors(
    tiny_url: str, path: str, body: Any, status: int, param: str | None, fragment: str
) -> None:
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        response = httpx.post(tiny_url + path, content=body, headers=headers, timeout=TIMEOUT)
    else:
        response = httpx.post(tiny_url + path, json=body, timeout=TIMEOUT)
    error = assert_error(response, status, param)
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"
    ok = httpx.post(tiny_url + TEXT, json={"prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2


def test_requests_choose_their_decoding_over_the_servers(smollm2: LoadedModel) -> None:
    """`delspec serve --strategy static --exit-layer 2`; a request's `delspec` object updates
    that config (same strategy: its options stay) or replaces it (a preset, another strategy)."""
    body = {"prompt": "Hello there", "max_tokens": 10, "temperature": 0}
    expected = generate(tiny_lm(smollm2), body["prompt"], strategy="ar", max_new_tokens=10)
    config = DecodeConfig("static").updated(exit_layer=2)
    with running(create_app(tiny_lm(smollm2), config=config)) as url:
        for delspec, strategy, exit_layer in [
            (None, "static", 2),
            ({"draft_length": 2}, "static", 2),
            ({"strategy": "static"}, "static", 2),
            ({"strategy": "static", "exit_layer": 3}, "static", 3),
            ({"preset": "paper"}, "del", ...),  # whichever layers DEL chose
            ({"strategy": "ar"}, "ar", None),  # nothing drafted from a layer: no mean
        ]:
            request = body if delspec is None else {**body, "delspec": delspec}
            reply = httpx.post(url + TEXT, json=request, timeout=TIMEOUT).json()
            assert reply["choices"][0]["text"] == expected.text, delspec
            stats = reply["delspec"]
            assert stats["strategy"] == strategy, delspec
            if exit_layer is not ...:
                assert stats["mean_exit_layer"] == exit_layer, delspec


@pytest.mark.parametrize(("strategy", "profiles"), [(DEFAULT_STRATEGY, 1), ("ar", 0)])
def test_decoding_costs_are_measured_as_the_server_starts(
    smollm2: LoadedModel, tmp_path, monkeypatch, strategy: str, profiles: int
) -> None:
    """A server whose decoding prices its rounds measures their costs, thoroughly, before it
    answers (in the first request they held it, and every one queued behind it, for as long);
    one that does not measures nothing."""
    monkeypatch.setenv("DELSPEC_CACHE", str(tmp_path))
    app = create_app(tiny_lm(smollm2), config=DecodeConfig(strategy), max_batch=1)
    stored = list(tmp_path.glob("costs/profile-*.json"))
    assert len(stored) == profiles
    assert all(json.loads(path.read_text())["quick"] is False for path in stored)
    with running(app) as url:  # answered (200) from that profile, not measured again
        answer(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
    assert list(tmp_path.glob("costs/profile-*.json")) == stored


def test_unknown_routes_get_openai_errors(tiny_url: str) -> None:
    assert "/v1/nothing" in assert_error(httpx.get(tiny_url + "/v1/nothing"), 404)["message"]
    assert_error(httpx.get(tiny_url + TEXT), 405)


def test_health_and_metrics(tiny_url: str) -> None:
    httpx.post(tiny_url + TEXT, json={"prompt": "hi", "max_tokens": 8}, timeout=TIMEOUT)
    health = httpx.get(tiny_url + "/health").json()
    assert health == {
        "status": "ok", "model": "tiny", "queue_depth": 0, "active": 0, "max_batch": 1,
        "busy": False,
    }  # fmt: skip
    response = httpx.get(tiny_url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = {
        key: float(value)
        for key, value in (
            line.rsplit(" ", 1) for line in response.text.splitlines() if not line.startswith("#")
        )
    }
    assert samples[f'delspec_requests_total{{endpoint="{TEXT}",status="200"}}'] >= 1
    assert samples["delspec_generated_tokens_total"] >= 1
    assert samples["delspec_tokens_per_second"] > 0
    assert 0 <= samples["delspec_acceptance_rate"] <= 1
    assert samples["delspec_queue_depth"] == 0 and samples["delspec_busy"] == 0
    buckets = [samples[f'delspec_exit_layer_bucket{{le="{e}.0"}}'] for e in (1, 2, 3, 4)]
    assert buckets == sorted(buckets)
    assert samples['delspec_exit_layer_bucket{le="+Inf"}'] == buckets[-1]
    assert samples["delspec_exit_layer_count"] == buckets[-1]
    assert "# TYPE delspec_exit_layer histogram" in response.text


def test_empty_chat_content_is_answered_as_openai_does(tiny_url: str) -> None:
    """OpenAI answers a user message with empty content; the chat template still gives a
    prompt."""
    body = {"messages": [{"role": "user", "content": ""}], "max_tokens": 2, "temperature": 0}
    reply = httpx.post(tiny_url + CHAT, json=body, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text


def test_acceptance_rate_is_null_when_nothing_was_drafted(tiny_url: str) -> None:
    body = {"prompt": "hi", "max_tokens": 4, "temperature": 0}
    plain = httpx.post(tiny_url + TEXT, json={**body, "delspec": {"strategy": "ar"}}).json()
    assert plain["delspec"]["acceptance_rate"] is None
    assert plain["delspec"]["mean_exit_layer"] is None
    options = {"strategy": "static", "exit_layer": 2}
    drafted = httpx.post(tiny_url + TEXT, json={**body, "delspec": options}).json()
    assert 0 <= drafted["delspec"]["acceptance_rate"] <= 1
    assert drafted["delspec"]["mean_exit_layer"] == 2


def test_bodies_past_the_limit_get_413(smollm2: LoadedModel) -> None:
    with running(create_app(tiny_lm(smollm2), max_body_mb=0.5)) as url:
        host, port = url.removeprefix("http://").split(":")
        # Content-Length says too much: 413 before the body is sent
        with socket.create_connection((host, int(port)), timeout=TIMEOUT) as raw:
            raw.sendall(
                f"POST {TEXT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {10 * 2**20}\r\n\r\n".encode()
            )
            reply = b""
            while not reply.endswith(b"}}"):  # the end of the error object
                chunk = raw.recv(65536)
                assert chunk, reply
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply

        def chunks() -> Iterator[bytes]:  # a chunked body, no Content-Length
            yield b'{"prompt": "'
            for _ in range(16):  # 0.63 MiB
                yield b"word " * 2**13
            yield b'"}'

        headers = {"content-type": "application/json"}
        chunked = httpx.post(url + TEXT, content=chunks(), headers=headers, timeout=TIMEOUT)
        error = assert_error(chunked, 413)
        assert error["code"] == "request_too_large" and "0.5 MiB" in error["message"]
        under = {"prompt": "word " * 90_000}  # 0.43 MiB: reaches the prompt check
        assert_error(httpx.post(url + TEXT, json=under, timeout=TIMEOUT), 400, "prompt")
        metrics = httpx.get(url + "/metrics").text
        assert f'delspec_requests_total{{endpoint="{TEXT}",status="413"}} 2.0' in metrics


def test_health_answers_while_clients_send_large_bodies(tiny_url: str) -> None:
    """Large bodies are read and refused off the event loop: health answers all the while."""
    big = {"prompt": "word " * 600_000}  # 3 MB, under the default limit of 4 MiB
    chat = {"messages": [{"role": "user", "content": big["prompt"]}]}
    statuses: list[int] = []

    def send(path: str, body: dict[str, Any]) -> None:
        statuses.append(httpx.post(tiny_url + path, json=body, timeout=TIMEOUT).status_code)

    clients = [
        threading.Thread(target=send, args=a) for a in [(TEXT, big), (TEXT, big), (CHAT, chat)]
    ]
    for client in clients:
        client.start()
    while any(c.is_alive() for c in clients):
        assert httpx.get(tiny_url + "/health", timeout=TIMEOUT).status_code == 200
        time.sleep(0.05)
    for client in clients:
        client.join()
    assert statuses == [400] * 3  # too long for the context, found before tokenizing
    error = assert_error(httpx.post(tiny_url + TEXT, json=big, timeout=TIMEOUT), 400, "prompt")
    assert error["code"] == "context_length_exceeded" and "3000000 characters" in error["message"]


def post_raw(url: str, body: str, **headers: str) -> httpx.Response:
    """POST `body`, JSON text as written (e.g. with a \\ud800 escape that Python's JSON encoders
    would not write), as application/json unless `headers` say otherwise."""
    headers = {"content-type": "application/json", **headers}
    return httpx.post(url, content=body.encode(), headers=headers, timeout=TIMEOUT)


@pytest.mark.parametrize("stream", ["false", "true"])
def test_text_that_is_not_unicode_gets_400_naming_the_field(tiny_url: str, stream: str) -> None:
    chat = f'{{"messages":[{{"role":"user","content":"\\ud800 hi"}}],"stream":{stream}}}'
    error = assert_error(post_raw(tiny_url + CHAT, chat), 400, "messages")
    assert "chat message 0's content is not valid text: '\\ud800'" in error["message"]
    text = f'{{"prompt":"caf\\udce9 au lait","stream":{stream}}}'
    error = assert_error(post_raw(tiny_url + TEXT, text), 400, "prompt")
    assert "the prompt is not valid text" in error["message"]
    stop = f'{{"prompt":"hi","stop":["\\udc00"],"stream":{stream}}}'
    assert "not valid text" in assert_error(post_raw(tiny_url + TEXT, stop), 400, "stop")["message"]
    model = f'{{"prompt":"hi","model":"\\ud800","stream":{stream}}}'
    error = assert_error(post_raw(tiny_url + TEXT, model), 404, "model")
    assert "the model '\ud800' does not exist" in error["message"]  # sent back as it came
    assert httpx.get(tiny_url + "/health").json()["status"] == "ok"


def test_the_openai_client_gets_a_400_for_text_that_is_not_unicode(tiny_url: str) -> None:
    client = openai.OpenAI(base_url=tiny_url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT)
    body = b'{"messages":[{"role":"user","content":"\\ud800 hi"}],"max_tokens":4}'
    with pytest.raises(openai.BadRequestError) as error:
        client.post("/chat/completions", content=body, cast_to=ChatCompletion)
    assert error.value.status_code == 400 and error.value.body["param"] == "messages"
    assert "not valid text" in error.value.body["message"]


@pytest.mark.slow
def test_a_character_the_token_limit_cut_is_left_out_of_answers(smollm2: LoadedModel) -> None:
    expected = [generate(smollm2, p, strategy="ar", max_new_tokens=16) for p in CUT_OFF_PROMPTS]
    with running(create_app(smollm2, config=DecodeConfig("ar"), max_batch=1)) as url:
        for prompt, result in zip(CUT_OFF_PROMPTS, expected, strict=True):
            assert not result.text.endswith("\ufffd")
            for stream in (False, True):
                body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": stream}
                assert answer(url, TEXT, body) == (result.text, "length")


def test_usage_is_streamed_only_when_asked_in_a_last_chunk(tiny_url: str) -> None:
    client = openai.OpenAI(base_url=tiny_url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT)
    args: dict[str, Any] = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": True}
    chat = {"messages": MESSAGES, **args}
    with httpx.stream("POST", tiny_url + CHAT, json=chat, timeout=TIMEOUT) as response:
        assert all("usage" not in event for event in sse(response)[:-1])
    for create, asked in [
        (client.chat.completions.create, {"messages": MESSAGES}),
        (client.completions.create, {"prompt": "Hello"}),
    ]:
        chunks = list(create(**asked, **args, stream_options={"include_usage": True}))
        *choices, last = chunks
        assert all(c.usage is None and len(c.choices) == 1 for c in choices)
        assert choices[-1].choices[0].finish_reason == "length"
        assert last.choices == [] and last.usage.completion_tokens == 4
        assert last.usage.total_tokens == last.usage.prompt_tokens + 4
    body = {"prompt": "hi", "stream_options": {"include_usage": True}}
    assert (
        "stream: true"
        in assert_error(httpx.post(tiny_url + TEXT, json=body), 400, "stream_options")["message"]
    )


def test_a_model_is_retrieved_by_its_id(tiny_url: str) -> None:
    client = openai.OpenAI(base_url=tiny_url + "/v1", api_key="-", max_retries=0, timeout=TIMEOUT)
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.owned_by == "delspec"
    assert model.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError, match="the model 'gpt-4o' does not exist"):
        client.models.retrieve("gpt-4o")


@pytest.mark.parametrize(
    ("body", "content_type", "fragment"),
    [
        ("{bad json", "application/x-www-form-urlencoded", "not valid JSON: Expecting property"),
        ("{bad json", "application/json", "not valid JSON: Expecting property"),
        ("", "application/json", "the request body is empty"),
        ("", "application/x-www-form-urlencoded", "the request body is empty"),
        ('{"prompt": "hi"}', "text/plain", "Content-Type: application/json"),
    ],
)
def test_a_body_that_is_not_json_is_named_so(
    tiny_url: str, body: str, content_type: str, fragment: str
) -> None:
    response = post_raw(tiny_url + TEXT, body, **{"content-type": content_type})
    assert fragment in assert_error(response, 400)["message"]


@pytest.mark.parametrize("port", [-1, 65536, 99999, "8000"])
def test_a_port_outside_the_range_is_a_config_error(reference: LoadedModel, port: Any) -> None:
    with pytest.raises(ConfigError, match=f"port must be an integer in 0..65535, got {port!r}"):
        serve(reference, port=port)

"""The server with several requests generating at once (continuous batching): each answer is
exactly its solo answer whatever it was batched with, clients that vanish free their slots,
per-request strategies, log-probabilities identical under every strategy, model names."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from helpers import (
    CHAT,
    MESSAGES,
    PROMPTS,
    TEXT,
    TIMEOUT,
    answer,
    assert_error,
    sse,
    tiny_lm,
    wait_until,
)

from delspec.bench.serve_load import parse_setups, run_bench_serve
from delspec.decode_config import DELOptions
from delspec.decoding.generate import generate
from delspec.errors import ConfigError
from delspec.server import create_app
from delspec.server import serving as running
from delspec.weights.loading import LoadedModel


@pytest.fixture(scope="module")
def reference(smollm2: LoadedModel) -> LoadedModel:
    return tiny_lm(smollm2)


def request(index: int) -> tuple[str, dict[str, Any]]:
    """A varied request: chat or text, streamed or not, its own length and strategy."""
    prompt = PROMPTS[index % len(PROMPTS)]
    body: dict[str, Any] = {"max_tokens": 6 + 5 * (index % 4), "temperature": 0}
    body["stream"] = index % 2 == 0
    body["delspec"] = {"strategy": ("ar", "del-fast", "static")[index % 3]}
    if index % 3 == 0:
        return CHAT, {**body, "messages": [{"role": "user", "content": prompt}]}
    return TEXT, {**body, "prompt": prompt}


def expected(reference: LoadedModel, path: str, body: dict[str, Any]) -> str:
    prompt = body["messages"] if path == CHAT else body["prompt"]
    return generate(reference, prompt, strategy="ar", max_new_tokens=body["max_tokens"]).text


def test_concurrent_requests_are_batched_and_each_gets_its_solo_answer(
    smollm2: LoadedModel, reference: LoadedModel
) -> None:
    requests = [request(i) for i in range(10)]
    app = create_app(tiny_lm(smollm2, delay_s=0.005), max_batch=4)

    def vanish(url: str) -> None:  # a client that reads a little of a long stream, then leaves
        long = {
            "prompt": "Once upon a time",
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "delspec": {"strategy": "ar"},  # one token a round: it runs long
        }
        with httpx.stream("POST", url + TEXT, json=long, timeout=TIMEOUT) as stream:
            assert stream.status_code == 200
            next(stream.iter_lines())

    with running(app) as url, ThreadPoolExecutor(12) as pool:
        leavers = [pool.submit(vanish, url) for _ in range(2)]
        answers = [pool.submit(answer, url, path, body) for path, body in requests]
        got = [a.result(timeout=TIMEOUT)[0] for a in answers]
        for leaver in leavers:
            leaver.result(timeout=TIMEOUT)
        health = httpx.get(url + "/health").json()
        metrics = httpx.get(url + "/metrics").text
    assert got == [expected(reference, path, body) for path, body in requests]
    assert health["active"] == 0 and health["max_batch"] == 4
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line[0] != "#")
    steps = float(samples["delspec_batch_size_count"])
    alone = float(samples['delspec_batch_size_bucket{le="1.0"}'])
    assert steps > alone  # some steps were batched
    assert float(samples["delspec_time_to_first_token_seconds_count"]) >= len(requests)
    assert "# TYPE delspec_queue_wait_seconds histogram" in metrics


def rows_cost(lm: LoadedModel, per_row_s: float, calls: list[int] | None = None) -> LoadedModel:
    """`lm` with every layer-range call slowed down by `per_row_s` per row (a prefill of n
    rows costing n times a step of one row, as on a real model); each call's rows are appended
    to `calls`."""
    model = lm.model
    run_layers = model.run_layers

    def slow_run_layers(h: Any, *args: Any, **kwargs: Any) -> Any:
        if calls is not None:
            calls.append(h.shape[0])
        time.sleep(per_row_s * h.shape[0])
        return run_layers(h, *args, **kwargs)

    model.run_layers = slow_run_layers
    return lm


def token_times(url: str, body: dict[str, Any], times: list[float]) -> str:
    """Streams `body`; appends the arrival time of each piece of text to `times`."""
    text = ""
    with httpx.stream("POST", url + TEXT, json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                piece = json.loads(line.removeprefix("data: "))["choices"][0]["text"]
                if piece:
                    times.append(time.monotonic())
                    text += piece
    return text


@pytest.mark.parametrize("chunk", [16, 10**6], ids=["chunked", "one pass"])
def test_a_long_prompt_joins_in_chunks_without_stalling_running_streams(
    smollm2: LoadedModel, reference: LoadedModel, chunk: int
) -> None:
    per_row = 0.004  # seconds of model time per row: a one-pass prefill of the long prompt
    long = " ".join(f"item {i}," for i in range(46))  # ~230 tokens: ~0.9 s at once
    assert 200 < len(smollm2.tokenizer.encode(long)) < 240
    calls: list[int] = []  # the rows of each layer-range call
    app = create_app(rows_cost(tiny_lm(smollm2), per_row, calls), max_batch=4, prefill_chunk=chunk)
    streams = [
        {"prompt": p, "max_tokens": 120, "temperature": 0, "stream": True} for p in PROMPTS[:3]
    ]
    joining = {"prompt": long, "max_tokens": 8, "temperature": 0, "stream": True}
    times: list[list[float]] = [[] for _ in streams]
    with running(app) as url, ThreadPoolExecutor(4) as pool:
        running_answers = [
            pool.submit(token_times, url, body, own)
            for body, own in zip(streams, times, strict=True)
        ]
        wait_until(lambda: all(len(own) >= 3 for own in times), TIMEOUT)
        joined = len(calls)
        long_answer = pool.submit(token_times, url, joining, [])
        got = [a.result(timeout=TIMEOUT) for a in [*running_answers, long_answer]]
    assert got == [expected(reference, TEXT, body) for body in [*streams, joining]]
    # what held the running streams up after the join: the longest call between their steps
    longest = max(calls[joined:])
    if chunk == 16:  # a chunk, or a round's verification (a step and its drafts)
        assert longest <= max(chunk, 1 + DELOptions().draft_cap)
    else:  # the whole prompt (over 200 rows) in one call
        assert longest > 100


@pytest.mark.parametrize("chunk", [0, 2.5, True])
def test_the_prefill_chunk_is_a_positive_integer(smollm2: LoadedModel, chunk: Any) -> None:
    with pytest.raises(ConfigError, match="prefill_chunk must be an integer >= 1"):
        create_app(tiny_lm(smollm2), max_batch=1, prefill_chunk=chunk)


def test_log_probabilities_are_the_same_under_every_strategy(smollm2: LoadedModel) -> None:
    with running(create_app(tiny_lm(smollm2))) as url:
        chats, texts = {}, {}
        for strategy in ("ar", "static", "del-fast"):
            options = {"temperature": 0, "max_tokens": 8, "delspec": {"strategy": strategy}}
            chat = httpx.post(
                url + CHAT,
                json={**options, "messages": MESSAGES, "logprobs": True, "top_logprobs": 2},
                timeout=TIMEOUT,
            )
            chats[strategy] = chat.json()["choices"][0]["logprobs"]["content"]
            text = httpx.post(
                url + TEXT, json={**options, "prompt": "Hello", "logprobs": 3}, timeout=TIMEOUT
            )
            texts[strategy] = text.json()["choices"][0]["logprobs"]
        body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, "logprobs": 3}
        with httpx.stream("POST", url + TEXT, json={**body, "stream": True}) as stream:
            events = sse(stream)
        plain = httpx.post(url + TEXT, json={"prompt": "Hello", "max_tokens": 4}, timeout=TIMEOUT)
    assert chats["ar"] == chats["static"] == chats["del-fast"]
    assert texts["ar"] == texts["static"] == texts["del-fast"]
    entry = chats["ar"][0]
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["top_logprobs"][0]["logprob"] == entry["logprob"] <= 0  # greedy: the best one
    assert len(entry["top_logprobs"]) == 2
    text = texts["ar"]
    assert len(text["tokens"]) == len(text["token_logprobs"]) == 8 == len(text["top_logprobs"])
    assert all(len(top) <= 3 for top in text["top_logprobs"])
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["logprobs"] == text
    assert plain.json()["choices"][0]["logprobs"] is None


def test_the_model_may_be_named_as_the_server_was_started(smollm2: LoadedModel) -> None:
    app = create_app(tiny_lm(smollm2), model_name="served", aliases=("tiny", "default"))
    with running(app) as url:
        ids = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        for name in ("served", "tiny", "default"):
            body = {"prompt": "Hi", "max_tokens": 2, "model": name}
            assert httpx.post(url + TEXT, json=body, timeout=TIMEOUT).status_code == 200
        error = assert_error(
            httpx.post(url + TEXT, json={"prompt": "Hi", "model": "other"}), 404, "model"
        )
    assert ids == ["served"]
    assert "'served', 'tiny', 'default'" in error["message"]


HOSTILE: list[tuple[str, Any, str | None]] = [
    (CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', None),  # not UTF-8
    (CHAT, {"messages": MESSAGES, "logprobs": "yes"}, "logprobs"),
    (CHAT, {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),  # without logprobs
    (CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    (TEXT, {"prompt": "Hi", "logprobs": -1}, "logprobs"),
    (TEXT, {"prompt": "Hi", "max_tokens": 250}, "max_tokens"),  # prompt + reply > context
    (TEXT, {"prompt": "Hi", "delspec": {"strategy": "warp"}}, "delspec"),
    (TEXT, {"prompt": [1, 2, 10**9]}, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE)
def test_hostile_requests_get_400_and_others_keep_their_answers(
    smollm2: LoadedModel, reference: LoadedModel, path: str, body: Any, param: str | None
) -> None:
    app = create_app(tiny_lm(smollm2), max_batch=2, context=128)
    good = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "stream": True}
    with running(app) as url, ThreadPoolExecutor(1) as pool:
        honest = pool.submit(answer, url, TEXT, good)
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            response = httpx.post(url + path, content=body, headers=headers, timeout=TIMEOUT)
        else:
            response = httpx.post(url + path, json=body, timeout=TIMEOUT)
        assert_error(response, 400, param)
        assert honest.result(timeout=TIMEOUT)[0] == expected(reference, TEXT, good)


def test_bench_serve_measures_a_running_server(smollm2: LoadedModel, tmp_path) -> None:
    with running(create_app(tiny_lm(smollm2), max_batch=2)) as url:
        runs = run_bench_serve(
            [], [], [1, 3], per_client=2, max_tokens=5, url=url, out=tmp_path, prompts=PROMPTS
        )
    assert [(r.clients, r.requests, r.errors) for r in runs] == [(1, 2, 0), (3, 6, 0)]
    assert all(r.tokens_per_s > 0 and 0 < r.first_token_p50_s <= r.first_token_p95_s for r in runs)
    assert all(o["tokens"] == 5 for r in runs for o in r.outcomes)
    table = (tmp_path / "table.md").read_text()
    assert "| as served (2) | 3 |" in table and "tiny" in table
    assert (tmp_path / "throughput.png").stat().st_size > 0
    assert {s.label for s in parse_setups("ar@1, del-fast")} == {"ar@1", "del-fast"}
    with pytest.raises(ConfigError, match="warp"):
        parse_setups("warp@2")

"""Prompt caching: a prompt that starts with what a cache slot, a running request or the store of
evicted prefixes holds reuses those positions and prefills only the rest, and its tokens are a
cold start's. The library's `Session` (real SmolLM2: the positions it keeps are bit for bit a
cold prefill's), the reuse rule (exact rows, bfloat16 tiles), the store's bound, and the server
through the `openai` client: cached tokens reported and counted, answers equal to a cold
server's, an evicted prefix computed again, a running request's prefix shared."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
import torch
from helpers import TEXT, TIMEOUT, tiny_lm, wait_until
from tiny_models import tiny_model

import delspec
from delspec.decoding.prefix import Held, PrefixStore, restore, reusable
from delspec.errors import ConfigError
from delspec.server import create_app
from delspec.server import serving as running
from delspec.weights.loading import LoadedModel

TURNS = ["Write a short poem about the sea.", "Now one about rain.", "And one about snow."]
SESSION_STRATEGIES = [
    {"strategy": "ar"},
    {"strategy": "del-fast"},
    {"strategy": "del-fast", "int8_draft": True},
    {"strategy": "del"},  # a warm-up over the prompt's last positions: never taken from a cache
    {"strategy": "static", "exit_layer": 8, "draft_length": 3},
    {"strategy": "del-fast", "temperature": 0.8, "top_p": 0.9, "seed": 3},  # the same draws
]


def next_turn(chat: list[dict[str, str]], reply: str, turn: int) -> list[dict[str, str]]:
    return [
        *chat,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": TURNS[turn]},
    ]


@pytest.mark.parametrize("options", SESSION_STRATEGIES, ids=str)
def test_a_session_gives_the_tokens_of_fresh_generate_calls(
    smollm2: LoadedModel, options: dict[str, Any]
) -> None:
    session = delspec.Session(smollm2)
    chat = [{"role": "user", "content": TURNS[0]}]
    for turn in range(1, 3):
        kept = session.generate(chat, max_new_tokens=24, **options)
        cold = delspec.generate(smollm2, chat, max_new_tokens=24, **options)
        assert kept.token_ids == cold.token_ids and kept.text == cold.text
        if turn > 1:  # the conversation so far came from the cache
            assert 0 < kept.stats.cached_tokens < kept.stats.prompt_tokens
        assert cold.stats.cached_tokens == 0
        chat = next_turn(chat, kept.text, turn)


@pytest.mark.parametrize("options", SESSION_STRATEGIES[1:], ids=str)
def test_a_session_keeps_the_bits_a_cold_prefill_caches(
    smollm2: LoadedModel, options: dict[str, Any]
) -> None:
    """What drafting, verifying and committing left in the session's cache is what one prefill
    pass over the same tokens caches: the reason a later prompt may take it."""
    model = smollm2.model
    session = delspec.Session(smollm2)
    prompt = smollm2.tokenizer.encode("def fibonacci(n):\n    ")
    session.generate(prompt, max_new_tokens=40, **options)
    held = list(session.held.tokens)
    assert len(held) > len(prompt)
    if model.on_tiles(len(prompt) - 1):
        pytest.skip("the prompt's rows take bfloat16 tiles here, its reply's do not")
    with torch.inference_mode(), model.scratch_cache(len(held) + 1):
        model.run_layers(model.embed(held), 0, 0, model.num_layers)
        cold = model.cache[:, :, 0, :, : len(held)].clone()
    assert torch.equal(session.cache[:, :, 0, :, : len(held)], cold)


def test_a_session_is_one_models(smollm2: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="another model"):
        delspec.generate(smollm2, "Hi", session=delspec.Session(tiny_lm(smollm2)))


def test_nothing_is_reused_where_rows_are_not_exact(smollm2: LoadedModel) -> None:
    """torch's float kernels give a row other bits in another pass: no position is reused."""
    lm = tiny_lm(smollm2)
    assert not lm.model.rows_exact
    session = delspec.Session(lm)
    first = session.generate("Once upon a time", max_new_tokens=8, strategy="ar")
    again = session.generate("Once upon a time" + first.text + " and", strategy="ar")
    assert again.stats.cached_tokens == 0
    assert (
        again.token_ids == delspec.generate(lm, "Once upon a time" + first.text + " and").token_ids
    )


def test_a_prompt_on_tiles_takes_only_positions_computed_on_tiles(
    smollm2: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prompt of `on_tiles` rows runs all its rows on bfloat16 tiles, others none: a reused
    position must have been computed as the cold prompt would compute it."""
    model = smollm2.model
    monkeypatch.setattr(model, "prompt_tiles_from", 20)
    tokens = list(range(100, 160))
    tiled = Held.of(tokens[:31], tokens, 40, model)  # a 30-row prompt and 10 decoded positions
    plain = Held.of(tokens[:11], tokens, 40, model)  # a 10-row prompt and 30 decoded positions
    assert (tiled.tiled, plain.tiled) == (30, 0)
    assert reusable(tiled, tokens[:51], model) == 30  # on tiles: its prompt's rows only
    assert reusable(tiled, tokens[:12], model) == 0  # not on tiles: none of them
    assert reusable(plain, tokens[:51], model) == 0
    assert reusable(plain, tokens[:12], model) == 11
    assert reusable(plain, [*tokens[:5], 7, *tokens[6:15]], model) == 5  # the first difference


def test_the_store_keeps_its_limit_and_drops_the_least_recent() -> None:
    model = tiny_model(seed=1, dtype=torch.float32, blocks=True)  # compiled: exact rows
    with torch.inference_mode():
        model.setup_cache(64, 2)
        model.cache.normal_()
    assert model.rows_exact
    per_position = model.cache[:, :, 0, :, :1].numel() * model.cache.element_size()
    store = PrefixStore(25 * per_position)
    a, b, c = (Held(tuple(range(k, k + 12))) for k in (0, 100, 200))
    for held in (a, Held(a.tokens[:5]), b, c):  # a's first 5 are in a: kept once
        store.keep(model, 0, held)
        assert store.nbytes <= store.limit
    assert len(store) == 2 and store.best([*b.tokens, 1, 2], model) == (1, 12)
    assert store.best([*a.tokens, 1], model) == (None, 0)  # the least recent left for c
    store.keep(model, 1, Held(tuple(range(50))))  # larger than the limit: not kept
    assert len(store) == 2
    key, n = store.best([*c.tokens[:6], 9], model)
    assert n == 6
    restore(store.take(key), model, 1, n)
    assert torch.equal(model.cache[:, :, 1, :, :n], model.cache[:, :, 0, :, :n])
    assert store.nbytes == 12 * per_position


def test_a_negative_prompt_cache_is_refused(smollm2: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="prompt_cache_mb must be a number >= 0"):
        create_app(tiny_lm(smollm2), prompt_cache_mb=-1)


# The server, through the openai client.


@pytest.fixture(scope="module")
def cached_url(smollm2: LoadedModel) -> Iterator[str]:
    with running(create_app(smollm2, max_batch=2)) as url:
        yield url


@pytest.fixture(scope="module")
def cold_url(smollm2: LoadedModel) -> Iterator[str]:
    """A server whose every answer is a cold start (see `cold`)."""
    with running(create_app(smollm2, max_batch=1, prompt_cache_mb=0)) as url:
        yield url


def cold(url: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    """`body`'s answer from the cold server: its one slot first holds a prompt that shares no
    token with any other here, and it keeps no evicted prefix."""
    flush = {"prompt": "Zebra", "max_tokens": 1}
    assert httpx.post(url + TEXT, json=flush, timeout=TIMEOUT).status_code == 200
    reply = httpx.post(url + path, json=body, timeout=TIMEOUT).json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return reply


def samples(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {
        k: float(v)
        for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[0] != "#")
    }


@pytest.mark.parametrize("strategy", ["ar", "del-fast"])
def test_a_multi_turn_chat_reuses_the_conversation_and_answers_as_a_cold_start(
    cached_url: str, cold_url: str, smollm2: LoadedModel, strategy: str
) -> None:
    client = openai.OpenAI(base_url=cached_url + "/v1", api_key="unused", timeout=TIMEOUT)
    options = {
        "temperature": 0,
        "max_tokens": 24,
        "extra_body": {"delspec": {"strategy": strategy}},
    }
    chat = [{"role": "user", "content": TURNS[0] + f" ({strategy})"}]
    before = samples(cached_url)
    reported = prompt_tokens = 0
    for turn in range(1, 3):
        reply = client.chat.completions.create(model=smollm2.name, messages=chat, **options)
        text, usage = reply.choices[0].message.content, reply.usage
        body = {"messages": chat, "temperature": 0, "max_tokens": 24}
        assert (
            text
            == cold(cold_url, {**body, "delspec": {"strategy": strategy}})["choices"][0]["message"][
                "content"
            ]
        )
        assert text == delspec.generate(smollm2, chat, strategy="ar", max_new_tokens=24).text
        if turn > 1:
            assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
        reported += usage.prompt_tokens_details.cached_tokens
        prompt_tokens += usage.prompt_tokens
        chat = next_turn(chat, text, turn)
    stream = client.chat.completions.create(
        model=smollm2.name,
        messages=chat,
        stream=True,
        stream_options={"include_usage": True},
        **options,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text == delspec.generate(smollm2, chat, strategy="ar", max_new_tokens=24).text
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    reported += usage.prompt_tokens_details.cached_tokens
    prompt_tokens += usage.prompt_tokens
    after = samples(cached_url)
    cached = (
        after["delspec_prompt_cached_tokens_total"] - before["delspec_prompt_cached_tokens_total"]
    )
    prefilled = (
        after["delspec_prompt_prefilled_tokens_total"]
        - before["delspec_prompt_prefilled_tokens_total"]
    )
    assert (cached, prefilled) == (reported, prompt_tokens - reported)


def test_a_completion_that_extends_an_earlier_one_reuses_it(
    smollm2: LoadedModel, cached_url: str, cold_url: str
) -> None:
    client = openai.OpenAI(base_url=cached_url + "/v1", api_key="unused", timeout=TIMEOUT)
    prompt = "A list of the planets of the solar system, in order:"
    first = client.completions.create(
        model=smollm2.name, prompt=prompt, max_tokens=20, temperature=0
    )
    longer = prompt + first.choices[0].text + "\nThe largest of them is"
    reply = client.completions.create(
        model=smollm2.name, prompt=longer, max_tokens=12, temperature=0
    )
    assert reply.usage.prompt_tokens_details.cached_tokens > 0
    body = {"prompt": longer, "max_tokens": 12, "temperature": 0}
    assert reply.choices[0].text == cold(cold_url, body, TEXT)["choices"][0]["text"]


def test_the_prompt_cache_keeps_its_limit_and_an_evicted_prefix_is_computed_again(
    smollm2: LoadedModel, cold_url: str
) -> None:
    """One slot and a store with room for one prefix: A, B, C in turn leave B's in the store
    (C's slot took the place of A's); A again is computed from scratch, C again is reused."""
    cfg = smollm2.model.config
    per_position = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    limit = 48 * per_position  # each prefix below holds 25-40 positions: one fits, two do not
    app = create_app(smollm2, max_batch=1, prompt_cache_mb=limit / 2**20)
    prompts = [
        "Apples grow on trees in orchards across the temperate regions of the world, and",
        "Bicycles are a cheap and healthy way to travel through a busy modern city, because",
        "Cats sleep for most of the day in warm and quiet places around the house, since",
    ]
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT)

        def complete(prompt: str) -> tuple[str, int]:
            reply = client.completions.create(
                model=smollm2.name, prompt=prompt, max_tokens=12, temperature=0
            )
            assert samples(url)["delspec_prompt_cache_bytes"] <= limit
            return reply.choices[0].text, reply.usage.prompt_tokens_details.cached_tokens

        replies = [complete(p)[0] for p in prompts]
        assert samples(url)["delspec_prompt_cache_bytes"] > 0  # B's prefix, kept
        again_a, cached_a = complete(prompts[0] + replies[0] + " so")
        again_c, cached_c = complete(prompts[2] + replies[2] + " so")
    assert cached_a == 0 and cached_c > len(smollm2.tokenizer.encode(prompts[2]))
    for text, prompt in (
        (again_a, prompts[0] + replies[0] + " so"),
        (again_c, prompts[2] + replies[2] + " so"),
    ):
        assert (
            text
            == cold(cold_url, {"prompt": prompt, "max_tokens": 12, "temperature": 0}, TEXT)[
                "choices"
            ][0]["text"]
        )


def test_a_prompt_reuses_the_prefix_of_a_running_request(
    smollm2: LoadedModel, cached_url: str
) -> None:
    """A request that starts with the prompt of one still generating copies its positions."""
    prompt = "Here is a long story about a lighthouse keeper and the storm that changed his life:"
    long = {
        "prompt": prompt,
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "delspec": {"strategy": "ar"},
    }
    started = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", cached_url + TEXT, json=long, timeout=TIMEOUT) as response:
            for _ in response.iter_lines():
                started.set()

    runner = threading.Thread(target=stream)
    runner.start()
    wait_until(started.is_set, TIMEOUT)
    body = {"prompt": prompt + " Once", "max_tokens": 8, "temperature": 0}
    reply = httpx.post(cached_url + TEXT, json=body, timeout=TIMEOUT).json()
    runner.join(TIMEOUT)
    rows = len(smollm2.tokenizer.encode(prompt))
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= rows - 1
    expected = delspec.generate(smollm2, prompt + " Once", strategy="ar", max_new_tokens=8).text
    assert reply["choices"][0]["text"] == expected


def test_concurrent_conversations_get_their_solo_answers(
    smollm2: LoadedModel, cached_url: str
) -> None:
    """Three conversations at once on two slots, each turn after the last: prefixes come from
    slots and the store while others are batched, and every answer is the model's own."""
    topics = ["the moon", "a lighthouse", "autumn leaves"]
    strategies = ["ar", "del-fast", "static"]

    def converse(index: int) -> list[tuple[list[dict[str, str]], str, int, int]]:
        client = openai.OpenAI(base_url=cached_url + "/v1", api_key="unused", timeout=TIMEOUT)
        chat = [{"role": "user", "content": f"Write two lines about {topics[index]}."}]
        turns = []
        for turn in range(1, 3):
            reply = client.chat.completions.create(
                model=smollm2.name, messages=chat, max_tokens=16, temperature=0,
                extra_body={"delspec": {"strategy": strategies[index]}},
            )  # fmt: skip
            text, usage = reply.choices[0].message.content, reply.usage
            cached = usage.prompt_tokens_details.cached_tokens
            turns.append((chat, text, usage.prompt_tokens, cached))
            chat = next_turn(chat, text, turn)
        return turns

    with ThreadPoolExecutor(3) as pool:
        conversations = list(pool.map(converse, range(3)))
    for turns in conversations:
        for chat, text, _, _ in turns:
            assert text == delspec.generate(smollm2, chat, strategy="ar", max_new_tokens=16).text
        (_, _, first_prompt, _), (_, _, _, cached) = turns
        assert cached >= first_prompt  # the first turn's prompt, from a slot or the store

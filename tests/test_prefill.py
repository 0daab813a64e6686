"""Prompts prefilled in chunks (`delspec.decoding.prefill`): the same cache entries, the same
logits and the same tokens as one pass, whatever shares the chunks; the row budget shared out
fairly."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import tiny_model

from delspec.decoding.batch import start_together, step_together
from delspec.decoding.prefill import Prefill, chunk_rows, fair_shares, prefill_chunk
from delspec.decoding.sequence import Decoding
from delspec.kernels.layers import prompt_tiles_ready
from delspec.machine.batching import measured_attention_span
from delspec.model.transformer import Transformer
from delspec.policies import make_policy

LONG = [(7 * i + 3) % 60 + 2 for i in range(150)]
SHORT = [5, 9, 14, 2, 7, 30]


def decoding(model: Transformer, prompt: list[int], slot: int, tokens: int = 12) -> Decoding:
    policy = make_policy("ar", model.num_layers)
    return Decoding(model, prompt, policy, max_new_tokens=tokens, slot=slot)


def first_logits(model: Transformer, d: Decoding) -> torch.Tensor:
    """The full model's logits after the prompt (the decoding's first step, taken)."""
    with torch.inference_mode():
        ids = torch.tensor(d.tokens[-1:])
        position = [len(d.tokens) - 1]
        h = model.run_rows(model.embed(ids), position, [d.slot], 0, model.num_layers)
        return model.head(h)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kind", ["block weights", "block weights, long prompts on tiles", "float64 eager"]
)
def test_chunked_prefill_caches_the_bits_of_one_pass(kind: str) -> None:
    """Compiled layers (block weights): bit for bit, also where the long prompt runs on
    bfloat16 tiles and the short one beside it does not. Eager float64 layers: up to rounding."""
    compiled = kind != "float64 eager"
    tiles = kind.endswith("on tiles")  # heads of 32 values: their attention on tiles too
    model = (
        tiny_model(seed=5, dtype=torch.float32, blocks=True, **({"head_dim": 32} if tiles else {}))
        if compiled
        else tiny_model(seed=5)
    )
    if tiles:
        if not prompt_tiles_ready():
            pytest.skip("no AMX-BF16 tiles on this CPU")
        model.prompt_tiles_from = 20
        assert model.on_tiles(len(LONG) - 1) and not model.on_tiles(len(SHORT) - 1)
    with torch.inference_mode():
        model.setup_cache(200, 3)
    assert (model.compiled_layers() is not None) == compiled
    whole = decoding(model, LONG, 0)
    start_together([whole])
    # slot 1: the long prompt in chunks of 16 rows, shared with a short prompt in slot 2
    chunked, short = decoding(model, LONG, 1), decoding(model, SHORT, 2)
    prefills = [Prefill(chunked), Prefill(short)]
    chunks = 0
    while not all(p.finished for p in prefills):
        prefill_chunk(prefills, 16, span=64.0)
        chunks += 1
    assert chunks > -(-(len(LONG) - 1 + len(SHORT) - 1) // 16)  # fewer rows further on
    rows = len(LONG) - 1
    cache = model.cache
    same = torch.equal if compiled else close  # eager products: a row's bits vary with the rows
    assert same(cache[:, :, 0, :, :rows], cache[:, :, 1, :, :rows])
    assert same(first_logits(model, whole), first_logits(model, chunked))
    while not whole.done:  # and they decode the same tokens, batched with the short one
        step_together([d for d in (whole, chunked, short) if not d.done])
    policy = make_policy("ar", model.num_layers)
    expected = Decoding(model, LONG, policy, max_new_tokens=12).run().token_ids
    assert whole.finish().token_ids == chunked.finish().token_ids == expected
    assert chunked.prefill_s > 0 and short.prefill_s > 0
    if tiles:  # the tiles did run: the 8-bit products cache other bits
        with torch.inference_mode():
            model.run_layers(model.embed(LONG[:-1]), 0, 0, model.num_layers, slot=0)
        assert not torch.equal(cache[:, :, 0, :, :rows], cache[:, :, 1, :, :rows])


def test_fair_shares_let_short_prompts_finish_and_long_ones_progress() -> None:
    assert fair_shares([1000, 10, 0], 256) == [246, 10, 0]
    assert fair_shares([1000, 1000], 256) == [128, 128]
    assert fair_shares([3, 1000, 1000], 256) == [3, 127, 126]
    assert fair_shares([5, 7], 256) == [5, 7]
    assert fair_shares([5, 7], None) == [5, 7]
    assert fair_shares([2, 2, 2], 4) == [2, 1, 1]
    for remaining in ([1000] * 8, [1, 500, 3, 2000], [0, 0]):
        shares = fair_shares(remaining, 100)
        assert sum(shares) == min(100, sum(remaining))
        assert all(0 <= s <= r for s, r in zip(shares, remaining, strict=True))
        fair = 100 // len(remaining)
        assert all(s >= min(r, fair) for s, r in zip(shares, remaining, strict=True))


def test_chunks_take_fewer_rows_further_on_in_a_prompt() -> None:
    model = tiny_model(seed=5)
    with torch.inference_mode():
        model.setup_cache(256, 2)
    long, short = Prefill(decoding(model, LONG, 0)), Prefill(decoding(model, SHORT, 1))
    span = 640.0
    assert chunk_rows([long, short], 128, span) == 128
    long.done_rows = 64
    assert chunk_rows([long, short], 128, span) == int(128 / 1.1)
    assert chunk_rows([long, short], 128) == 128  # rows that cost no more further on
    short.done_rows, long.done_rows = len(SHORT) - 1, 0  # a finished prompt does not count
    assert chunk_rows([long, short], 128, span) == 128
    long.done_rows = 6400
    assert chunk_rows([long], 5, span) == 1  # at least one


def test_the_attention_span_is_measured() -> None:
    """A row far into a prompt costs more than one at its start (attention over the cache):
    the span at which it costs twice as much is finite and positive, and an unmeasurable one
    (no room in the context) is infinite."""
    model = tiny_model(seed=5)
    span = measured_attention_span(model, rows=8, far=256)
    assert span > 0
    assert measured_attention_span(model, rows=8, far=0) == math.inf

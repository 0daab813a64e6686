"""Prompts prefilled in chunks: several sequences' prompts run through every layer at most a
budget of rows at a time, so that other work (a running batch's steps) can go between chunks.

A `Prefill` is one decoding's prompt on its way into its cache slot; `prefill_chunk` runs the
next rows of several at once, the budget shared out fairly (`fair_shares`). The budget is in
rows at the start of a prompt: a row further on attends to more cached positions and costs
more, so a chunk there takes fewer rows (`chunk_rows`, by the attention span measured on the
machine), and every chunk takes about the same time. A compiled layer
computes each row's bits alone (whatever rows run with it, whichever earlier positions are
cached already), so a prompt prefilled in chunks leaves the very cache entries one pass would,
and the sequence then decodes exactly as after one pass.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from delspec.machine.timing import synchronize

if TYPE_CHECKING:
    from delspec.decoding.sequence import Decoding
    from delspec.model.transformer import Transformer


class Prefill:
    """One decoding's prompt (all but its last token, which its first step runs) on its way
    into its cache slot: `begin` is done at creation, `done_rows` rows are cached so far.
    `cached`: the first rows its slot holds already (`delspec.decoding.prefix.reusable`)."""

    def __init__(self, decoding: Decoding, cached: int = 0) -> None:
        self.decoding = decoding
        with torch.inference_mode():  # the cache slots are the engines' (made in inference mode)
            decoding.begin(cached)
        self.done_rows = cached

    @property
    def remaining(self) -> int:
        """Prompt rows still to run through the layers."""
        return len(self.decoding.prompt) - 1 - self.done_rows

    @property
    def finished(self) -> bool:
        """Whether the prompt is cached: the decoding may take its first step."""
        return self.remaining == 0


def fair_shares(remaining: Sequence[int], budget: int | None) -> list[int]:
    """How many of its `remaining` rows each prompt runs in a chunk of at most `budget` rows
    (None: all of them): an equal share each, and what a shorter prompt leaves of its share to
    the longer ones (water-filling, earlier prompts first for the odd rows). A prompt shorter
    than the share finishes in this chunk; every unfinished one gets at least
    `budget // len(remaining)` rows, so none waits behind others indefinitely."""
    if budget is None:
        return list(remaining)
    shares = [0] * len(remaining)
    left = budget
    open_ = [i for i, rows in enumerate(remaining) if rows > 0]
    while left > 0 and open_:
        each = max(1, left // len(open_))
        for i in list(open_):
            take = min(each, remaining[i] - shares[i], left)
            shares[i] += take
            left -= take
            if shares[i] == remaining[i]:
                open_.remove(i)
            if left == 0:
                break
    return shares


def chunk_rows(prefills: Sequence[Prefill], budget: int, span: float = math.inf) -> int:
    """The rows a chunk of `prefills` may take for a `budget` of rows at position 0: fewer the
    further on the furthest unfinished prompt is (a row at position `span` costs twice one at
    0: `measured_attention_span`), at least one."""
    furthest = max((p.done_rows for p in prefills if not p.finished), default=0)
    return max(1, int(budget / (1 + furthest / span)))


@torch.inference_mode()
def prefill_chunk(
    prefills: Sequence[Prefill], budget: int | None = None, span: float = math.inf
) -> None:
    """Run the next rows of `prefills` (on distinct cache slots of one model) through every
    layer: the rows `budget` allows (`chunk_rows` with attention span `span`; None: every
    remaining row), shared by `fair_shares`, in one batched pass for the prompts whose rows run
    on bfloat16 tiles (`Transformer.on_tiles`) and one for the others. Each decoding's
    `prefill_s` gets its rows' share of its pass's time."""
    rows = None if budget is None else chunk_rows(prefills, budget, span)
    shares = fair_shares([p.remaining for p in prefills], rows)
    if not any(shares):
        return
    model = prefills[0].decoding.model
    taking = [(p, rows) for p, rows in zip(prefills, shares, strict=True) if rows]
    for tiles in (False, True):
        part = [(p, n) for p, n in taking if model.on_tiles(len(p.decoding.prompt) - 1) == tiles]
        if part:
            _run_prompt_rows(model, part, tiles)


def _run_prompt_rows(model: Transformer, part: list[tuple[Prefill, int]], tiles: bool) -> None:
    """The next `rows` rows of each (prefill, rows) of `part` through every layer in one pass."""
    start = time.perf_counter()
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for prefill, rows in part:
        first = prefill.done_rows
        ids += prefill.decoding.prompt[first : first + rows]
        positions += range(first, first + rows)
        slots += [prefill.decoding.slot] * rows
    states = model.embed(ids)
    model.run_rows(states, positions, slots, 0, model.num_layers, tiles=tiles)
    synchronize(model.device)
    seconds = time.perf_counter() - start
    for prefill, rows in part:
        prefill.done_rows += rows
        prefill.decoding.prefill_s += seconds * rows / len(ids)

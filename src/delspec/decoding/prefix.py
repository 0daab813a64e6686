"""Cached prompt prefixes: which positions of a KV cache slot a new prompt may take as they are,
and a bounded store of prefixes evicted from slots (least recently used first out).

The contract that makes a reused position exact: a position's cache entries depend on the
tokens up to it and on how its row was computed, nothing else. With the compiled layers
(`Transformer.rows_exact`) a row's bits do not depend on the rows computed with it, so a
position computed in a prompt's prefill, a batched step or a verification holds the bits a
cold prefill of a prompt with the same tokens there would cache. The one other way a row is
computed is on bfloat16 tiles: a prompt of `on_tiles` rows runs all its rows there, decoding
rows never do. So a prompt takes cached positions only when the cold prefill would have
computed them the same way: a prompt on tiles only positions that a prompt's rows computed on
tiles, any other prompt only positions computed without them (`reusable`). On a model whose
rows are not exact (float weights on torch's kernels, GPUs) nothing is reused.

Only the cache entries are reused: everything else a sequence derives from its prompt (its
context-draft index, its draft vocabulary of the prompt's tokens, its sampler, its policy's
warm-up) is built from the whole prompt, as for a cold start, so its tokens are a cold start's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from delspec.model.transformer import Transformer


@dataclass(frozen=True)
class Held:
    """What a cache slot holds: exact entries for `tokens` at positions 0.., the first `tiled`
    of them computed on bfloat16 tiles (a tiled prompt's rows), the others without."""

    tokens: tuple[int, ...] = ()
    tiled: int = 0

    @staticmethod
    def of(prompt: Sequence[int], tokens: Sequence[int], written: int, model: Transformer) -> Held:
        """What a sequence started from `prompt` holds once `written` positions of its
        `tokens` (the prompt and what it committed) are cached."""
        rows = len(prompt) - 1
        tiled = min(written, rows) if model.on_tiles(rows) else 0
        return Held(tuple(tokens[:written]), tiled)


EMPTY = Held()


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def reusable(held: Held, prompt: Sequence[int], model: Transformer) -> int:
    """How many positions of `held` a prompt may take as they are: its leading tokens that
    `held` holds, among the prompt's rows (all but its last token, which its first step runs),
    computed as a cold prefill of the prompt would compute them (see the module docstring)."""
    rows = len(prompt) - 1
    n = common_length(held.tokens, prompt[:rows])
    if not n or not model.rows_exact:
        return 0
    if model.on_tiles(rows):
        return min(n, held.tiled)
    return 0 if held.tiled else n


def copy_positions(model: Transformer, source: int, slot: int, n: int) -> None:
    """Positions 0..n-1 of cache slot `source` copied into slot `slot` (bit for bit)."""
    if n and source != slot:
        with torch.inference_mode():  # the server's slots are inference tensors
            cache = model.cache
            cache[:, :, slot, :, :n].copy_(cache[:, :, source, :, :n])


@dataclass(eq=False)
class Prefix:
    """A prefix kept out of the slots: `held` and its entries `[layers, 2, kv_heads, n, dim]`."""

    held: Held
    entries: Tensor = field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.entries.numel() * self.entries.element_size()


class PrefixStore:
    """Prefixes evicted from cache slots, at most `limit` bytes of entries in all; the least
    recently used leave first, and one larger than `limit` is not kept. A prefix another one
    holds already (a shorter one with the same tokens, computed the same way) is kept once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        self._prefixes: OrderedDict[int, Prefix] = OrderedDict()  # oldest first
        self._next = 0

    def __len__(self) -> int:
        return len(self._prefixes)

    def keep(self, model: Transformer, slot: int, held: Held) -> None:
        """Copy what cache slot `slot` holds (`held`) into the store before it is overwritten."""
        n = len(held.tokens)
        per_position = model.cache[:, :, slot, :, :1].numel() * model.cache.element_size()
        if n and n * per_position <= self.limit:
            with torch.inference_mode():
                self.add(Prefix(held, model.cache[:, :, slot, :, :n].clone()))

    def add(self, prefix: Prefix) -> None:
        """Keep `prefix` as the most recent, unless it is larger than the limit; the least
        recently used leave to make room."""
        if prefix.nbytes > self.limit:
            return
        for key, kept in list(self._prefixes.items()):
            if _covers(kept.held, prefix.held):  # kept already: now the most recent
                self._prefixes.move_to_end(key)
                return
            if _covers(prefix.held, kept.held):
                self.take(key)
        while self.nbytes + prefix.nbytes > self.limit:
            self.take(next(iter(self._prefixes)))
        self._prefixes[self._next] = prefix
        self._next += 1
        self.nbytes += prefix.nbytes

    def best(self, prompt: Sequence[int], model: Transformer) -> tuple[int | None, int]:
        """The key of the kept prefix `prompt` may take most positions of, and how many."""
        best: tuple[int | None, int] = (None, 0)
        for key, prefix in self._prefixes.items():
            n = reusable(prefix.held, prompt, model)
            if n > best[1]:
                best = (key, n)
        return best

    def take(self, key: int) -> Prefix:
        """The kept prefix `key`, out of the store."""
        prefix = self._prefixes.pop(key)
        self.nbytes -= prefix.nbytes
        return prefix


def restore(prefix: Prefix, model: Transformer, slot: int, n: int) -> None:
    """The first `n` positions of `prefix` copied into cache slot `slot` (bit for bit)."""
    with torch.inference_mode():
        model.cache[:, :, slot, :, :n].copy_(prefix.entries[:, :, :, :n])


def _covers(longer: Held, shorter: Held) -> bool:
    """Whether `longer` holds every position of `shorter`, computed the same way."""
    n = len(shorter.tokens)
    return longer.tokens[:n] == shorter.tokens and min(longer.tiled, n) == shorter.tiled

"""The server's prompt cache: what each KV cache slot holds, and where a joining request's
prompt finds the longest prefix it may reuse (`delspec.decoding.prefix` has the rule).

A request is given a free slot. Its prompt's prefix may come from that slot (what its last
request left there: a conversation's next turn), from another slot (a running request's prompt
positions, which never change while it runs), or from the store of prefixes evicted from slots
(`PrefixStore`, `limit` bytes); the entries are copied into its slot bit for bit. A slot's
content about to be overwritten, in part or in whole, goes to the store first.
"""

from __future__ import annotations

from collections.abc import Sequence

from delspec.decoding.prefix import (
    EMPTY,
    Held,
    PrefixStore,
    copy_positions,
    restore,
    reusable,
)
from delspec.model.transformer import Transformer


class PromptCache:
    """What the `slots` cache slots of `model` hold, and the store of evicted prefixes (at most
    `limit` bytes; 0: none kept). Used by the worker thread alone."""

    def __init__(self, model: Transformer, slots: int, limit: int) -> None:
        self.model = model
        self.held = [EMPTY] * slots
        self.used = [0] * slots  # when each slot was last given out (a count), 0: never
        self._uses = 0
        self.store = PrefixStore(limit)
        self._cache_id: int | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the evicted prefixes kept."""
        return self.store.nbytes

    def place(
        self, prompt: Sequence[int], free: Sequence[int], busy: dict[int, Held]
    ) -> tuple[int, int]:
        """A slot of `free` for `prompt`, holding already as many of its first positions as any
        slot or kept prefix can give it: returns (slot, those positions). `busy`: what each
        slot in use holds now (its prompt rows cached so far, or its sequence's positions)."""
        model = self.model
        if not model.rows_exact:  # nothing can be reused, so nothing is kept either
            return free[0], 0
        self._check_cache()
        own = {s: reusable(self.held[s], prompt, model) for s in free}
        here = max(free, key=lambda s: (own[s], -self.used[s]))  # ties: the least recent
        reach = {s: reusable(held, prompt, model) for s, held in busy.items()}
        other = max(reach, key=reach.__getitem__, default=None)
        from_busy = reach.get(other, 0)
        key, from_store = self.store.best(prompt, model)
        if own[here] >= max(from_busy, from_store):
            slot, cached = here, own[here]
            from_busy = from_store = 0
        else:  # written from position 0: the least recently used free slot, empty ones first
            slot = min(free, key=lambda s: (bool(self.held[s].tokens), self.used[s]))
            cached = 0
        kept = self.store.take(key) if key is not None and from_store > from_busy else None
        if len(self.held[slot].tokens) > cached:  # what it would lose goes to the store
            self.store.keep(model, slot, self.held[slot])
        if kept is not None:
            restore(kept, model, slot, from_store)
            cached = from_store
            if from_store < len(kept.held.tokens):  # the rest stays kept
                self.store.add(kept)
        elif from_busy:
            copy_positions(model, other, slot, from_busy)
            cached = from_busy
        self._uses += 1
        self.used[slot] = self._uses
        self.held[slot] = Held.of(prompt, prompt, cached, model)
        return slot, cached

    def release(self, slot: int, held: Held) -> None:
        """The request in `slot` left it holding `held` (EMPTY: unknown, after a failure)."""
        self.held[slot] = held

    def _check_cache(self) -> None:
        """Slots of a cache allocated anew hold nothing."""
        cache = self.model.cache
        cache_id = None if cache is None else cache.data_ptr()
        if cache_id != self._cache_id:
            self.held = [EMPTY] * len(self.held)
            self._cache_id = cache_id

"""A conversation in the library that keeps its KV cache between calls (`Session`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from delspec.decoding.generate import Prompt, Result, generate
from delspec.decoding.prefix import EMPTY, Held, reusable

if TYPE_CHECKING:
    from delspec.decode_config import DecodeConfig
    from delspec.decoding.sequence import Decoding
    from delspec.drafting.draft_pool import DraftPool
    from delspec.weights.loading import LoadedModel


class Session:
    """Generations with `lm` that keep their cache entries: a prompt that starts with the
    tokens of the last one and its reply (the conversation so far and a new message, say)
    prefills only the rest. Every result is token for token what `generate` gives the same
    prompt from a cold start (`delspec.decoding.prefix` says why, and when a position is not
    reused); `result.stats.cached_tokens` says how many prompt tokens were reused.

    The session holds its own cache (one sequence of up to the longest prompt and reply so
    far), apart from the model's, so other generations with `lm` between its calls do not
    disturb it. One call at a time.

    `draft_pool` (a `DraftPool`): every call drafts from it and adds its reply to it, unless a
    call names another (`generate`'s `draft_pool`).
    """

    def __init__(self, lm: LoadedModel, draft_pool: DraftPool | None = None) -> None:
        self.lm = lm
        self.draft_pool = draft_pool
        self.held: Held = EMPTY  # what its cache holds
        self._cache: Tensor | None = None

    def generate(
        self, prompt: Prompt, config: DecodeConfig | None = None, **options: Any
    ) -> Result:
        """`delspec.generate(lm, prompt, config, session=self, **options)`, with the session's
        draft pool unless `options` name one."""
        options.setdefault("draft_pool", self.draft_pool)
        return generate(self.lm, prompt, config, session=self, **options)

    def reset(self) -> None:
        """Forget what the session holds (and free its cache)."""
        self.held, self._cache = EMPTY, None

    @property
    def cache(self) -> Tensor | None:
        """The session's KV cache `[layers, 2, 1, kv_heads, length, head_dim]` (None before its
        first call): positions 0.. hold `held.tokens`' entries."""
        return self._cache

    @property
    def nbytes(self) -> int:
        """Bytes of the session's cache."""
        cache = self._cache
        return 0 if cache is None else cache.numel() * cache.element_size()

    @contextmanager
    def running(self, decoding: Decoding) -> Iterator[int]:
        """Run `decoding` (not started) on the session's cache: yields how many of its prompt's
        positions the cache holds already (never the ones its policy's warm-up scores, which
        the prefill must compute); afterwards the session holds its prompt and what it
        committed. A generation that fails leaves the session holding nothing."""
        model = decoding.model
        rows = len(decoding.prompt) - 1
        cached = min(reusable(self.held, decoding.prompt, model), rows - decoding.warmup_window)
        cached = max(0, cached)
        cache = self._cache_for(decoding, cached)
        self.held = EMPTY  # until the generation ends
        with model.swapped_cache(cache):
            yield cached
            self._cache = model.cache
        self.held = decoding.held()

    def _cache_for(self, decoding: Decoding, cached: int) -> Tensor:
        """A cache of one sequence of at least `decoding.capacity` positions (in inference mode,
        as the engine writes it) whose first `cached` positions are the session's."""
        model, cfg = decoding.model, decoding.model.config
        old = self._cache
        shape = (cfg.num_layers, 2, 1, cfg.num_kv_heads, decoding.capacity, cfg.head_dim)
        fits = old is not None and (old.dtype, old.device, old.shape[:4]) == (
            model.dtype,
            model.device,
            shape[:4],
        )
        if fits and old.shape[4] >= decoding.capacity:
            return old
        # room for a conversation that grows: twice the last length, within the model's context
        length = decoding.capacity
        if fits:
            length = min(cfg.max_position, max(length, 2 * old.shape[4]))
        shape = (*shape[:4], length, shape[5])
        with torch.inference_mode():
            cache = torch.zeros(shape, dtype=model.dtype, device=model.device)
            if fits and cached:
                cache[:, :, :, :, :cached].copy_(old[:, :, :, :, :cached])
        return cache

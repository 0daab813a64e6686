"""Context drafts in a batched step: how many draft tokens each sequence verifies, by cost.

A batched step (`step_together`) streams the weights once for all of its rows, so a row more
costs what the step's measured time per row count says (`measured_batch_seconds`), often far
less than a step of its own. A sequence whose strategy drafts from its context
(`Decoding.proposal`) may add a row for each of its context draft tokens. `BatchDrafts` adds
them one at a time, the likeliest to be accepted first, while the step's expected tokens per
second still grow, and learns from every step how often the j-th draft token of a sequence is
accepted once those before it were, per source of the proposal (the sequence itself, or the
draft pool of earlier replies: `delspec.drafting.draft_pool`).
"""

from __future__ import annotations

import numpy as np

from delspec.drafting.context_drafts import POOL

DRAFT_LIMIT = 8  # context draft tokens a sequence may verify in one batched step


class BatchDrafts:
    """Chooses each batched step's context drafts from `seconds` (a batched step's measured
    seconds by row count; none: no drafts) and decayed acceptance counts per source and draft
    index, which start at `prior` (accepted, rejected) pseudo-counts."""

    def __init__(
        self,
        seconds: dict[int, float],
        limit: int = DRAFT_LIMIT,
        decay: float = 0.95,
        prior: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        self.rows = sorted(seconds)
        self.seconds = [seconds[r] for r in self.rows]
        self.limit = limit if self.rows else 0
        self.decay = decay
        self.accepted = np.full((POOL + 1, limit), prior[0])
        self.seen = np.full((POOL + 1, limit), prior[0] + prior[1])

    def step_seconds(self, rows: int) -> float:
        """A batched step's seconds for `rows` rows: interpolated between the measured counts,
        and beyond the largest at the last measured cost per row."""
        if rows <= self.rows[-1]:
            return float(np.interp(rows, self.rows, self.seconds))
        if len(self.rows) == 1:
            return self.seconds[0] * rows / self.rows[0]
        per_row = (self.seconds[-1] - self.seconds[-2]) / (self.rows[-1] - self.rows[-2])
        return self.seconds[-1] + per_row * (rows - self.rows[-1])

    def choose(
        self, proposals: list[list[int]], sources: list[int] | None = None
    ) -> list[list[int]]:
        """Each sequence's draft: a prefix of its proposal (from `sources[i]`; default: each
        sequence's own), grown one token at a time where the next token most likely to be
        accepted still adds expected tokens per second."""
        if not self.limit:
            return [[] for _ in proposals]
        rates = (self.accepted / self.seen).tolist()  # draft j accepted, once those before were
        rate = [rates[s] for s in sources or [0] * len(proposals)]
        taken, chance = [0] * len(proposals), [1.0] * len(proposals)
        rows, expected = len(proposals), float(len(proposals))
        while True:
            gains = [
                chance[i] * rate[i][taken[i]] if taken[i] < min(len(p), self.limit) else 0.0
                for i, p in enumerate(proposals)
            ]
            best = int(np.argmax(gains))
            gain = gains[best]
            paying = (expected + gain) / self.step_seconds(rows + 1)
            if not gain or paying <= expected / self.step_seconds(rows):
                break
            taken[best] += 1
            chance[best], expected, rows = gain, expected + gain, rows + 1
        return [p[:k] for p, k in zip(proposals, taken, strict=True)]

    def observe(
        self, drafts: list[list[int]], accepted: list[int], sources: list[int] | None = None
    ) -> None:
        """Learn from a step: each sequence drafted `drafts[i]` (from `sources[i]`, default
        its own) and `accepted[i]` of them."""
        if not any(drafts):
            return
        self.accepted *= self.decay
        self.seen *= self.decay
        sources = sources or [0] * len(drafts)
        for draft, count, source in zip(drafts, accepted, sources, strict=True):
            decided = min(count + 1, len(draft))  # accepted ones, then the first rejected
            self.seen[source, :decided] += 1.0
            self.accepted[source, :count] += 1.0

"""The draft pool: context drafts from what was generated before, across sequences.

Agent loops, one extraction instruction over many documents and repeated questions make a
reply repeat long spans of earlier replies that its own sequence does not hold. A `DraftPool`
keeps the newest `max_tokens` tokens of finished replies (each led in by the last tokens of its
prompt, so that a reply's first tokens can be matched from the prompt's end), oldest forgotten
first, and proposes what followed the latest earlier occurrence of the sequence's newest
tokens there. Its proposals are ordinary context drafts (`ContextProposal` with source
`POOL`): the full model verifies them like any draft, so output is unchanged; a policy that
scores context drafts keeps statistics of pool proposals apart from the sequence's own.

Memory: one dictionary entry per stored token and n-gram order; a proposal costs a few
dictionary lookups (`max_ngram - min_ngram + 1` at most), up to `MAX_MATCH` token comparisons
and the tokens it copies. A pool is not thread-safe: one thread adds and proposes (the server's
worker).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from delspec.drafting.context_drafts import MAX_MATCH, NO_PROPOSAL, POOL, ContextProposal
from delspec.errors import ConfigError, is_integer

POOL_MIN_NGRAM = 2  # one shared token says little across unrelated replies
POOL_MAX_NGRAM = 4
LEAD_IN = MAX_MATCH  # prompt tokens stored before each reply


class DraftPool:
    """Up to `max_tokens` tokens of earlier replies (with their lead-ins), indexed by every
    n-gram (n in [min_ngram, max_ngram]) that has a next token in the same reply.

    `add(prompt, reply)` stores a finished reply (forgetting the oldest ones past the bound);
    `propose(recent, limit)` matches the longest suffix of `recent` (the sequence's newest
    tokens, newest last) and proposes up to `limit` tokens that followed its latest stored
    occurrence, never past the end of that reply."""

    def __init__(
        self, max_tokens: int, min_ngram: int = POOL_MIN_NGRAM, max_ngram: int = POOL_MAX_NGRAM
    ) -> None:
        if not is_integer(max_tokens) or max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_tokens, self.min_ngram, self.max_ngram = max_tokens, min_ngram, max_ngram
        self.tokens: list[int] = []  # the stored tokens, oldest first
        self.base = 0  # the position (counted since the pool began) of tokens[0]
        self.ends: list[int] = []  # the end position of each stored reply, oldest first
        # per order n: n-gram -> position of the token that followed its latest occurrence
        self.follows: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, prompt: Sequence[int], reply: Sequence[int]) -> None:
        """Store `reply` led in by the end of `prompt` (nothing if `reply` is empty); forget
        the oldest stored replies until at most `max_tokens` tokens are kept (a reply longer
        than that keeps its newest tokens)."""
        if not reply:
            return
        doc = [*prompt[max(0, len(prompt) - LEAD_IN) :], *reply][-self.max_tokens :]
        while self.tokens and len(self.tokens) + len(doc) > self.max_tokens:
            self._forget_oldest()
        first = self.base + len(self.tokens)
        self.tokens.extend(doc)
        self.ends.append(first + len(doc))
        seq, base = self.tokens, self.base
        for n, table in self.follows.items():
            for at in range(first + n, first + len(doc)):  # `at` follows an n-gram in `doc`
                i = at - base
                table[tuple(seq[i - n : i])] = at

    def _forget_oldest(self) -> None:
        """Drop the oldest stored reply and the index entries that still point into it."""
        end = self.ends.pop(0)
        drop = end - self.base
        seq = self.tokens
        for n, table in self.follows.items():
            for i in range(n, drop):
                key = tuple(seq[i - n : i])
                if table.get(key, end) < end:
                    del table[key]
        del seq[:drop]
        self.base = end

    def propose(self, recent: Sequence[int], limit: int) -> ContextProposal:
        """Up to `limit` tokens that followed the latest stored occurrence of the longest
        suffix of `recent` found (see the class docstring), with how far the match reaches
        back (up to `MAX_MATCH`, within that reply)."""
        if limit < 1 or not self.tokens:
            return NO_PROPOSAL
        at, order = None, 0
        for n in range(min(self.max_ngram, len(recent)), self.min_ngram - 1, -1):
            at = self.follows[n].get(tuple(recent[len(recent) - n :]))
            if at is not None:
                order = n
                break
        if at is None:
            return NO_PROPOSAL
        reply = bisect.bisect_right(self.ends, at)  # the reply `at` lies in
        start = self.ends[reply - 1] if reply else self.base  # where that reply begins
        seq, i = self.tokens, at - self.base
        tokens = seq[i : min(i + limit, self.ends[reply] - self.base)]
        length, floor = order, start - self.base
        while length < min(MAX_MATCH, len(recent)) and i - 1 - length >= floor:
            if seq[i - 1 - length] != recent[-1 - length]:
                break
            length += 1
        return ContextProposal(tokens, length, POOL)

"""Context drafts: tokens proposed by matching a sequence's newest tokens against its own earlier
tokens (prompt lookup, n-gram drafting). They cost no model work; the full model verifies them
like any draft.

`ContextIndex` keeps, for every n-gram of the sequence (n in [min_ngram, max_ngram]), the latest
position where it occurred with a known next token. Appending a token updates it in
O(max_ngram); a proposal costs O(max_ngram) lookups, up to `MAX_MATCH` token comparisons (how
far the match reaches back), plus the tokens it copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

MIN_NGRAM = 1
MAX_NGRAM = 4
MAX_MATCH = 16  # the longest match length a proposal reports
# Where a proposal's tokens come from: the sequence itself, or the pool of what was served
# before (`delspec.drafting.draft_pool`); each source has acceptance statistics of its own.
SEQUENCE, POOL = 0, 1


class ContextProposal(NamedTuple):
    """Draft tokens found in the context, and how many of the sequence's newest tokens matched
    where the first of them was copied from (at least the n-gram order that found it, at most
    `MAX_MATCH`; 0: nothing matched). A long match (a passage being copied) predicts its
    continuation far better than a single shared token does. `source`: `SEQUENCE` or
    `POOL`."""

    tokens: list[int]
    match_length: int
    source: int = SEQUENCE


NO_PROPOSAL = ContextProposal([], 0)


class ContextIndex:
    """The latest earlier occurrence of each n-gram of a token sequence that has a next token.

    `propose(limit)` matches the longest suffix of the sequence (from `max_ngram` down to
    `min_ngram` tokens) and proposes the tokens that followed its latest earlier occurrence;
    when the copy reaches the end of the sequence (a repeating pattern), it matches again on
    the sequence extended by what it proposed, up to `limit` tokens. `propose(limit, after)`
    does the same for the sequence followed by the tokens `after` (a round's drafts, not yet
    committed: their own n-grams are not indexed).
    """

    def __init__(
        self, tokens: Iterable[int] = (), min_ngram: int = MIN_NGRAM, max_ngram: int = MAX_NGRAM
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.tokens: list[int] = []
        # per order n: n-gram -> index of the token that followed its latest occurrence
        self.follows: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append `tokens`: each one becomes the known successor of the n-grams ending just
        before it."""
        seq, follows = self.tokens, self.follows
        for token in tokens:
            i = len(seq)
            for n, table in follows.items():
                if i >= n:
                    table[tuple(seq[i - n : i])] = i
            seq.append(token)

    def propose(self, limit: int, after: Sequence[int] = ()) -> ContextProposal:
        """Up to `limit` tokens that followed the latest earlier occurrence of the longest
        matching suffix of the sequence, extended by `after` (see the class docstring)."""
        if limit < 1:
            return NO_PROPOSAL
        seq = self.tokens
        tail = list(after)  # the tokens after `seq`: `after`, then the proposal
        match_length = 0
        while len(tail) - len(after) < limit:
            start, order = self._match(seq, tail)
            if start is None:
                break
            match_length = match_length or _reach(seq, tail, start, order)
            # copy what followed the match; past the end of `seq`, continue into `tail` itself
            stop = min(len(seq), start + limit - (len(tail) - len(after)))
            tail.extend(seq[start:stop])
        out = tail[len(after) :]
        return ContextProposal(out, match_length) if out else NO_PROPOSAL

    def _match(self, seq: list[int], tail: list[int]) -> tuple[int | None, int]:
        """Where the tokens after the longest suffix of `seq + tail` found in the index start,
        and that suffix's length."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if n > len(seq) + len(tail):
                continue
            if n <= len(tail):
                key = tuple(tail[len(tail) - n :])
            else:
                key = tuple(seq[len(seq) - (n - len(tail)) :]) + tuple(tail)
            start = self.follows[n].get(key)
            if start is not None:
                return start, n
        return None, 0


def _reach(seq: list[int], tail: list[int], start: int, order: int) -> int:
    """How many of the newest tokens of `seq + tail` equal those before `seq[start]` (`order`
    of them are known to), up to `MAX_MATCH`."""
    length = order
    while length < MAX_MATCH and start - 1 - length >= 0:
        back = length - len(tail)  # how far the token sits from the end of `seq`
        newest = tail[-1 - length] if back < 0 else seq[-1 - back]
        if seq[start - 1 - length] != newest:
            break
        length += 1
    return length

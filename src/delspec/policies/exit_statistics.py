"""DEL's per-layer statistics: decayed acceptance counts, confidence sums, alpha, tau and TPL.

Pure arithmetic over candidate exit layers, testable without a model, in numpy: a policy works
on arrays of a few dozen values every round, where each torch operation's fixed cost (several
microseconds) would add up to a good share of a decode step. Where a round touches one row
(`add_to`, `rates`, `position_sums`) it is scalar Python, for the same reason: numpy's fixed
cost per operation. Indices run over the candidate list; the policy maps them to exit layers.
Inputs may be numpy arrays or CPU tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

Array = np.ndarray


def _row(index: int, doc: str) -> property:
    """Row `index` of `ExitStatistics.sums` as an attribute (assigning fills the row)."""

    def get(self: ExitStatistics) -> Array:
        return self.sums[index]

    def put(self: ExitStatistics, values: Any) -> None:
        self.sums[index] = values

    return property(get, put, doc=doc)


class ExitStatistics:
    """Decayed match/mismatch counts (A, B) and confidence sums (S+, S-) per candidate layer,
    and decayed counts of positions after a match (`after_match`) and of those that matched
    too (`continued`), for acceptance given the previous token's. All six are rows of one
    array, `sums`, so that a round's update is a few array operations, not a few per row."""

    matched = _row(0, "A: decayed matches")
    mismatched = _row(1, "B: decayed mismatches")
    confidence_matched = _row(2, "S+: decayed confidence of matched tokens")
    confidence_mismatched = _row(3, "S-: decayed confidence of mismatched tokens")
    after_match = _row(4, "decayed positions right after a match")
    continued = _row(5, "decayed positions right after a match that matched too")

    def __init__(self, num_candidates: int, omega: float = 0.95) -> None:
        self.omega = omega
        self.sums = np.zeros((6, num_candidates))

    def copy(self, weight: float | Array = 1.0) -> ExitStatistics:
        """An independent copy with every count and sum times `weight` (one for all candidates,
        or one per candidate): the same rates, as much evidence as `weight` times these
        positions."""
        twin = ExitStatistics(0, self.omega)
        twin.sums = self.sums * weight
        return twin

    def evidence(self) -> Array:
        """The (decayed) positions each candidate's statistics cover."""
        return self.matched + self.mismatched

    def capped(self, evidence: float) -> ExitStatistics:
        """A `copy` in which no candidate's statistics cover more than `evidence` positions
        (those that covered more scaled down to it): the same rates, no more evidence."""
        covered = self.evidence()
        return self.copy(np.minimum(1.0, evidence / np.maximum(covered, 1e-300)))

    def update(self, match: Any, confidence: Any, valid: Any, rows: Any = None) -> None:
        """Decay, then add one round: `match`/`confidence` are `[rows, positions]`, `valid`
        marks the positions that count (the valid context; `[positions]`, or `[rows, positions]`
        where they differ by row). `rows` selects the candidates observed this round (default:
        all); the others keep their statistics undecayed."""
        match, valid = np.asarray(match, dtype=bool), np.asarray(valid, dtype=bool)
        confidence = np.asarray(confidence, dtype=np.float64)
        hit = match & valid
        counts = np.zeros((6, *match.shape))  # per field, row and position
        counts[0], counts[1] = hit, valid & ~match
        counts[2], counts[3] = confidence * counts[0], confidence * counts[1]
        counts[4, :, :-1] = hit[:, :-1] & valid[..., 1:]  # a match, then a valid neighbour
        counts[5, :, :-1] = counts[4, :, :-1] * match[:, 1:]  # ... that matched too
        self.add(counts.sum(-1), rows)

    def add(self, sums: Any, rows: Any = None) -> None:
        """Decay, then add one round's six sums (`[6, rows]`, in the order of `sums`' rows) for
        the candidates `rows` (default: all); the others keep their statistics undecayed."""
        if rows is None:
            self.sums = self.omega * self.sums + sums
        else:
            rows = np.asarray(rows)
            self.sums[:, rows] = self.omega * self.sums[:, rows] + sums

    def add_to(self, row: int, *rounds: Sequence[float]) -> list[float]:
        """`add` of rounds' six sums (`position_sums`, one list per round, in order: each round
        decays what came before it) for the one candidate `row`, in scalar arithmetic: a policy
        updating a row or two every round would pay numpy's fixed cost per operation several
        times over (a good share of its work in a decode step of a small model). Returns the
        row's six sums after them."""
        omega = self.omega
        sums = self.sums[:, row].tolist()
        for values in rounds:
            sums = [omega * kept + add for kept, add in zip(sums, values, strict=True)]
        self.sums[:, row] = sums
        return sums

    def rates(
        self, row: int, prior: float = 0.0, toward: tuple[float, float | None] = (0.0, None)
    ) -> tuple[float, float]:
        """`alpha(prior)[row]` and `continuation(prior)[row]` of the one candidate `row`, in
        scalar arithmetic (see `add_to`). `toward`: the rates the `prior` pseudo-counts are
        at, for alpha (default 0: unseen misses) and for the continuation (default None: the
        row's alpha)."""
        matched, mismatched, _, _, after_match, continued = self.sums[:, row].tolist()
        total = matched + mismatched + prior
        alpha = (matched + prior * toward[0]) / total if total > 0 else 0.0
        base = alpha if toward[1] is None else toward[1]
        pairs = after_match + prior
        return alpha, (continued + prior * base) / pairs if pairs > 0 else base

    def alpha(self, prior: float = 0.0) -> Array:
        """Estimated acceptance rate A / (A + B + prior); 0 for a layer without data.

        `prior` counts that many unseen mismatches, which keeps a layer seen a few times from
        looking certain. (The reference code turns a layer without data into NaN -> -inf, which
        can make a TPL entry +inf and win the argmax.)
        """
        matched, mismatched = self.sums[:2]
        return matched / np.maximum(matched + mismatched + prior, 1e-300)  # 0 / tiny: 0

    def continuation(self, prior: float = 0.0, alpha: Array | None = None) -> Array:
        """Estimated acceptance of a token right after an accepted one, shrunk towards alpha
        by `prior` pseudo-pairs: (continued + prior * alpha) / (after_match + prior); alpha for a
        layer without such pairs (then tokens count as independent, as in the paper). `alpha`:
        `alpha(prior)`, where the caller has it."""
        alpha = self.alpha(prior) if alpha is None else alpha
        after_match, continued = self.sums[4:]
        total = after_match + prior
        shrunk = (continued + prior * alpha) / np.maximum(total, 1e-300)
        return np.where(total > 0, shrunk, alpha)

    def threshold(self) -> Array:
        """tau: midpoint of the mean confidence of matched and of mismatched shadow tokens.

        A layer that never mismatched takes 0 as its mismatched mean, and one that never matched
        takes 1 as its matched mean. (The reference code gives NaN there, so `q < tau` is never
        true and drafting always runs to the cap.)
        """
        matched, mismatched = self.matched, self.mismatched
        high = np.where(matched > 0, self.confidence_matched / np.maximum(matched, 1e-300), 1.0)
        low = np.where(
            mismatched > 0, self.confidence_mismatched / np.maximum(mismatched, 1e-300), 0.0
        )
        return (high + low) / 2

    def threshold_at(self, row: int) -> float:
        """`threshold()[row]`, in scalar arithmetic (see `add_to`)."""
        matched, mismatched, confidence_matched, confidence_mismatched, _, _ = self.sums[
            :, row
        ].tolist()
        high = confidence_matched / matched if matched > 0 else 1.0
        low = confidence_mismatched / mismatched if mismatched > 0 else 0.0
        return (high + low) / 2


def position_sums(
    match: Sequence[bool], confidence: Sequence[float], valid: Sequence[bool] | None = None
) -> list[float]:
    """The six sums `ExitStatistics.update` adds for one row of positions (`valid`: all by
    default), in the order of `ExitStatistics.sums`' rows, in scalar arithmetic (see
    `ExitStatistics.add_to`)."""
    valid = [True] * len(match) if valid is None else valid
    hit = [bool(m and v) for m, v in zip(match, valid, strict=True)]
    miss = [bool(v and not m) for m, v in zip(match, valid, strict=True)]
    # a match, then a valid neighbour (after_match); ... that matched too (continued)
    after = [h and v for h, v in zip(hit, valid[1:], strict=False)]
    return [
        float(sum(hit)),
        float(sum(miss)),
        float(sum(c for c, h in zip(confidence, hit, strict=True) if h)),
        float(sum(c for c, m in zip(confidence, miss, strict=True) if m)),
        float(sum(after)),
        float(sum(a and m for a, m in zip(after, match[1:], strict=False))),
    ]


def expected_tokens(alpha: Any, draft_lengths: Any, continuation: Any = None) -> Array:
    """`[candidates, lengths]`: the expected tokens of a round drafting d, 1 + a + ... + a^d
    when draft tokens are accepted independently (the paper), or 1 + a (1 + c + ... + c^(d-1))
    when each one after the first is accepted with probability c given its predecessor was."""
    alpha = np.asarray(alpha, dtype=np.float64)
    draft_lengths = np.asarray(draft_lengths)
    top = int(draft_lengths.max()) if draft_lengths.size else 0
    ratio = alpha if continuation is None else np.asarray(continuation, dtype=np.float64)
    powers = ratio[:, None] ** np.arange(top)
    runs = np.concatenate([np.zeros((len(ratio), 1)), powers.cumsum(1)], 1)
    return 1 + alpha[:, None] * runs[:, draft_lengths]


def best_plan(value: Any) -> tuple[int, int]:
    """(row, column) of the first maximum of a `[candidates, lengths]` grid, row-major."""
    value = np.asarray(value)
    flat = int(np.argmax(value))
    return flat // value.shape[1], flat % value.shape[1]

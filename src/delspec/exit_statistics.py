"""DEL's per-layer statistics: decayed acceptance counts, confidence sums, alpha, tau and TPL.

Pure tensor arithmetic over candidate exit layers, testable without a model. Indices run over
the candidate list; the policy maps them to exit layers.
"""

from __future__ import annotations

import torch
from torch import Tensor


class ExitStatistics:
    """Decayed match/mismatch counts (A, B) and confidence sums (S+, S-) per candidate layer,
    and decayed counts of positions after a match (`after_match`) and of those that matched
    too (`continued`), for acceptance given the previous token's."""

    def __init__(self, num_candidates: int, omega: float = 0.95) -> None:
        self.omega = omega
        zeros = torch.zeros(num_candidates, dtype=torch.float64)
        self.matched, self.mismatched = zeros.clone(), zeros.clone()
        self.confidence_matched, self.confidence_mismatched = zeros.clone(), zeros.clone()
        self.after_match, self.continued = zeros.clone(), zeros.clone()

    def copy(self, weight: float = 1.0) -> ExitStatistics:
        """An independent copy with every count and sum times `weight`: the same rates, as
        much evidence as `weight` times these positions."""
        twin = ExitStatistics(0, self.omega)
        for name, values in vars(self).items():
            if isinstance(values, Tensor):
                setattr(twin, name, values * weight)
        return twin

    def update(
        self, match: Tensor, confidence: Tensor, valid: Tensor, rows: Tensor | None = None
    ) -> None:
        """Decay, then add one round: `match`/`confidence` are `[rows, positions]`, `valid`
        marks the positions that count (the valid context). `rows` selects the candidates
        observed this round (default: all); the others keep their statistics undecayed."""
        rows = torch.arange(len(self.matched)) if rows is None else rows
        w = self.omega
        hit = (match & valid).double()
        miss = (~match & valid).double()
        confidence = confidence.double()
        after = match[:, :-1] & valid[:-1] & valid[1:]  # pairs of valid neighbours
        for name, add in (
            ("matched", hit.sum(1)),
            ("mismatched", miss.sum(1)),
            ("confidence_matched", (confidence * hit).sum(1)),
            ("confidence_mismatched", (confidence * miss).sum(1)),
            ("after_match", after.double().sum(1)),
            ("continued", (after & match[:, 1:]).double().sum(1)),
        ):
            values = getattr(self, name)
            values[rows] = w * values[rows] + add

    def alpha(self, prior: float = 0.0) -> Tensor:
        """Estimated acceptance rate A / (A + B + prior); 0 for a layer without data.

        `prior` counts that many unseen mismatches, which keeps a layer seen a few times from
        looking certain. (The reference code turns a layer without data into NaN -> -inf, which
        can make a TPL entry +inf and win the argmax.)
        """
        total = self.matched + self.mismatched + prior
        return torch.where(total > 0, self.matched / total.clamp_min(1e-300), 0.0)

    def continuation(self, prior: float = 0.0) -> Tensor:
        """Estimated acceptance of a token right after an accepted one, shrunk towards alpha
        by `prior` pseudo-pairs: (continued + prior * alpha) / (after_match + prior); alpha for a
        layer without such pairs (then tokens count as independent, as in the paper)."""
        alpha = self.alpha(prior)
        total = self.after_match + prior
        shrunk = (self.continued + prior * alpha) / total.clamp_min(1e-300)
        return torch.where(total > 0, shrunk, alpha)

    def threshold(self) -> Tensor:
        """tau: midpoint of the mean confidence of matched and of mismatched shadow tokens.

        A layer that never mismatched takes 0 as its mismatched mean, and one that never matched
        takes 1 as its matched mean. (The reference code gives NaN there, so `q < tau` is never
        true and drafting always runs to the cap.)
        """
        high = torch.where(
            self.matched > 0, self.confidence_matched / self.matched.clamp_min(1e-300), 1.0
        )
        low = torch.where(
            self.mismatched > 0,
            self.confidence_mismatched / self.mismatched.clamp_min(1e-300),
            0.0,
        )
        return (high + low) / 2


def expected_tokens(
    alpha: Tensor, draft_lengths: Tensor, continuation: Tensor | None = None
) -> Tensor:
    """`[candidates, lengths]`: the expected tokens of a round drafting d, 1 + a + ... + a^d
    when draft tokens are accepted independently (the paper), or 1 + a (1 + c + ... + c^(d-1))
    when each one after the first is accepted with probability c given its predecessor was."""
    top = int(draft_lengths.max()) if draft_lengths.numel() else 0
    ratio = alpha if continuation is None else continuation
    powers = ratio.double()[:, None] ** torch.arange(top, dtype=torch.float64)
    runs = torch.cat([torch.zeros_like(powers[:, :1]), powers.cumsum(1)], 1)
    return 1 + alpha.double()[:, None] * runs[:, draft_lengths]


def best_plan(value: Tensor) -> tuple[int, int]:
    """(row, column) of the first maximum of a `[candidates, lengths]` grid, row-major."""
    flat = int(torch.argmax(value))
    return flat // value.shape[1], flat % value.shape[1]

"""How `del-fast` counts evidence into DEL's per-layer statistics: shadow tokens scored under a
budget (which candidate layers, which positions), the final layer counted from every
verification, and the exit layer's own drafts (all, and those made under the threshold tau).
"""

from __future__ import annotations

import torch
from torch import Tensor

from delspec.policies.exit_statistics import position_sums
from delspec.policies.protocol import Round

WARM_LAYERS = 6  # candidates the warm-up scores under a shadow budget
MIN_POSITIONS = 2  # positions a round scores under a shadow budget, if it scores at all
# how far a counted layer's alpha (at any level) moves from where the plan was last chosen before
# a round that counted only drafts and the final layer chooses again (`_counted`)
RECHOOSE_SHIFT = 0.03


class ShadowScoring:
    """The counting half of `FastDynamicExit` (its plan and bookkeeping are the other): a mixin
    over `DynamicExit`'s statistics (`stats`, `candidates`, `levels`...) and the attributes
    `FastDynamicExit.start` sets (`credit`, `row_cost`, `cursor`, `below`, `final_rows`,
    `chosen_alpha`); it holds no state of its own."""

    def _scope(self, record: Round) -> tuple[Tensor | None, Tensor | None]:
        """Candidate rows and record positions to score this round (None, None: skip)."""
        if self.shadow_budget is not None and not self.in_warmup and record.hidden is None:
            return None, None
        everything = torch.arange(record.targets.shape[0])
        if self.shadow_budget is None:
            return torch.arange(len(self.candidates)), everything
        if self.in_warmup:  # a spread of candidates, the deepest included; rotation adds the rest
            spread = torch.linspace(0, len(self.candidates) - 1, WARM_LAYERS)
            return spread.round().long().unique(), everything
        must = self._must_score()
        least = len(must) + 1  # + one rotating
        cells = int(self.credit / max(self.row_cost, 1e-9))  # (layer, position) pairs affordable
        # Only the valid positions can count: the warm-up's and those whose inputs were all
        # accepted; of those, the first ones the least rows can afford (MIN_POSITIONS at least).
        valid = record.warmup_rows + record.accepted + 1
        positions = everything[: min(valid, max(cells // least, MIN_POSITIONS))]
        count = min(len(self.candidates), max(cells // len(positions), least))
        chosen = dict.fromkeys(must)
        while len(chosen) < count:
            chosen.setdefault(self.cursor)
            self.cursor = (self.cursor + 1) % len(self.candidates)
        return torch.tensor(sorted(chosen)), positions

    @property
    def _final_row(self) -> int | None:
        """The final layer's candidate row, when it is a candidate."""
        return (
            self.candidates.index(self.num_layers) if self.num_layers in self.candidates else None
        )

    def _final_held(self, record: Round, admission: int | None = None) -> list[list[bool]]:
        """Per vocabulary level, whether it holds the target at each position of `record` whose
        inputs were all accepted (`ExitHead.held`, as the head stood at `admission`: by default
        now): where the final layer drafts exactly the target
        (`ExitHead.final_layer_is_full_head`)."""
        start = record.warmup_rows
        targets = record.targets.tolist()[start : start + record.accepted + 1]
        return self.exit_head.held(targets, admission)

    def _count_final_layer(self, rounds: list[list[list[bool]]]) -> bool:
        """Update the final layer from rounds' verifications (`_final_held` of each, in order),
        at no model cost: a level drafts a target there exactly when it holds it. Confidence is
        not computed (counted as 0): the stop under tau does not apply at this layer
        (`keep_drafting`). Returns whether its alpha moved (`_counted`)."""
        counts = [
            [position_sums(held[level], [0.0] * len(held[level])) for held in rounds]
            for level in range(len(rounds[0]))
        ]
        return self._counted(self.final_rows, counts)

    def _counted(self, rows: list[int], counts: list[list[list[float]]]) -> bool:
        """Add rounds' sums (`position_sums`, per row a list of rounds, in order) to statistics
        `rows`; whether the alpha of one of them moved more than `RECHOOSE_SHIFT` from where the
        plan was last chosen. Counted every round, the final layer's alpha moves a little most
        rounds (as a drafting layer's does), and choosing the plan again each time would cost a
        good share of what a final-layer draft saves."""
        moved = False
        for row, rounds in zip(rows, counts, strict=False):
            matched, mismatched, *_ = self.stats.add_to(row, *rounds)
            total = matched + mismatched + self.prior
            alpha = matched / total if total > 0 else 0.0
            moved |= abs(alpha - self.chosen_alpha[row]) > RECHOOSE_SHIFT
        return moved

    def _must_score(self) -> list[int]:
        """Candidate rows a scored round covers under a budget: the exit layer and neighbours."""
        here = self.candidates.index(self.exit_layer)
        return [r for r in (here, here - 1, here + 1) if 0 <= r < len(self.candidates)]

    def _will_score_next(self) -> bool:
        """Under a budget, collect hidden states only for rounds that can afford scoring: the
        rows they must score, plus one rotating, at `MIN_POSITIONS` positions."""
        if self.shadow_budget is None:
            return True
        return self.credit >= self.row_cost * (len(self._must_score()) + 1) * MIN_POSITIONS

    def _score(self, record: Round, rows: Tensor, positions: Tensor) -> None:
        shadow = self._shadow_tokens(record, rows, positions)
        match, targets = shadow.match, shadow.targets
        # A target a vocabulary lacked (before the round admitted it) is a miss there; for the
        # larger ones, would the layer's logit of it beat the smallest vocabulary's best?
        covered = self.exit_head.covered(targets)[: self.levels]  # [levels, positions]
        outside = (~covered[0]).nonzero()[:, 0]
        if self.levels > 1 and len(outside):
            wanted = targets[outside].to(shadow.hidden.device)
            hidden = shadow.hidden[:, outside]
            reach = self.exit_head.token_logits(hidden, shadow.layers, wanted).float()
            match[:, outside] |= (reach >= shadow.top[:, outside]).cpu()
        match = (match[None] & covered[:, None]).flatten(0, 1)
        rows = self._level_rows(rows.tolist())
        self.stats.update(match, shadow.confidence.repeat(self.levels, 1), shadow.valid, rows)

    def _row_of(self, exit_layer: int, level: int) -> int:
        """The statistics row of `exit_layer` at vocabulary `level`."""
        return level * len(self.candidates) + self.candidates.index(exit_layer)

    def _level_rows(self, rows: list[int]) -> list[int]:
        """Statistics rows of candidate rows `rows` at every vocabulary level, level-major."""
        count = len(self.candidates)
        return [level * count + row for level in range(self.levels) for row in rows]

    def _count_drafts(self, record: Round) -> bool:
        """Update the exit layer from the round's drafts: accepted ones, then the first miss;
        each vocabulary level counts the accepted drafts it held. Returns whether its alpha
        moved (`_counted`)."""
        first = record.from_context  # the exit layer's drafts follow the context's
        if record.accepted < first or not record.layer_drafts:
            return False
        accepted = record.accepted - first
        seen = min(accepted + 1, record.layer_drafts)
        held_by = self.exit_head.held(record.drafted[first : first + seen])
        confidence = record.confidences[first : first + seen]
        rows = self._level_rows([self.candidates.index(record.exit_layer)])
        counts = [
            [position_sums([i < accepted and h for i, h in enumerate(held)], confidence)]
            for held in held_by
        ]
        return self._counted(rows, counts)

    def _count_below(self, record: Round) -> bool:
        """Count the round's exit-layer drafts made under tau, and whether each was accepted (up
        to the first miss: whether later ones would have been is not known). Returns whether
        there were any."""
        first = record.from_context
        drafted = record.layer_drafts
        if record.accepted < first:  # the context's drafts missed before the layer's
            return False
        accepted = record.accepted - first
        seen = min(accepted + 1, drafted)
        confidence = record.confidences[first : first + seen]
        under = [c < self.tau_exit for c in confidence]
        if any(under):
            row = self._row_of(record.exit_layer, record.level)
            match = [i < accepted for i in range(seen)]
            self.below.add_to(row, position_sums(match, confidence, under))
        return any(under)

"""Policies with a fixed exit layer: plain AR, static LayerSkip, FS and Draft&Verify (DV)."""

from __future__ import annotations

from delspec.engine import ExitHead, Round
from delspec.errors import ConfigError
from delspec.policies.base import Plan, Policy, check_draft_length


class Autoregressive(Policy):
    """No drafting: one full-model step per round."""

    name = "ar"

    def plan(self) -> Plan:
        return Plan(0, 0)


class Static(Policy):
    """LayerSkip self-speculation with a fixed exit layer and draft length."""

    name = "static"

    def __init__(
        self, num_layers: int, exit_layer: int | None = None, draft_length: int = 6
    ) -> None:
        super().__init__(num_layers)
        self.exit_layer = self.check_exit_layer(
            exit_layer if exit_layer is not None else max(1, num_layers // 4)
        )
        self.draft_length = check_draft_length(draft_length)

    def plan(self) -> Plan:
        return Plan(self.exit_layer, self.draft_length)


class FiniteStateDraft(Static):
    """FS: fixed exit layer; draft length +1 after a fully accepted round, -1 otherwise.

    The length stays within [1, max_draft] and restarts at `draft_length` for every prompt.
    """

    name = "fs"

    def __init__(
        self,
        num_layers: int,
        exit_layer: int | None = None,
        draft_length: int = 6,
        max_draft: int = 18,
    ) -> None:
        super().__init__(num_layers, exit_layer, draft_length)
        self.max_draft = check_draft_length(max_draft, "max draft")
        self.initial = draft_length

    def start(self, exit_head: ExitHead) -> None:
        self.draft_length = self.initial

    def observe(self, record: Round) -> None:
        if not record.drafted:
            return
        full = record.accepted == len(record.drafted)
        self.draft_length = min(self.max_draft, max(1, self.draft_length + (1 if full else -1)))


class DraftAndVerify(Static):
    """DV: fixed exit layer; stop drafting when confidence < an adaptive threshold.

    After each round the acceptance estimate `ar <- b1*ar + (1-b1)*(cumulative acceptance)` moves
    the threshold by `step` toward drafting less (ar < target) or more, smoothed by `b2`. The
    reference code never reset this state between prompts; here it restarts for every prompt,
    and `ar` starts from the first round's acceptance rate.
    """

    name = "dv"

    def __init__(
        self,
        num_layers: int,
        exit_layer: int | None = None,
        threshold: float = 0.6,
        max_draft: int = 18,
        target: float = 0.8,
        step: float = 0.01,
        beta1: float = 0.5,
        beta2: float = 0.9,
    ) -> None:
        super().__init__(num_layers, exit_layer, max_draft)
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"threshold must be in [0, 1], got {threshold}")
        self.initial, self.target, self.step = threshold, target, step
        self.beta1, self.beta2 = beta1, beta2
        self.start(None)

    def start(self, exit_head: ExitHead | None) -> None:
        self.threshold = self.initial
        self.rate: float | None = None
        self.drafted = self.accepted = 0

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.threshold

    def observe(self, record: Round) -> None:
        if not record.drafted:
            return
        self.drafted += len(record.drafted)
        self.accepted += record.accepted
        cumulative = self.accepted / self.drafted
        b1 = self.beta1
        self.rate = cumulative if self.rate is None else b1 * self.rate + (1 - b1) * cumulative
        moved = self.threshold + (self.step if self.rate < self.target else -self.step)
        self.threshold = self.beta2 * self.threshold + (1 - self.beta2) * moved
        record.extra["threshold"] = self.threshold

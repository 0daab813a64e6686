"""Policies with a fixed draft source: plain AR, static LayerSkip, FS, Draft&Verify (DV), and
context lookup."""

from __future__ import annotations

from delspec.decode_config import (
    DVOptions,
    FSOptions,
    LookupOptions,
    NoOptions,
    StaticOptions,
    exit_layer_for,
)
from delspec.drafting.context_drafts import NO_PROPOSAL, ContextProposal
from delspec.drafting.exit_head import ExitHead
from delspec.policies.protocol import Plan, Policy, Round


class Autoregressive(Policy):
    """No drafting: one full-model step per round."""

    name = "ar"
    speculates = False

    def __init__(self, num_layers: int, options: NoOptions) -> None:
        super().__init__(num_layers)

    def plan(self, proposal: ContextProposal = NO_PROPOSAL) -> Plan:
        return Plan(0, 0)


class Static(Policy):
    """LayerSkip self-speculation with a fixed exit layer and draft length."""

    name = "static"

    def __init__(self, num_layers: int, options: StaticOptions) -> None:
        super().__init__(num_layers)
        self.exit_layer = exit_layer_for(options.exit_layer, num_layers)
        self.draft_length = options.draft_length

    def plan(self, proposal: ContextProposal = NO_PROPOSAL) -> Plan:
        return Plan(self.exit_layer, self.draft_length)


class FiniteStateDraft(Static):
    """FS: fixed exit layer; draft length +1 after a fully accepted round, -1 otherwise.

    The length stays within [1, max_draft] and restarts at `draft_length` for every prompt.
    """

    name = "fs"

    def __init__(self, num_layers: int, options: FSOptions) -> None:
        super().__init__(num_layers, options)
        self.max_draft, self.initial = options.max_draft, options.draft_length

    def start(self, exit_head: ExitHead) -> None:
        self.draft_length = self.initial

    def observe(self, record: Round) -> None:
        self.draft_length = next_draft_length(self.draft_length, record, self.max_draft)


def next_draft_length(length: int, record: Round, max_draft: int) -> int:
    """FS's rule: +1 after a fully accepted draft, -1 after a rejection, within [1, max_draft]
    (unchanged after a round without a draft)."""
    if not record.drafted:
        return length
    full = record.accepted == len(record.drafted)
    return min(max_draft, max(1, length + (1 if full else -1)))


class DraftAndVerify(Static):
    """DV: fixed exit layer; stop drafting when confidence < an adaptive threshold.

    After each round the acceptance estimate `ar <- b1*ar + (1-b1)*(cumulative acceptance)` moves
    the threshold by `step` toward drafting less (ar < target) or more, smoothed by `b2`. The
    reference code never reset this state between prompts; here it restarts for every prompt,
    and `ar` starts from the first round's acceptance rate.
    """

    name = "dv"

    def __init__(self, num_layers: int, options: DVOptions) -> None:
        super().__init__(num_layers, StaticOptions(options.exit_layer, options.max_draft))
        self.initial, self.target, self.step = options.threshold, options.target, options.step
        self.beta1, self.beta2 = options.beta1, options.beta2
        self.start(None)

    def start(self, exit_head: ExitHead | None) -> None:
        self.threshold = self.initial
        self.rate: float | None = None
        self.drafted = self.accepted = 0

    def keep_drafting(self, confidence: float) -> bool:
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


class ContextLookup(Policy):
    """`lookup`: drafts only from the context (prompt lookup, `ContextIndex`): up to
    `draft_length` tokens of each round's proposal, a plain step when there is none; with
    `adaptive`, the length follows FS's rule within [1, max_draft]."""

    name = "lookup"

    def __init__(self, num_layers: int, options: LookupOptions) -> None:
        super().__init__(num_layers)
        self.initial, self.adaptive = options.draft_length, options.adaptive
        self.max_draft = options.max_draft if options.adaptive else options.draft_length
        self.context_ngrams = (options.ngram_min, options.ngram_max)
        self.draft_length = self.initial

    @property
    def context_limit(self) -> int:  # type: ignore[override]
        return self.draft_length

    def start(self, exit_head: ExitHead) -> None:
        self.draft_length = self.initial

    def plan(self, proposal: ContextProposal = NO_PROPOSAL) -> Plan:
        return Plan(0, 0, context_drafts=tuple(proposal.tokens[: self.draft_length]))

    def observe(self, record: Round) -> None:
        if self.adaptive:
            self.draft_length = next_draft_length(self.draft_length, record, self.max_draft)

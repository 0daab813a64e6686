"""DEL: Dynamic Exit Layer selection with dynamic draft exiting (and DELE, without the latter).

The paper's rule (arXiv 2504.05598) as its reference implementation runs it, with that code's
quirks fixed. What `del-fast` adds to it is kept apart, in `fast_dynamic_exit`.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from delspec.decode_config import DELOptions
from delspec.drafting.context_drafts import NO_PROPOSAL, ContextProposal
from delspec.drafting.exit_head import ExitHead
from delspec.kernels.scores import top_logsumexp
from delspec.policies.cost_model import LayerCost
from delspec.policies.exit_statistics import ExitStatistics, best_plan, expected_tokens
from delspec.policies.protocol import Plan, Policy, Round


class ShadowTokens(NamedTuple):
    """One round's shadow tokens: each scored layer's greedy token at each scored position.

    `top`, `confidence`, `match`: `[layers, positions]` (the best logit, its probability, and
    whether the token equals the final layer's target); `valid`: `[positions]`, the valid
    context (positions up to u_r, the first mismatch of the round's exit layer).
    """

    layers: list[int]
    hidden: Tensor
    top: Tensor
    confidence: Tensor
    targets: Tensor
    match: Tensor
    valid: Tensor


class DynamicExit(Policy):
    """DEL (arXiv 2504.05598), following the reference implementation, with its quirks fixed.

    Round 0 drafts one token with the first candidate layer and also scores the last `warmup`
    prompt positions. After every round, every candidate layer's states are decoded through the
    exit head ("shadow tokens") in one batched call and compared with the final layer's tokens
    over the valid context. Decayed counts give alpha and tau per layer (`ExitStatistics`); the
    next (E, d*) maximises expected tokens per layer load (TPL), and a draft with E stops once
    its confidence falls below tau_E, or at `draft_cap` tokens. With `dynamic_draft=False` this
    is DELE: exactly d* tokens are drafted.

    Fixes of the reference code: u_r clipping applies in every round (it was skipped after a
    d* = 0 choice); alpha/tau are finite for layers without data (see `ExitStatistics`); drafts
    never run past `max_new_tokens` (the engine caps them); state resets for every prompt.
    One addition follows from the exit head: with the default candidates and a head that drafts
    from the final layer L for less than a plain step (a pruned vocabulary or int8 weights, see
    `ExitHead.cheaper_at_final_layer`), L is a candidate too.
    """

    name = "del"
    collect_hidden = True
    # Draft vocabularies with statistics of their own: the paper has one (`FastDynamicExit`).
    levels = 1

    def __init__(self, num_layers: int, options: DELOptions) -> None:
        super().__init__(num_layers)
        # `start` adds layer L to the default candidates when the head drafts it cheaply.
        self.base_candidates = options.exit_layers(num_layers)
        self.may_add_final_layer = options.candidates is None
        self.omega, self.draft_cap = options.omega, options.draft_cap
        self.warmup_window, self.dynamic_draft = options.warmup, options.dynamic_draft
        self.draft_lengths = np.arange(options.gamma_min, options.gamma_max)
        # d* caps the draft in DELE; DEL's drafts stop by confidence alone (or at `draft_cap`).
        self.cap_at_optimum = not options.dynamic_draft
        self.cost = LayerCost(num_layers)

    def start(self, exit_head: ExitHead) -> None:
        self.exit_head = exit_head
        final = self.may_add_final_layer and exit_head.cheaper_at_final_layer
        self.candidates = self.base_candidates + ([self.num_layers] if final else [])
        self.exit_layer, self.draft_length, self.level = self.candidates[0], 1, 0
        # statistics rows (level, candidate), level-major: each row's exit layer
        self.exit_layers = np.tile(self.candidates, self.levels)
        self.stats = ExitStatistics(self.levels * len(self.candidates), self.omega)
        self.tau_exit = float(self.stats.threshold()[0])
        self.alpha_trace = [0.0] * len(self.candidates)
        self.in_warmup = True

    def plan(self, proposal: ContextProposal = NO_PROPOSAL) -> Plan:
        if self.in_warmup:  # round 0: the paper drafts one token with the first candidate
            return Plan(self.candidates[0], 1)
        return Plan(self.exit_layer, self.next_draft_cap, self.level)

    @property
    def next_draft_cap(self) -> int:
        """The next draft's cap: `draft_cap` (the paper), else d*, never above `draft_cap`."""
        return min(self.draft_length, self.draft_cap) if self.cap_at_optimum else self.draft_cap

    def keep_drafting(self, confidence: float) -> bool:
        return not self.dynamic_draft or confidence >= self.tau_exit

    def observe(self, record: Round) -> None:
        start = time.perf_counter()
        rows = torch.arange(len(self.candidates))
        self._score(record, rows, torch.arange(record.targets.shape[0]))
        self._choose()
        self._annotate(record, time.perf_counter() - start, len(rows))

    def _annotate(self, record: Round, shadow_s: float, scored_layers: int) -> None:
        """The policy's values in the round's trace entry (where one is kept: `traced`)."""
        if not self.traced:
            return
        record.extra.update(
            tau=round(self.tau_exit, 4),
            alpha=self.alpha_trace,
            next_exit_layer=self.exit_layer,
            next_draft_length=self.draft_length,
            next_draft_cap=self.next_draft_cap,
            next_level=self.level,
            shadow_s=shadow_s,
            scored_layers=scored_layers,
        )

    def _shadow_tokens(self, record: Round, rows: Tensor, positions: Tensor) -> ShadowTokens:
        """Shadow tokens of candidate rows `rows` at record positions `positions`, in one
        batched exit-head call, and the valid context they count over."""
        layers = [self.candidates[r] for r in rows.tolist()]
        hidden = record.hidden[[e - 1 for e in layers]][:, positions]  # layer E -> hidden[E-1]
        logits = self.exit_head.shadow(hidden, layers).float()
        rows_of = logits.shape[:-1]  # [layers, positions]
        column, top, lse = (v.view(rows_of) for v in top_logsumexp(logits.flatten(0, -2)))
        confidence = torch.exp(top - lse).cpu()
        vocab = self.exit_head.vocab
        tokens = (column if vocab is None else vocab[column]).cpu()
        targets = record.targets.cpu()[positions]
        match = tokens == targets[None, :]
        valid = torch.ones(len(positions), dtype=torch.bool)
        if record.from_context or record.context_after:  # not all the exit layer's drafts:
            valid[record.warmup_rows + record.accepted + 1 :] = False  # up to the first reject
        elif record.exit_layer in layers:  # u_r, after the warm-up's rows (never clipped)
            row = layers.index(record.exit_layer)
            misses = (~match[row, record.warmup_rows :]).nonzero()
            if len(misses):
                valid[record.warmup_rows + int(misses[0]) + 1 :] = False
        return ShadowTokens(layers, hidden, top, confidence, targets, match, valid)

    def _score(self, record: Round, rows: Tensor, positions: Tensor) -> None:
        """Update the statistics of candidate rows `rows` from the round's shadow tokens. A
        target the head could not draft before the round admitted it counts as a miss."""
        shadow = self._shadow_tokens(record, rows, positions)
        covered = self.exit_head.covered(shadow.targets)[0]
        self.stats.update(shadow.match & covered, shadow.confidence, shadow.valid, rows)

    def _choose(self) -> None:
        """The next (E, d*): the first maximum of expected tokens per layer load (TPL)."""
        alpha = self.stats.alpha()
        self.alpha_trace = np.round(alpha, 4).tolist()
        value = expected_tokens(alpha, self.draft_lengths) / self.cost.grid(
            self.exit_layers, self.draft_lengths
        )
        self._take(*best_plan(value))

    def _take(self, row: int, column: int) -> None:
        """Plan the next rounds from statistics row `row` and draft length column `column`."""
        self.level, candidate = divmod(row, len(self.candidates))
        self.exit_layer = self.candidates[candidate]
        self.draft_length = int(self.draft_lengths[column])
        self.tau_exit = self.stats.threshold_at(row)
        self.in_warmup = False

"""DEL: Dynamic Exit Layer selection with dynamic draft exiting (and DELE, without the latter)."""

from __future__ import annotations

import time

import torch

from delspec.costs import LayerCost
from delspec.engine import ExitHead, Round
from delspec.errors import ConfigError
from delspec.exit_statistics import ExitStatistics, best_plan, expected_tokens
from delspec.policies.base import Plan, Policy, check_draft_length


class DynamicExit(Policy):
    """DEL (arXiv 2504.05598), following the reference implementation, with its quirks fixed.

    After every round, every candidate layer's cached states are decoded through the exit head
    ("shadow tokens") in one batched call and compared with the final layer's tokens over the
    valid context (positions up to the first mismatch of the exit layer used). Decayed counts
    give alpha and tau per layer; the next (E, d*) maximises tokens per cost, and drafting with
    E stops once the draft confidence falls below tau_E (or at `draft_cap`). Round 0 drafts one
    token with the first candidate and also scores the last `warmup` prompt positions.

    Fixes of the reference code: u_r clipping applies in every round (it was skipped after a
    d* = 0 choice); alpha/tau are finite for layers without data (see `ExitStatistics`); drafts
    never run past `max_new_tokens` (the engine caps them); state resets for every prompt.
    With `dynamic_draft=False` this is DELE: exactly d* tokens are drafted (d* = 0 is a plain
    step).
    """

    name = "del"
    collect_hidden = True

    def __init__(
        self,
        num_layers: int,
        candidates: list[int] | None = None,
        omega: float = 0.95,
        gamma_max: int = 18,
        gamma_min: int = 0,
        draft_cap: int = 18,
        warmup: int = 32,
        dynamic_draft: bool = True,
    ) -> None:
        super().__init__(num_layers)
        layers = candidates if candidates is not None else list(range(1, num_layers))
        if not layers:
            raise ConfigError("DEL needs at least one candidate exit layer")
        self.candidates = [self.check_exit_layer(e) for e in sorted(set(layers))]
        if not 0.0 < omega <= 1.0:
            raise ConfigError(f"omega must be in (0, 1], got {omega}")
        if not 0 <= gamma_min < gamma_max:
            raise ConfigError(f"need 0 <= gamma_min < gamma_max, got {gamma_min}, {gamma_max}")
        if warmup < 0:
            raise ConfigError(f"warmup window must be >= 0, got {warmup}")
        self.omega, self.draft_cap = omega, check_draft_length(draft_cap, "draft cap")
        self.warmup_window, self.dynamic_draft = warmup, dynamic_draft
        self.draft_lengths = torch.arange(gamma_min, gamma_max)
        self.exit_layers = torch.tensor(self.candidates)
        self.rows = [e - 1 for e in self.candidates]  # layer E's output is hidden[E - 1]
        self.cost = LayerCost(num_layers)
        if not dynamic_draft:
            self.name = "dele"

    def start(self, exit_head: ExitHead) -> None:
        self.exit_head = exit_head
        self.stats = ExitStatistics(len(self.candidates), self.omega)
        self.exit_layer, self.draft_length = self.candidates[0], 1
        self.tau = self.stats.threshold()
        self.tau_exit = float(self.tau[0])
        self.warm = True

    def plan(self) -> Plan:
        if self.warm:
            return Plan(self.candidates[0], 1)
        return Plan(self.exit_layer, self.draft_cap if self.dynamic_draft else self.draft_length)

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        return confidence >= self.tau_exit

    def observe(self, record: Round) -> None:
        start = time.perf_counter()
        hidden = record.hidden[self.rows]  # [candidates, positions, hidden]
        logits = self.exit_head.shadow(hidden, self.candidates).float()
        top, column = logits.max(-1)
        confidence = torch.exp(top - torch.logsumexp(logits, -1)).cpu()
        vocab = self.exit_head.vocab
        tokens = (column if vocab is None else vocab[column]).cpu()
        match = tokens == record.targets.cpu()[None, :]
        valid = torch.ones(match.shape[1], dtype=torch.bool)
        if record.exit_layer in self.candidates:
            row = self.candidates.index(record.exit_layer)
            misses = (~match[row, record.context :]).nonzero()
            if len(misses):
                valid[record.context + int(misses[0]) + 1 :] = False
        self.stats.update(match, confidence, valid)
        alpha = self.stats.alpha()
        value = expected_tokens(alpha, self.draft_lengths) / self.cost.grid(
            self.exit_layers, self.draft_lengths
        )
        row, column = best_plan(value)
        self.exit_layer = self.candidates[row]
        self.draft_length = int(self.draft_lengths[column])
        self.tau = self.stats.threshold()
        self.tau_exit = float(self.tau[row])
        self.warm = False
        record.extra.update(
            tau=round(self.tau_exit, 4),
            alpha=[round(a, 4) for a in alpha.tolist()],
            next_exit_layer=self.exit_layer,
            next_draft_length=self.draft_length,
            shadow_s=time.perf_counter() - start,
        )

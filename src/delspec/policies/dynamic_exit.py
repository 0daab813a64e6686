"""DEL: Dynamic Exit Layer selection with dynamic draft exiting (and DELE, without the latter)."""

from __future__ import annotations

import time

import torch

from delspec.cache import cache_dir
from delspec.costs import CostProfile, LayerCost, MeasuredCost, cached_profile
from delspec.decode_config import DELOptions
from delspec.engine import ExitHead, Round
from delspec.errors import ConfigError
from delspec.exit_statistics import ExitStatistics, best_plan, expected_tokens
from delspec.policies.base import Plan, Policy

WARM_LAYERS = 6  # candidates the warm-up scores under a shadow budget
MIN_POSITIONS = 2  # positions a round scores under a shadow budget, if it scores at all


class DynamicExit(Policy):
    """DEL (arXiv 2504.05598), following the reference implementation, with its quirks fixed.

    After every round, every candidate layer's cached states are decoded through the exit head
    ("shadow tokens") in one batched call and compared with the final layer's tokens over the
    valid context (positions up to the first mismatch of the exit layer used). Decayed counts
    give alpha and tau per layer; the next (E, d*) maximises expected tokens per cost, and
    drafting with E stops once the draft confidence falls below tau_E (or at `draft_cap`).
    Round 0 drafts one token with the first candidate and also scores the last `warmup` prompt
    positions. With `dynamic_draft=False` this is DELE: exactly d* tokens are drafted.

    Fixes of the reference code: u_r clipping applies in every round (it was skipped after a
    d* = 0 choice); alpha/tau are finite for layers without data (see `ExitStatistics`); drafts
    never run past `max_new_tokens` (the engine caps them); state resets for every prompt.

    Beyond the paper (all off by default, so the defaults are the paper's DEL):
    - with a pruned exit head (a `DraftHead` vocabulary) or int8 drafts (`ExitHead.int8`) and
      the default candidates, the final layer L is a candidate too: its draft skips no layer but
      runs a cheaper copy of the model (pruned LM head, int8 weights), and verification is one
      pass over the drafted positions.
    - `cost="measured"`: (E, d*) maximise expected tokens per *second*, from timings measured on
      this device (`delspec.costs`) plus the policy's own measured overhead per round. d* also
      caps the draft (verifying more tokens than pays can cost several plain steps on a CPU),
      and alpha counts `prior` unseen mismatches (default 1; 0 with the paper's cost), so that
      a layer seen at a few positions cannot look certain. With `no_draft`, a draft must
      promise `margin` (default 5%) more tokens per second than a plain step, or the round is
      plain: estimates from a few positions are noisy, and a wrong draft costs more than a
      right one gains.
    - `min_evidence=n`: a layer drafts only once its (decayed) statistics cover n positions, so
      one lucky match at a cheap layer cannot start drafts that are then rejected.
    - with `cost="measured"` and an exit head of several draft vocabularies (`ExitHead.vocabs`,
      smallest first), the plan also picks the vocabulary: a larger one costs more per draft
      token but can draft more of the reply. Statistics are kept per (vocabulary, layer).
      Shadow tokens score the smallest vocabulary; a target token it lacks (before the round
      admitted it to the context) counts as a match for the larger vocabularies that hold it
      where the layer's logit of it reaches the smallest vocabulary's best (one dot product
      per such position, not a larger shadow head); drafts count for every vocabulary that
      held them.
    - `runs=True`: acceptances come in runs (a token after an accepted one is easier), so the
      expected tokens of a draft use each layer's acceptance given the previous token's
      (`ExitStatistics.continuation`) after the first draft token, not alpha for every one.
    - `no_draft=True`: when d* = 0 (no draft pays), run a plain full step instead of drafting;
      every layer's statistics still update from that step, so drafting resumes once it pays.
      Round 0 is then a plain step too (scored at the candidates), not a one-token draft.
    - `shadow_budget=f`: spend at most about a fraction f of round time on shadow tokens. Only
      positions in the valid context are decoded, and each round scores the exit layer, its
      neighbours and a rotating share of the other candidates as the budget allows, over as
      many of those positions as it allows (rounds may skip scoring altogether; the warm-up
      scores `WARM_LAYERS` evenly spread candidates and is not charged to the budget); a
      layer's statistics decay only when it is scored. A round that is not scored still
      updates the exit layer from its own drafts, which cost nothing to score: the accepted
      ones matched, the first rejected one did not.
    """

    name = "del"

    def __init__(self, num_layers: int, options: DELOptions) -> None:
        super().__init__(num_layers)
        o = options
        layers = o.candidates if o.candidates is not None else range(1, num_layers)
        if not layers:
            raise ConfigError("DEL needs at least one candidate exit layer")
        # `start` adds layer L to the default candidates when the head drafts it cheaply.
        self.base_candidates = [self.check_exit_layer(e) for e in sorted(set(layers))]
        self.final_exit = o.candidates is None
        self.omega, self.draft_cap = o.omega, o.draft_cap
        self.warmup_window, self.dynamic_draft = o.warmup, o.dynamic_draft
        measured = o.cost == "measured"
        self.prior = (1.0 if measured else 0.0) if o.prior is None else o.prior
        self.margin = (0.05 if measured and o.no_draft else 0.0) if o.margin is None else o.margin
        self.cost_name, self.no_draft, self.shadow_budget = o.cost, o.no_draft, o.shadow_budget
        self.runs, self.min_evidence = o.runs, o.min_evidence
        self.draft_lengths = torch.arange(o.gamma_min, o.gamma_max)
        # The optimum d* is the draft cap unless drafting stops by confidence alone (the paper).
        self.cap_at_optimum = measured or not o.dynamic_draft
        plain = (self.draft_lengths == 0).nonzero()
        self.plain_column = int(plain[0]) if len(plain) else None  # d = 0 in the value grid
        self.cost: LayerCost | MeasuredCost = LayerCost(num_layers)

    def start(self, exit_head: ExitHead) -> None:
        self.exit_head = exit_head
        final = self.final_exit and exit_head.cheaper_at_final_layer
        self.candidates = self.base_candidates + ([self.num_layers] if final else [])
        if self.cost_name == "measured" and not isinstance(self.cost, MeasuredCost):
            self.cost = MeasuredCost(self._profile(exit_head), self.num_layers)
        self.exit_layer, self.draft_length, self.level = self.candidates[0], 1, 0
        # Vocabulary levels to choose from: only a measured cost sees what a larger one costs.
        self.levels = len(exit_head.vocabs) if isinstance(self.cost, MeasuredCost) else 1
        # statistics rows (level, candidate), level-major: each row's exit layer and level
        count = len(self.candidates)
        self.exit_layers = torch.tensor(self.candidates).repeat(self.levels)
        self.row_levels = torch.arange(self.levels).repeat_interleave(count)
        self.stats = ExitStatistics(self.levels * count, self.omega)
        self.tau_exit = float(self.stats.threshold()[0])
        self.alpha_trace = [0.0] * len(self.candidates)
        self.warm = True
        self.collect_hidden = True
        self.credit = 0.0  # seconds of shadow work the budget allows now
        self.row_cost = 0.0  # measured seconds per scored (layer, position)
        self.cursor = 0  # rotation over candidates under a shadow budget

    def _profile(self, exit_head: ExitHead) -> CostProfile:
        middle = self.base_candidates[len(self.base_candidates) // 2]
        return cached_profile(exit_head, middle, self.draft_cap + 1, cache_dir() / "costs")

    def plan(self) -> Plan:
        if self.warm:  # round 0: the paper drafts one token with the first candidate
            return Plan(0, 0) if self.no_draft else Plan(self.candidates[0], 1)
        if self.no_draft and self.draft_length == 0:
            return Plan(0, 0)
        return Plan(self.exit_layer, self.draft_limit, self.level)

    @property
    def draft_limit(self) -> int:
        """The next draft's cap: `draft_cap` (the paper), else d*, never above `draft_cap`."""
        return min(self.draft_length, self.draft_cap) if self.cap_at_optimum else self.draft_cap

    def keep_drafting(self, confidence: float) -> bool:
        return not self.dynamic_draft or confidence >= self.tau_exit

    def observe(self, record: Round) -> None:
        start = time.perf_counter()
        warm = self.warm
        if self.shadow_budget is not None:
            self.credit += self.shadow_budget * (record.draft_s + record.verify_s)
        rows, positions = self._scope(record)
        if rows is not None:
            self._score(record, rows, positions)
            self._choose()
        elif record.drafted:
            self._count_drafts(record)
            self._choose()
        elapsed = time.perf_counter() - start
        # The warm-up is a one-off per prompt, like the prefill: it is not charged to the budget.
        if rows is not None and self.shadow_budget is not None:
            self.row_cost = elapsed / (len(rows) * len(positions))
            self.credit -= 0.0 if warm else elapsed
        if isinstance(self.cost, MeasuredCost) and not warm:
            self.cost.overhead = 0.9 * self.cost.overhead + 0.1 * elapsed
        self.collect_hidden = self._will_score_next()
        record.extra.update(
            tau=round(self.tau_exit, 4),
            alpha=self.alpha_trace,
            next_exit_layer=self.exit_layer,
            next_draft_length=self.draft_length,
            next_draft_cap=self.draft_limit,
            next_level=self.level,
            shadow_s=elapsed,
            scored_layers=0 if rows is None else len(rows),
        )

    def _scope(self, record: Round) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Candidate rows and record positions to score this round (rows None: skip)."""
        everything = torch.arange(record.targets.shape[0])
        if self.shadow_budget is None:
            return torch.arange(len(self.candidates)), everything
        if self.warm:  # a spread of candidates, the deepest included; rotation adds the rest
            spread = torch.linspace(0, len(self.candidates) - 1, WARM_LAYERS)
            return spread.round().long().unique(), everything
        if record.hidden is None:
            return None, everything
        must = self._must_score()
        least = len(must) + 1  # + one rotating
        cells = int(self.credit / max(self.row_cost, 1e-9))  # (layer, position) pairs affordable
        # Only the valid context can count: context + positions whose inputs were all accepted;
        # of those, the first ones the least rows can afford (MIN_POSITIONS at least).
        valid = record.context + record.accepted + 1
        positions = everything[: min(valid, max(cells // least, MIN_POSITIONS))]
        count = min(len(self.candidates), max(cells // len(positions), least))
        chosen = dict.fromkeys(must)
        while len(chosen) < count:
            chosen.setdefault(self.cursor)
            self.cursor = (self.cursor + 1) % len(self.candidates)
        return torch.tensor(sorted(chosen)), positions

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

    def _score(self, record: Round, rows: torch.Tensor, positions: torch.Tensor) -> None:
        layers = [self.candidates[r] for r in rows.tolist()]
        hidden = record.hidden[[e - 1 for e in layers]][:, positions]  # layer E -> hidden[E-1]
        head = self.exit_head
        logits = head.shadow(hidden, layers).float()
        top, column = logits.max(-1)
        confidence = torch.exp(top - torch.logsumexp(logits, -1)).cpu()
        vocab = head.vocab
        tokens = (column if vocab is None else vocab[column]).cpu()
        targets = record.targets.cpu()[positions]
        match = tokens == targets[None, :]
        valid = torch.ones(len(positions), dtype=torch.bool)
        if record.exit_layer in layers:
            row = layers.index(record.exit_layer)
            misses = (~match[row, record.context :]).nonzero()
            if len(misses):
                valid[record.context + int(misses[0]) + 1 :] = False
        # A target a vocabulary lacked (before the round admitted it) is a miss there; for the
        # larger ones, would the layer's logit of it beat the smallest vocabulary's best?
        covered = head.covered(targets)[: self.levels]  # [levels, positions]
        outside = (~covered[0]).nonzero()[:, 0]
        if self.levels > 1 and len(outside):
            wanted = targets[outside].to(hidden.device)
            reach = head.token_logits(hidden[:, outside], layers, wanted).float()
            match[:, outside] |= (reach >= top[:, outside]).cpu()
        match = (match[None] & covered[:, None]).flatten(0, 1)
        rows = self._level_rows(rows)
        self.stats.update(match, confidence.repeat(self.levels, 1), valid, rows)

    def _level_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Statistics rows of candidate rows `rows` at every vocabulary level, level-major."""
        offsets = torch.arange(self.levels)[:, None] * len(self.candidates)
        return (offsets + rows[None, :]).flatten()

    def _count_drafts(self, record: Round) -> None:
        """Update the exit layer from the round's drafts: accepted ones, then the first miss;
        each vocabulary level counts the accepted drafts it held."""
        seen = min(record.accepted + 1, len(record.drafted))
        match = torch.arange(seen) < record.accepted
        match = match[None] & self.exit_head.covered(torch.tensor(record.drafted[:seen]))
        confidence = torch.tensor(record.confidences[:seen]).repeat(self.levels, 1)
        rows = self._level_rows(torch.tensor([self.candidates.index(record.exit_layer)]))
        self.stats.update(
            match[: self.levels], confidence, torch.ones(seen, dtype=torch.bool), rows
        )

    def _choose(self) -> None:
        count = len(self.candidates)
        alpha = self.stats.alpha(self.prior)  # [levels * candidates]
        self.alpha_trace = [round(a, 4) for a in alpha[:count].tolist()]  # once per update
        continuation = self.stats.continuation(self.prior) if self.runs else None
        value = expected_tokens(alpha, self.draft_lengths, continuation) / self.cost.grid(
            self.exit_layers, self.draft_lengths, self.row_levels
        )
        if self.min_evidence and self.plain_column is not None:
            unproven = self.stats.matched + self.stats.mismatched < self.min_evidence
            value[unproven] = value[unproven, self.plain_column][:, None]
        row, column = best_plan(value)
        plain = self.plain_column
        if (
            self.margin
            and plain is not None
            and value[row, column] < (1 + self.margin) * value[0, plain]
        ):  # a plain round (its value is every row's); keep watching the layer agreeing best
            row, column = count - 1 - int(torch.argmax(alpha[:count].flip(0))), plain
        self.level, candidate = divmod(row, count)
        self.exit_layer = self.candidates[candidate]
        self.draft_length = int(self.draft_lengths[column])
        self.tau_exit = float(self.stats.threshold()[row])
        self.warm = False

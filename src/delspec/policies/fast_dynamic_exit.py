"""What `del-fast` adds to the paper's DEL: measured costs, budgets, and per-round choices.
`FastDynamicExit` runs every `DELOptions` that turns on one of these additions
(`DELOptions.uses_fast_additions`); the others run the paper's `DynamicExit` unchanged."""

from __future__ import annotations

import time

import numpy as np

from delspec.decode_config import DELOptions
from delspec.drafting.context_drafts import MAX_NGRAM, MIN_NGRAM, NO_PROPOSAL, ContextProposal
from delspec.drafting.exit_head import ExitHead
from delspec.machine.cost_profile import CostProfile
from delspec.machine.profile import MachineProfile
from delspec.policies.cost_model import MeasuredCost
from delspec.policies.dynamic_exit import DynamicExit
from delspec.policies.exit_statistics import ExitStatistics, best_plan, expected_tokens
from delspec.policies.fast_state import (
    CARRIED_ROUNDS,
    CONTEXT_PRIOR,
    NO_INPUTS,
    ContextScore,
    Learned,
    PolicyInputs,
    Realized,
)
from delspec.policies.protocol import Plan, Round
from delspec.policies.shadow_scoring import ShadowScoring

RETRY_EVERY = 16  # while exit-layer drafts are slower than plain steps, one round in this many
CARRIED_EVIDENCE = 8.0  # the most (decayed) positions a generation's carried statistics cover
MIN_CHANCE = 0.01  # a context draft token less likely than this to be accepted is not drafted
MIN_BELOW = 3.0  # (decayed) drafts under the threshold seen before their acceptance counts
# Rounds without exit-layer drafts whose statistics updates `observe` holds back and applies
# together: one round's updates are small pieces of work, each starting cold after the model's
# pass, and applied one round at a time they put a reply without drafts visibly behind `ar`;
# the plan sees those updates at most this many rounds late.
HELD_BATCH = 16


class FastDynamicExit(ShadowScoring, DynamicExit):
    """DEL with del-fast's additions, each an option (all off in the paper's DEL):

    - `cost="measured"`: (E, d*) maximise expected tokens per *second*, from timings measured on
      this device (`delspec.machine.cost_profile`) plus the policy's own measured work per round
      (apart for rounds that draft from a layer, whose bookkeeping costs several times more).
      d* also caps the draft (verifying more tokens than pays can cost several plain steps on a
      CPU), and alpha counts `prior` unseen mismatches (default 1; 0 with the paper's cost), so
      that a layer seen at a few positions cannot look certain. With `no_draft`, a draft must
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
      ones matched, the first rejected one did not. The final layer is counted from every
      round's verification at no cost (`_count_final_layer`).
    - `context_drafts=True`: each round may also draft from the context (`ContextProposal`, at
      no model cost), as a context draft alone, or one extended by exit-layer drafts. Each
      round's proposal is scored against the tokens the sequence then commits (the verifier's,
      so exact under greedy decoding and unbiased under sampling), whether it was drafted or
      not: decayed acceptance statistics per class of match length, like a layer's, at no
      model cost (`ContextScore`, `CONTEXT_PRIOR`).
      The round takes whichever of the layer plan, the context draft (its best length) and the
      extended draft promises the most tokens per measured second (a context draft, like a
      layer draft, must beat a plain step by the margin). After each exit-layer draft token,
      the context is asked again, after the sequence and the drafts so far: a prefix of that
      proposal ends the layer's drafting where it makes the round promise more tokens per
      second than drafting on as planned, or than stopping there (`follow`).
    - With `cost="measured"`, what exit-layer drafts really deliver is watched too: decayed
      tokens per second of the recent rounds that drafted from a layer against those of recent
      plain steps (both decay every round: a machine's speed drifts). Where a model's drafts
      gain only a few percent on paper (a small LM head, drafts from the final layer), errors
      of the cost model decide; when drafting rounds turn out slower than plain steps, rounds
      go without layer drafts (context drafts still may), retrying one in `RETRY_EVERY`. While
      layer drafts run and no plain step is recent enough to compare with, one round is plain,
      to see.
    - The paper's stop under the exit layer's confidence threshold tau must earn its keep: the
      exit layer's drafts made under tau are counted, accepted or not (decayed, per vocabulary
      and layer), and once `MIN_BELOW` of them are seen and they are accepted often enough that
      the plain-step seconds one saves cover what one more draft token adds to the round,
      drafting goes on under tau (up to d*). Where confidence tells little the draft runs on;
      where it tells a miss, the stop holds. At the final layer, whose drafts are the full
      head's restricted to a vocabulary, there is no stop under tau (`keep_drafting`).
    - The updates of a round without exit-layer drafts (a plain step, or context drafts alone;
      past the warm-up, unscored, no recheck due after it) wait, and `HELD_BATCH` of them are
      applied together (`apply_held`), in order, as each would have been (the final layer's
      counts in one update); `finish` applies what is left at the end.
    - `remember=True`: a generation starts from what the previous one with the same model, draft
      head and options learned (`Learned`: the statistics of every layer and of the context
      drafts, the realized speeds, the measured cost with its corrections), instead of a
      warm-up from nothing: no prompt positions are scored, and round 0 already drafts where
      that pays. The statistics start with at most `CARRIED_EVIDENCE` positions of evidence
      per layer (the same rates) and decay as the new sequence adds its own, so a prompt unlike
      the last one takes over within a few rounds, and a run of short replies keeps what it
      learned (a fixed fraction would shrink away, and every other reply pay a warm-up again).
      Statistics too thin to stand in for a warm-up (no layer's evidence covers `min_evidence`
      positions, or one) are not carried. A corrected profile stays corrected for the process.
    """

    def __init__(
        self, num_layers: int, options: DELOptions, inputs: PolicyInputs = NO_INPUTS
    ) -> None:
        super().__init__(num_layers, options)
        o = options
        self.context_prior = CONTEXT_PRIOR if o.prior is None else o.prior
        self.cost_name, self.no_draft, self.shadow_budget = o.cost, o.no_draft, o.shadow_budget
        self.runs, self.min_evidence = o.runs, o.min_evidence
        self.options, self.remember = o, o.remember
        self._cost_settings(o.cost == "measured")
        self.machine, self.memory, self.budget = inputs.machine, inputs.learned, inputs.budget

    def _cost_settings(self, measured: bool) -> None:
        """The settings that follow from whether costs are measured, where the options leave
        them open."""
        o = self.options
        self.prior = (1.0 if measured else 0.0) if o.prior is None else o.prior
        self.margin = (0.05 if measured and o.no_draft else 0.0) if o.margin is None else o.margin
        # The optimum d* is the draft cap unless drafting stops by confidence alone (the paper).
        self.cap_at_optimum = measured or not o.dynamic_draft
        plain = np.flatnonzero(self.draft_lengths == 0)
        self.plain_column = int(plain[0]) if len(plain) else None  # d = 0 in the value grid
        if o.context_drafts:
            self.context_ngrams, self.context_limit = (MIN_NGRAM, MAX_NGRAM), o.draft_cap

    def start(self, exit_head: ExitHead) -> None:
        key = (self.options, type(exit_head), tuple(exit_head.vocab_sizes), exit_head.int8)
        memory = self.memory if self.remember and self.memory is not None else {}
        learned = memory.get(key)
        if learned is not None and (isinstance(learned.cost, MeasuredCost) or not self.measures):
            self.cost = learned.cost
        elif self.measures and not isinstance(self.cost, MeasuredCost):
            profile = self._profile(exit_head, budget=self.budget)
            if profile is not None:
                self.cost = MeasuredCost(profile, self.num_layers)
        # a run too short to measure costs for (`MachineProfile.cost_profile`) runs as the
        # paper's cost would
        self._cost_settings(isinstance(self.cost, MeasuredCost))
        # Vocabulary levels to choose from: only a measured cost sees what a larger one costs.
        self.levels = len(exit_head.vocab_sizes) if isinstance(self.cost, MeasuredCost) else 1
        super().start(exit_head)
        # the value grid's rows (exit layer, level) and columns as the cost's key
        # (`MeasuredCost.grid`)
        self.lengths_key = tuple(self.draft_lengths.tolist())
        self.length_column = {length: i for i, length in enumerate(self.lengths_key)}
        row_levels = tuple(level for level in range(self.levels) for _ in self.candidates)
        self.grid_key = (tuple(self.exit_layers.tolist()), self.lengths_key, row_levels)
        self.credit = 0.0  # seconds of shadow work the budget allows now
        # measured seconds per scored (layer, position): a timing of this machine, carried
        # whenever a generation ran before
        self.row_cost = learned.row_cost if learned else 0.0
        self.cursor = 0  # rotation over candidates under a shadow budget
        self.recheck_in = -1  # rounds until a plain round put in place of layer drafts is
        # looked at again (`_recheck`; below 0: none is)
        self.layer_tokens: list[float] = []  # the layer plan's expected tokens per draft length
        self.planned = Plan(0, 0)  # the round `plan` gave last
        self.context_score = ContextScore(self.omega, self.context_prior)
        # per statistics row: exit-layer drafts made under the threshold tau, accepted or not
        self.below = ExitStatistics(self.levels * len(self.candidates), self.omega)
        self.below_pays = False  # whether the exit layer's drafts under tau pay (`_take`)
        self.realized = Realized()
        self.final_exact = exit_head.final_layer_is_full_head
        final = self._final_row  # statistics rows of the final layer
        self.final_rows = [] if final is None else self._level_rows([final])
        # every statistics row's alpha when the plan was last chosen (none yet: any count moves)
        self.chosen_alpha = [-1.0] * len(self.exit_layers)
        # rounds whose updates wait (`observe`), each with the exit head's `admissions` then
        # (None: the final layer is not counted)
        self.held: list[tuple[Round, int | None]] = []
        self.held_seconds = 0.0  # what holding them took
        self.collect_hidden = True
        if learned is not None and self._worth_carrying(learned.stats):
            self.stats = learned.stats.capped(CARRIED_EVIDENCE)
            self.context_score.learned(learned.context.capped(CARRIED_EVIDENCE))
            self.below = learned.below.capped(CARRIED_EVIDENCE)
            self.realized = learned.realized.capped(CARRIED_ROUNDS)
            self.warmup_window = 0  # no warm-up: the statistics are there
            self._choose()
            self.collect_hidden = self._will_score_next()
        self.learned = Learned(self.stats, self.context_score.stats, self.below, self.realized,
                               self.cost)  # fmt: skip
        self.learned.row_cost = self.row_cost
        memory[key] = self.learned

    def _worth_carrying(self, learned: ExitStatistics) -> bool:
        """Whether a previous generation's statistics can stand in for a warm-up: some layer's
        evidence covers `min_evidence` positions (one at least), so that it could draft at
        once. Thinner ones would only keep the warm-up from ever adding to them. The final
        layer, which every verification counts, is not such a layer: its evidence says nothing
        of the layers only a warm-up or shadow tokens score."""
        if learned.matched.shape != self.stats.matched.shape:
            return False
        evidence = learned.evidence()
        if self.final_exact and self.final_rows:
            evidence = np.delete(evidence, self.final_rows)
        return bool(len(evidence)) and float(evidence.max()) >= max(1.0, self.min_evidence)

    @property
    def measures(self) -> bool:
        """Whether the options ask for measured costs."""
        return self.cost_name == "measured"

    def _profile(
        self, exit_head: ExitHead, thorough: bool = False, budget: int | None = None
    ) -> CostProfile | None:
        """The cost profile of this policy's setting (`MachineProfile.cost_profile`)."""
        machine = self.machine or MachineProfile(exit_head.model)
        middle = self.base_candidates[len(self.base_candidates) // 2]
        return machine.cost_profile(exit_head, middle, self.draft_cap + 1, thorough, budget)

    def measure_costs(self, exit_head: ExitHead) -> None:
        """The cost profile, measured thoroughly where only a quick one (or none) is stored."""
        if self.measures:
            self._profile(exit_head, thorough=True)

    def plan(self, proposal: ContextProposal = NO_PROPOSAL) -> Plan:
        if self.no_draft and (self.in_warmup or self.draft_length == 0):
            layer_plan = Plan(0, 0)
        else:
            layer_plan = super().plan()
        self.context_score.proposed(proposal)
        plan = layer_plan
        if proposal.tokens and not self.in_warmup and isinstance(self.cost, MeasuredCost):
            plan = self._with_context(layer_plan, *proposal)
        self.planned = plan
        return plan

    def _with_context(self, layer_plan: Plan, tokens: list[int], match: int, source: int) -> Plan:
        """`layer_plan`, or a round that drafts the best prefix of the context's `tokens` (found
        by a suffix match of `match` tokens in `source`), alone or followed by `layer_plan`'s
        exit-layer drafts: whichever promises the most tokens per second."""
        cost = self.cost
        first, then = self.context_score.acceptance(match, source)
        best, value, expected, best_expected, chance = 0, 0.0, 1.0, 1.0, first
        for k in range(1, len(tokens) + 1):  # draft the first k context tokens
            if chance < MIN_CHANCE:  # adds under 1% of a token, for another row to verify
                break
            expected += chance
            chance *= then
            tokens_per_s = expected / cost.plain_seconds(k + 1)
            if tokens_per_s > value:
                best, value, best_expected = k, tokens_per_s, expected
        choice = Plan(0, 0, context_drafts=tuple(tokens[:best]))
        if layer_plan.draft_cap and self.layer_tokens:  # that prefix, then exit-layer drafts
            all_accepted = first * then ** (best - 1) if best else 1.0
            row, level = (layer_plan.exit_layer,), (layer_plan.level,)
            seconds = cost.grid(row, self.lengths_key, level, context=best)[0].tolist()
            # in plain Python: a few numbers each, where each numpy call would cost more
            for length, layer_tokens, round_s in zip(
                self.lengths_key, self.layer_tokens, seconds, strict=True
            ):
                mixed = (best_expected + all_accepted * (layer_tokens - 1.0)) / round_s
                if length and mixed > value:
                    value, cap = mixed, min(length, layer_plan.draft_cap)
                    choice = Plan(
                        layer_plan.exit_layer, cap, layer_plan.level, choice.context_drafts
                    )
        return choice if value > self._floor(layer_plan) else layer_plan

    def follow(self, proposal: ContextProposal, layer_drafts: int, last: bool) -> list[int]:
        """The prefix of `proposal` (found after the round's first `layer_drafts` exit-layer
        drafts) that makes the round promise the most tokens per second, if any beats the
        round without it: ending here (`last`), else drafting on as planned. Its tokens
        count only if every layer draft is accepted, and cost the rows they add to the
        verification (`MeasuredCost.after_seconds`). Not after context drafts, nor in the
        warm-up. The proposal is scored whatever is taken of it."""
        self.context_score.followed(proposal, layer_drafts)
        column, layer_tokens, plan = self.length_column, self.layer_tokens, self.planned
        planned = layer_drafts if last else plan.draft_cap
        if (
            not proposal.tokens
            or self.in_warmup
            or plan.context_drafts
            or not layer_tokens
            or not isinstance(self.cost, MeasuredCost)
            or layer_drafts - 1 not in column
            or layer_drafts not in column
            or planned not in column
        ):
            return []
        cost, exit_layer, level = self.cost, plan.exit_layer, plan.level
        planned_s = cost.round_seconds(exit_layer, planned, level, 0)
        value = layer_tokens[column[planned]] / planned_s
        seconds = cost.after_seconds(exit_layer, layer_drafts, level, len(proposal.tokens))
        expected = layer_tokens[column[layer_drafts]]
        # the chance that all the layer's drafts are accepted: what the last one adds
        chance = expected - layer_tokens[column[layer_drafts - 1]]
        first, then = self.context_score.acceptance(proposal.match_length, proposal.source)
        chance *= first
        best = 0
        for k in range(1, len(proposal.tokens) + 1):
            if chance < MIN_CHANCE:
                break
            expected += chance
            chance *= then
            tokens_per_s = expected / seconds[k]
            if tokens_per_s > value:
                best, value = k, tokens_per_s
        return proposal.tokens[:best]

    def _floor(self, layer_plan: Plan) -> float:
        """Tokens per second a round with context drafts must beat: `layer_plan`'s, and a plain
        step's by the margin, where the sequence is now. `_choose` worked out its values where
        the statistics last changed, or at the end of the previous sequence: a plain step
        priced there (dearer, further on) would let unlikely short context drafts through,
        round after round of a chat reply."""
        cost = self.cost
        plain = (1 + self.margin) / cost.plain_seconds(1)
        if not layer_plan.draft_cap or not self.layer_tokens:
            return plain
        seconds = cost.round_seconds(layer_plan.exit_layer, self.draft_length, layer_plan.level, 0)
        return max(self.layer_tokens[self.length_column[self.draft_length]] / seconds, plain)

    def observe(self, record: Round) -> None:
        if self._may_hold(record):
            self._hold(record)
            return
        self.apply_held()  # the rounds held back come first
        start = time.perf_counter()
        in_warmup = self.in_warmup
        if isinstance(self.cost, MeasuredCost):  # issue 29: heal a profile timed under load
            self.cost.at(record.position)
            self.cost.check.observe_round(record)
            self.cost.at(record.position + len(record.tokens))  # where the next round starts
        self.context_score.committed(record)
        if self.shadow_budget is not None:
            self.credit += self.shadow_budget * (record.draft_s + record.verify_s)
        rows, positions = self._scope(record)
        if rows is not None:
            scoring = time.perf_counter()
            self._score(record, rows, positions)
            scoring = time.perf_counter() - scoring
            if self.shadow_budget is not None:
                self.row_cost = self.learned.row_cost = scoring / (len(rows) * len(positions))
                # The warm-up is a one-off per prompt, like the prefill: not charged to the budget.
                self.credit -= 0.0 if in_warmup else scoring
        count_final = bool(
            self.final_exact and self.final_rows and (rows is None or self._final_row not in rows)
        )
        layer_drafts = record.layer_drafts > 0
        final_drafts = count_final and record.exit_layer == self.num_layers  # counted below
        # the layers' statistics changed: scored, or counted and moved (context drafts apart)
        changed = rows is not None
        if rows is None and layer_drafts and not final_drafts:
            changed |= self._count_drafts(record)
        below = layer_drafts and self.dynamic_draft and self._count_below(record)
        if count_final:
            changed |= self._count_final_layer([self._final_held(record)])
        if not self._recheck(changed) and below:  # `_take` did not look at them again
            row = self._row_of(self.exit_layer, self.level)
            self.below_pays = self._below_pays(row, self.length_column[self.draft_length])
        elapsed = time.perf_counter() - start
        if not in_warmup:  # the warm-up's round is no plain step (it keeps the prompt's states)
            self.realized.add(record, elapsed)
            if isinstance(self.cost, MeasuredCost):
                self._note_overhead(layer_drafts, elapsed)
        self.collect_hidden = self._will_score_next()
        self._annotate(record, elapsed, 0 if rows is None else len(rows))

    def _may_hold(self, record: Round) -> bool:
        """Whether `record`'s updates may wait for the next ones (see the class docstring): a
        round without exit-layer drafts (a plain step, or context drafts alone) past the
        warm-up, without states to score, after which no recheck is due."""
        light = not (self.in_warmup or record.layer_drafts or record.hidden is not None)
        return light and self.recheck_in != 1

    def _hold(self, record: Round) -> None:
        """Hold back a round's updates (`_may_hold`), applying them once `HELD_BATCH`
        wait; only what the next round's plan reads at once is done now (the context's tokens,
        the shadow budget's credit, the recheck's countdown) and what would change by then
        (the draft vocabularies' `admissions`: the context's tokens join them, and what they
        held then is asked later)."""
        start = time.perf_counter()
        counted = self.final_exact and self.final_rows  # `_final_held` of it, later
        self.held.append((record, self.exit_head.admissions if counted else None))
        self.context_score.take(record)
        if self.shadow_budget is not None:
            self.credit += self.shadow_budget * (record.draft_s + record.verify_s)
        self.recheck_in -= 1
        self.held_seconds += time.perf_counter() - start
        if len(self.held) == HELD_BATCH:
            self.apply_held()
        self.collect_hidden = self._will_score_next()
        self._annotate(record, time.perf_counter() - start, 0)

    def finish(self) -> None:
        """The sequence ended: what its last rounds held back is applied (`apply_held`), so
        that what the next sequence carries (`Learned`) includes them."""
        self.apply_held()

    def apply_held(self) -> None:
        """Apply the updates of the rounds held back, in order: the cost check, the
        context's proposals they settle, the final layer's counts, the realized speeds (each
        round charged an equal share of the policy's time on them); then choose again if an
        alpha moved."""
        if not self.held:
            return
        start = time.perf_counter()
        records = [record for record, _ in self.held]
        finals = [self._final_held(r, at) for r, at in self.held if at is not None]
        self.held = []
        cost = self.cost
        measured = isinstance(cost, MeasuredCost)
        if measured:
            for record in records:
                cost.at(record.position)
                cost.check.observe_round(record)
            cost.at(records[-1].position + len(records[-1].tokens))
        self.context_score.settle()
        moved = bool(finals) and self._count_final_layer(finals)
        share = (time.perf_counter() - start + self.held_seconds) / len(records)
        self.held_seconds = 0.0
        for record in records:
            self.realized.add(record, share)
            if measured:
                self._note_overhead(False, share)
        if moved:
            self._choose()

    def _note_overhead(self, layer_drafts: bool, seconds: float) -> None:
        """Decayed mean of the policy's seconds per round, for rounds with or without
        exit-layer drafts (the first of a kind taken as it is)."""
        cost = self.cost
        name = "layer_overhead" if layer_drafts else "overhead"
        old = getattr(cost, name)
        setattr(cost, name, 0.9 * old + 0.1 * seconds if old else seconds)

    def keep_drafting(self, confidence: float) -> bool:
        """The paper's stop under the exit layer's threshold tau, unless this layer's drafts
        under tau have been accepted often enough to pay for themselves (`below_pays`), and
        never at the final layer when its drafts are the full head's restricted to a
        vocabulary: a level drafts the target there exactly when it holds it, whatever the
        confidence (a pruned level holds about as many targets at low confidence as at high), so
        drafts run to d*, which the final layer's statistics from every verification price."""
        if self.final_exact and self.exit_layer == self.num_layers:
            return True
        return super().keep_drafting(confidence) or self.below_pays

    def _take(self, row: int, column: int) -> None:
        super()._take(row, column)
        self.below_pays = self._below_pays(row, column)

    def _below_pays(self, row: int, column: int) -> bool:
        """Whether a draft token under tau at statistics row `row`, with d* at `column`, is
        accepted often enough (`MIN_BELOW` such drafts seen) that the plain-step seconds it
        saves cover what one more draft token adds to the round."""
        lengths = self.draft_lengths
        matched, mismatched = self.below.sums[:2, row].tolist()
        if matched + mismatched < MIN_BELOW or lengths[column] == 0:
            return False
        seconds = self.cost.grid((self.exit_layer,), self.lengths_key, (self.level,))[0]
        more = column + 1 if column + 1 < len(lengths) else column
        added = float(seconds[more] - seconds[more - 1])
        plain = float(seconds[self.plain_column]) if self.plain_column is not None else added
        return self.below.rates(row)[0] * plain >= added

    def _recheck(self, changed: bool) -> bool:
        """After a round: choose the plan again if the layers' statistics `changed`, or when a
        plain round put in place of layer drafts is due to be looked at again (`recheck_in`
        rounds after it was: one to see a plain step, `RETRY_EVERY` while drafts lose).
        Returns whether it did."""
        self.recheck_in -= 1
        if changed or self.recheck_in == 0:
            self._choose()
            return True
        return False

    def _choose(self) -> None:
        """The next (E, d*, vocabulary level) by expected tokens per cost, with the runs,
        min_evidence and margin rules."""
        count = len(self.candidates)
        alpha = self.stats.alpha(self.prior)  # [levels * candidates]
        self.alpha_trace = alpha[:count].round(4).tolist()  # once per update
        continuation = self.stats.continuation(self.prior, alpha) if self.runs else None
        expected = expected_tokens(alpha, self.draft_lengths, continuation)
        value = expected / self.cost.grid(*self.grid_key)
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
            row, column = count - 1 - int(np.argmax(alpha[count - 1 :: -1])), plain
        elif plain is not None and column != plain and isinstance(self.cost, MeasuredCost):
            verdict = self.realized.verdict()
            if verdict == "lose" and self.recheck_in == 0:
                verdict = "draft"  # refused for `RETRY_EVERY` rounds: look again
            if verdict != "draft":  # drafts from layers really ran slower than plain steps
                column = plain
                waiting = self.recheck_in if self.recheck_in > 0 else RETRY_EVERY
                self.recheck_in = 1 if verdict == "see" else waiting
        if self.context_ngrams is not None:
            self.layer_tokens = expected[row].tolist()
        self.chosen_alpha = alpha.tolist()
        self._take(row, column)

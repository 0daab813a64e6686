"""Sequences being decoded, one at a time (several together: `batch`).

A `Decoding` is one sequence in progress: its engine on a slot of the model's KV cache, its
policy, and its statistics. `advance` runs one round the policy plans (drafts and all);
`commit` takes a round verified in a batched pass (`batch.step_together`); `run` is the whole
token loop. A config's runs are assembled by `delspec.decoding.run.ResolvedConfig.decoding`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from delspec.decoding.engine import Engine, through_eos
from delspec.decoding.grammar import Constraint
from delspec.decoding.prefix import Held
from delspec.decoding.sampling import Sampling
from delspec.drafting.context_drafts import NO_PROPOSAL, POOL
from delspec.drafting.draft_pool import DraftPool
from delspec.drafting.exit_head import ExitHead
from delspec.errors import ConfigError, ContextLengthError, is_integer
from delspec.machine.timing import synchronize
from delspec.model.transformer import Transformer
from delspec.policies import Policy
from delspec.policies.protocol import Round

OnRound = Callable[[list[int], int], bool]
# per generated token: (its log-probability, the most likely tokens' (id, log-probability))
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class Stats:
    """Timing and speculation statistics of one generation; a statistic with no value (e.g.
    an acceptance rate when nothing was drafted) is None."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose cache entries were reused, not computed
    new_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms_per_token: float = 0.0
    tokens_per_s: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    acceptance_rate: float | None = None  # None: nothing drafted
    etpl: float = 0.0  # sum(accepted + 1) / sum(E * T + L)
    mean_exit_layer: float | None = None  # over rounds with exit-layer drafts; None: none
    mean_draft_length: float = 0.0  # over all rounds
    layer_rounds: int = 0  # rounds with exit-layer drafts
    context_rounds: int = 0  # rounds with context drafts
    mixed_rounds: int = 0  # rounds with both (context drafts before the layer's or after)
    context_drafted: int = 0
    context_accepted: int = 0
    pool_drafted: int = 0  # context draft tokens from the draft pool (included above)
    pool_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    policy_s: float = 0.0  # statistics work between rounds (DEL's shadow tokens)
    policy_share: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


@dataclass
class Decoded:
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length", "cancelled" (by its caller)
    stats: Stats
    trace: list[dict[str, Any]] | None = None
    logprobs: list[TokenLogprob] | None = None


class Decoding:
    """One sequence being decoded. See the module docstring.

    `logprobs=k` records, for every generated token, its log-probability under the model's
    own next-token distribution (the verifier's, so the same under every strategy) and the k
    most likely tokens'. With `constraint`, the output matches its grammar (`Engine`): context
    drafts are cut at their first token it rejects and, for a strategy that drafts, the
    tokens it forces are drafted when the context offers none that it accepts.

    With a `pool` (`DraftPool`), a strategy that drafts from its context may also draft from
    earlier replies; `finish` adds this reply to the pool (under every strategy).
    """

    def __init__(
        self,
        model: Transformer,
        prompt_ids: Sequence[int],
        policy: Policy,
        *,
        sampling: Sampling | None = None,
        max_new_tokens: int = 128,
        eos_token_ids: Sequence[int] = (),
        exit_head: ExitHead | None = None,
        trace: bool = False,
        slot: int = 0,
        logprobs: int | None = None,
        constraint: Constraint | None = None,
        pool: DraftPool | None = None,
    ) -> None:
        self.prompt = _checked_prompt(prompt_ids, max_new_tokens, model.config.max_position)
        self.max_new_tokens = max_new_tokens
        self.policy = policy
        self.eos = frozenset(eos_token_ids)
        head = (exit_head or ExitHead(model)).for_prompt(self.prompt)
        self.engine = Engine(
            model,
            sampling or Sampling(),
            tuple(eos_token_ids),
            head,
            slot,
            policy.context_ngrams,
            constraint,
            pool,
        )
        self.pool_offered = 0  # how many of `proposal`'s tokens came from the pool
        self.capacity = min(model.config.max_position, len(self.prompt) + max_new_tokens)
        self.totals = _Totals(model.num_layers, len(self.prompt))
        self.rounds: list[dict[str, Any]] | None = [] if trace else None
        policy.traced = trace
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.top_logprobs = logprobs or 0
        self.finish_reason: str | None = None  # set once it stops early
        self.prefill_s = self.decode_s = 0.0
        self.cached_tokens = 0  # prompt positions its slot held already (not prefilled)
        policy.start(head)

    @property
    def model(self) -> Transformer:
        return self.engine.model

    @property
    def tokens(self) -> list[int]:
        """The sequence so far: the prompt and the tokens committed after it."""
        return self.engine.tokens

    @property
    def slot(self) -> int:
        """The model's KV cache slot the sequence runs on."""
        return self.engine.slot

    @property
    def generated(self) -> int:
        return len(self.engine.tokens) - len(self.prompt)

    @property
    def done(self) -> bool:
        room = self.capacity - len(self.engine.tokens)
        return self.finish_reason is not None or self.generated >= self.max_new_tokens or room <= 0

    @property
    def warmup_window(self) -> int:
        """The prompt positions whose states the policy's warm-up scores (they are run in the
        prefill pass, never taken from a cache)."""
        policy = self.policy
        return policy.warmup_window if policy.collect_hidden else 0

    def start(self, cached: int = 0) -> None:
        """Prefill the prompt into the sequence's cache slot, but for its first `cached`
        positions, which the slot holds already (at most the rows before `warmup_window`)."""
        t0 = time.perf_counter()
        self.cached_tokens = cached
        self.engine.prefill(self.prompt, self.capacity, self.warmup_window, cached)
        synchronize(self.model.device)
        self.prefill_s = time.perf_counter() - t0

    def begin(self, cached: int = 0) -> None:
        """Start the sequence without prefilling it: its caller runs the prompt's rows through
        the layers (`delspec.decoding.prefill`); its slot holds the first `cached` already."""
        self.engine.begin(self.prompt, self.capacity)
        self.prefill_s = 0.0
        self.cached_tokens = cached

    @property
    def draft_room(self) -> int:
        """How many draft tokens the next round may verify: within the budget and the cache."""
        room = self.capacity - len(self.engine.tokens)
        return min(self.max_new_tokens - self.generated - 1, room - 1)

    def proposal(self, limit: int) -> list[int]:
        """Up to `limit` context draft tokens for a batched step (none unless the strategy
        drafts from the context), through the first end of sequence."""
        limit = min(limit, self.draft_room)
        proposal = NO_PROPOSAL
        if self.policy.context_ngrams is not None:
            proposal = self.engine.propose(limit)
        tokens = through_eos(proposal.tokens, self.eos)
        kept = self._under_grammar(tokens, limit)
        self.pool_offered = _common_prefix(kept, tokens) if proposal.source == POOL else 0
        return kept

    def _under_grammar(self, tokens: list[int], limit: int) -> list[int]:
        """Context draft `tokens` under the grammar (unchanged without one): cut at the first
        one it rejects; when none is left, the tokens it forces (for a strategy that drafts),
        up to `limit` and the first end of sequence."""
        grammar = self.engine.grammar
        if grammar is None:
            return tokens
        tokens = tokens[: grammar.valid(tokens)]
        if not tokens and self.policy.speculates and limit > 0:
            tokens = through_eos(grammar.forced()[:limit], self.eos)
        return tokens

    def advance(self) -> tuple[list[int], int]:
        """One round as the policy plans it: the tokens it committed (up to EOS) and how many of
        them were accepted drafts."""
        t0 = time.perf_counter()
        policy, engine = self.policy, self.engine
        budget = self.draft_room
        proposal = engine.propose(min(budget, policy.context_limit))
        plan = policy.plan(proposal)
        context_drafts = self._under_grammar(list(plan.context_drafts[:budget]), budget)
        cap = min(plan.draft_cap, budget - len(context_drafts))
        # (after how many drafts, how many) draft tokens came from the pool (not the grammar)
        from_pool = _common_prefix(context_drafts, plan.context_drafts)
        pooled = [0, from_pool if proposal.source == POOL else 0]
        then = None
        if policy.context_ngrams is not None:

            def then(drafted: list[int], last: bool) -> list[int]:
                limit = min(budget - len(drafted), policy.context_limit)
                proposal = engine.propose(limit, drafted)
                layer_drafts = len(drafted) - len(context_drafts)
                taken = policy.follow(proposal, layer_drafts, last)[:limit]
                if taken and proposal.source == POOL:
                    pooled[:] = [len(drafted), len(taken)]
                return taken

        record = engine.round(
            plan.exit_layer,
            cap,
            policy.keep_drafting,
            policy.collect_hidden,
            plan.level,
            context_drafts,
            then,
        )
        t_obs = time.perf_counter()
        policy.observe(record)
        self.totals.add(record, time.perf_counter() - t_obs)
        self.totals.pooled(record.accepted, *pooled)
        tokens = self._committed(record)
        synchronize(self.model.device)
        self.decode_s += time.perf_counter() - t0
        return tokens, min(record.accepted, len(tokens))

    def commit(
        self, context_drafts: list[int], logits: Tensor, seconds: float
    ) -> tuple[list[int], int]:
        """Settle a round computed outside (`step_together`, which took `seconds`): the full
        model's `logits` after the newest token and each of the `context_drafts` tokens. Returns
        the committed tokens (up to EOS) and how many of them were accepted drafts."""
        record = self.engine.settle(context_drafts, logits)
        self.engine.discard_warmup()
        record.verify_s = seconds
        self.totals.add(record, 0.0)
        self.totals.pooled(record.accepted, 0, min(len(context_drafts), self.pool_offered))
        self.pool_offered = 0
        self.decode_s += seconds
        tokens = self._committed(record)
        return tokens, min(record.accepted, len(tokens))

    def _committed(self, record: Round) -> list[int]:
        """The round's tokens up to an EOS (which stops the sequence); traces and log-
        probabilities noted."""
        tokens = record.tokens
        stop_at = next((i for i, t in enumerate(tokens) if t in self.eos), None)
        if stop_at is not None:
            engine = self.engine
            del engine.tokens[len(engine.tokens) - len(tokens) + stop_at + 1 :]
            tokens = tokens[: stop_at + 1]
            self.finish_reason = "stop"
        if self.rounds is not None:
            self.rounds.append(_trace_entry(self.totals.stats.rounds, record))
        if self.logprobs is not None:
            self.logprobs.extend(_logprobs(record.logits, tokens, self.top_logprobs))
        return tokens

    def stop(self, reason: str = "stop") -> None:
        """End the sequence here: "stop" (a stop string), or "cancelled" (its caller)."""
        self.finish_reason = reason

    def held(self, written: int | None = None) -> Held:
        """What the sequence's cache slot holds once its first `written` positions are cached
        (None: every position but the newest token's, which no pass has run yet)."""
        tokens = self.engine.tokens
        written = len(tokens) - 1 if written is None else written
        return Held.of(self.prompt, tokens, written, self.model)

    def run(self, on_round: OnRound | None = None) -> Decoded:
        """Start, then advance to the end: an EOS token, the budget or the model's context, or
        `on_round(tokens, accepted_drafts)` returning False after a round. Greedy output equals
        plain autoregressive greedy output; sampled output follows the same distribution."""
        self.start()
        while not self.done:
            tokens, accepted = self.advance()
            if on_round is not None and not on_round(tokens, accepted):
                self.stop()
        return self.finish()

    def finish(self) -> Decoded:
        """What the sequence decoded, with its statistics (its policy `finish`ed, in the decode
        time)."""
        t0 = time.perf_counter()
        self.policy.finish()
        self.decode_s += time.perf_counter() - t0
        new = self.engine.tokens[len(self.prompt) :][: self.max_new_tokens]
        stats = self.totals.finish(len(new), self.prefill_s, self.decode_s)
        stats.cached_tokens = self.cached_tokens
        if self.engine.pool is not None:  # whatever the strategy: the reply is the model's
            self.engine.pool.add(self.prompt, new)
        logprobs = None if self.logprobs is None else self.logprobs[: len(new)]
        return Decoded(new, self.finish_reason or "length", stats, self.rounds, logprobs)


class _Totals:
    """Sums over a generation's rounds, and the `Stats` they give."""

    def __init__(self, num_layers: int, prompt_tokens: int) -> None:
        self.num_layers = num_layers
        self.stats = Stats(prompt_tokens=prompt_tokens)
        self.layer_loads = self.exit_sum = 0

    def add(self, record: Round, policy_s: float) -> None:
        """Count a finished round whose `observe` took `policy_s` seconds."""
        stats = self.stats
        stats.policy_s += policy_s
        stats.draft_s += record.draft_s
        stats.verify_s += record.verify_s
        n, accepted, after = len(record.drafted), record.accepted, record.context_after
        stats.rounds += 1
        stats.drafted += n
        stats.accepted += accepted
        layer_drafts = record.layer_drafts
        if record.from_context or after:
            stats.context_rounds += 1
            stats.mixed_rounds += layer_drafts > 0
            stats.context_drafted += record.from_context + after
            stats.context_accepted += min(accepted, record.from_context)
            stats.context_accepted += max(0, accepted - (n - after))
        self.layer_loads += record.exit_layer * layer_drafts + self.num_layers
        if layer_drafts:
            self.exit_sum += record.exit_layer
            stats.layer_rounds += 1

    def pooled(self, accepted: int, offset: int, count: int) -> None:
        """Count `count` context draft tokens of a round that came from the draft pool, drafted
        after its first `offset` drafts, of which the round accepted `accepted` drafts."""
        if count:
            self.stats.pool_drafted += count
            self.stats.pool_accepted += min(count, max(0, accepted - offset))

    def finish(self, new_tokens: int, prefill_s: float, decode_s: float) -> Stats:
        """The statistics of a generation of `new_tokens` tokens with these timings."""
        stats = self.stats
        stats.new_tokens = new_tokens
        stats.prefill_ms = prefill_s * 1000
        stats.decode_ms_per_token = decode_s * 1000 / max(1, new_tokens)
        stats.tokens_per_s = new_tokens / decode_s if decode_s > 0 else 0.0
        stats.acceptance_rate = stats.accepted / stats.drafted if stats.drafted else None
        loads = self.layer_loads
        stats.etpl = (stats.accepted + stats.rounds) / loads if loads else 0.0
        stats.mean_draft_length = stats.drafted / stats.rounds if stats.rounds else 0.0
        rounds = stats.layer_rounds
        stats.mean_exit_layer = self.exit_sum / rounds if rounds else None
        stats.policy_share = stats.policy_s / decode_s if decode_s > 0 else 0.0
        return stats


def _trace_entry(index: int, record: Round) -> dict[str, Any]:
    return {
        "round": index,
        "position": record.position,
        "exit_layer": record.exit_layer,
        "level": record.level,
        "drafted": len(record.drafted),
        "from_context": record.from_context,
        "context_after": record.context_after,
        "accepted": record.accepted,
        "committed": len(record.tokens),
        "draft_ms": round(record.draft_s * 1000, 3),
        "verify_ms": round(record.verify_s * 1000, 3),
        **{
            (k[:-2] + "_ms" if k.endswith("_s") else k): (
                round(v * 1000, 3) if k.endswith("_s") else v
            )
            for k, v in record.extra.items()
        },
    }


def _logprobs(logits: Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the row of `logits` that predicted it, and the `top`
    most likely tokens'."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), -1)
    chosen = logp.gather(-1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    if not top:
        return [(value, []) for value in chosen]
    best = logp.topk(top, -1)
    ids, values = best.indices.tolist(), best.values.tolist()
    return [(value, list(zip(ids[i], values[i], strict=True))) for i, value in enumerate(chosen)]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _checked_prompt(prompt_ids: Sequence[int], max_new_tokens: int, max_position: int) -> list[int]:
    """`prompt_ids` as a list; `ConfigError` or `ContextLengthError` when there is nothing to
    generate from or no room in the model's `max_position` positions (its context)."""
    if not is_integer(max_new_tokens) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    prompt = list(prompt_ids)
    if not prompt:
        raise ConfigError("the prompt is empty")
    if len(prompt) >= max_position:
        raise ContextLengthError(
            f"the prompt has {len(prompt)} tokens but the model's context is {max_position} tokens"
        )
    return prompt

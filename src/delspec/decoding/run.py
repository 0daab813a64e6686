"""A `DecodeConfig` resolved against one model, once: checked, and what every run of it needs.

`resolve(config, lm)` checks the config against the loaded model (its depth, the draft head's
options) and returns a `ResolvedConfig`: the policy factory, the draft head and `decoding`, which
assembles one sequence's run. The library's `generate`, the server (its own config at start,
a request's own options on arrival), its worker and the benchmark backends build their runs
from it; nothing else makes policies or draft heads for a run.

(`DecodeConfig` itself sits below the layers that hold policies and draft heads, so the
resolution lives here, in the decoding layer, which may import them.)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from delspec.decode_config import DecodeConfig
from delspec.decoding.grammar import Constraint, Grammar
from delspec.decoding.sampling import Sampling
from delspec.decoding.sequence import Decoding
from delspec.drafting.draft_head import DraftSpec, build_draft_head, draft_spec
from delspec.drafting.draft_pool import DraftPool
from delspec.drafting.exit_head import ExitHead
from delspec.policies import PolicyInputs, make_policy
from delspec.policies.protocol import Policy

if TYPE_CHECKING:
    from delspec.weights.loading import LoadedModel


class ResolvedConfig:
    """`config` checked against `lm` (`resolve`): what each run of it is built from.

    Shared by every run of the config (the server's by all its requests that keep its options):
    each run gets a policy of its own (`new_policy`; a policy holds one sequence's state) and
    the one draft head (a head keeps per-sequence state only in the copy `for_prompt` makes).
    """

    def __init__(self, config: DecodeConfig, lm: LoadedModel, draft: DraftSpec) -> None:
        self.config, self.lm, self.draft = config, lm, draft

    @property
    def strategy(self) -> str:
        return self.config.strategy

    def new_policy(self, budget: int | None = None) -> Policy:
        """A fresh policy of the config for one sequence of at most `budget` new tokens (None:
        unbounded; the config is checked already), with the loaded model's machine profile and
        what its earlier runs learned."""
        lm = self.lm
        inputs = PolicyInputs(lm.machine, lm.learned, budget)
        return make_policy(self.config, lm.model.num_layers, inputs)

    def warm_up(self) -> None:
        """Build the draft head and measure now what a first run would otherwise measure inside
        it (the cost profile, thoroughly): for a process that times or serves many runs."""
        self.new_policy().measure_costs(self.draft_head)

    @functools.cached_property
    def draft_head(self) -> ExitHead:
        """The exit head drafts are made with, built on first use (by the thread that runs the
        decodings: the server's worker, not the request that resolved the config)."""
        return build_draft_head(self.lm, self.draft)

    def decoding(
        self,
        prompt_ids: Sequence[int],
        *,
        sampling: Sampling | None = None,
        max_new_tokens: int = 128,
        trace: bool = False,
        slot: int = 0,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
        draft_pool: DraftPool | None = None,
    ) -> Decoding:
        """A `Decoding` of `prompt_ids` (not started) with a new policy and the draft head, on
        cache slot `slot`, stopping at the model's end-of-sequence tokens: greedy unless
        `sampling`, at most `max_new_tokens`, its rounds traced with `trace`, the `logprobs`
        most likely tokens recorded per token, its output under `grammar`, drafting also from
        `draft_pool` (which gets its reply). See `Decoding`."""
        lm = self.lm
        return Decoding(
            lm.model,
            prompt_ids,
            self.new_policy(max_new_tokens),
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            eos_token_ids=lm.eos_token_ids,
            exit_head=self.draft_head,
            trace=trace,
            slot=slot,
            logprobs=logprobs,
            constraint=None if grammar is None else Constraint(lm, grammar),
            pool=draft_pool,
        )


def resolve(config: DecodeConfig, lm: LoadedModel) -> ResolvedConfig:
    """`config` checked against `lm` once: `ConfigError` for an option the model rules out (an
    exit layer past its depth, a draft vocabulary past its own, int8 drafts its device cannot
    run), `ModelFormatError` for adapters that do not fit it or cannot be read."""
    config.check_depth(lm.model.num_layers)
    return ResolvedConfig(config, lm, draft_spec(lm, config))

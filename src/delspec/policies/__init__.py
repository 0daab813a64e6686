"""Decoding policies: what each round drafts, kept apart from how rounds run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from delspec.decode_config import (
    STRATEGIES,
    DecodeConfig,
    DELOptions,
    DVOptions,
    FSOptions,
    LookupOptions,
    NoOptions,
    StaticOptions,
)
from delspec.policies.dynamic_exit import DynamicExit
from delspec.policies.fast_dynamic_exit import FastDynamicExit
from delspec.policies.fast_state import NO_INPUTS, PolicyInputs
from delspec.policies.fixed import (
    Autoregressive,
    ContextLookup,
    DraftAndVerify,
    FiniteStateDraft,
    Static,
)
from delspec.policies.protocol import Plan, Policy


def _dynamic_exit(
    num_layers: int, options: DELOptions, inputs: PolicyInputs = NO_INPUTS
) -> DynamicExit:
    """The paper's DEL, or `FastDynamicExit` (with `inputs`) when `options` turn on any of its
    additions."""
    if options.uses_fast_additions:
        return FastDynamicExit(num_layers, options, inputs)
    return DynamicExit(num_layers, options)


# What makes the policy that runs a strategy (from the model's depth and the strategy's
# options), by the type of the strategy's options.
POLICIES: dict[type, Callable[[int, Any], Policy]] = {
    NoOptions: Autoregressive,
    StaticOptions: Static,
    FSOptions: FiniteStateDraft,
    DVOptions: DraftAndVerify,
    LookupOptions: ContextLookup,
    DELOptions: _dynamic_exit,
}


def make_policy(
    config: DecodeConfig | str,
    num_layers: int,
    inputs: PolicyInputs = NO_INPUTS,
    **options: Any,
) -> Policy:
    """The policy of `config` for a model with `num_layers` layers. `config` may be a strategy
    name, and `options` update it (`DecodeConfig.updated`). A policy that measures costs or
    carries what earlier runs learned takes them, and the run's budget, from `inputs`. Raises
    `ConfigError` for unknown names and bad values."""
    if isinstance(config, str):
        config, options = DecodeConfig(), {"strategy": config, **options}
    config = config.updated(**options) if options else config
    policy: Policy
    if isinstance(config.options, DELOptions):
        policy = _dynamic_exit(num_layers, config.options, inputs)
    else:
        policy = POLICIES[type(config.options)](num_layers, config.options)
    policy.name = config.strategy
    return policy


__all__ = ["POLICIES", "STRATEGIES", "Plan", "Policy", "PolicyInputs", "make_policy"]

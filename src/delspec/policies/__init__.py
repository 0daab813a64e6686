"""Decoding policies: what each round drafts, kept apart from how rounds run."""

from __future__ import annotations

from typing import Any

from delspec.decode_config import (
    STRATEGIES,
    DecodeConfig,
    DELOptions,
    DVOptions,
    FSOptions,
    NoOptions,
    StaticOptions,
)
from delspec.policies.base import Plan, Policy
from delspec.policies.dynamic_exit import DynamicExit
from delspec.policies.fixed import Autoregressive, DraftAndVerify, FiniteStateDraft, Static

# The policy that runs a strategy, by the type of the strategy's options.
POLICIES: dict[type, type[Policy]] = {
    NoOptions: Autoregressive,
    StaticOptions: Static,
    FSOptions: FiniteStateDraft,
    DVOptions: DraftAndVerify,
    DELOptions: DynamicExit,
}


def make_policy(config: DecodeConfig | str, num_layers: int, **options: Any) -> Policy:
    """The policy of `config` for a model with `num_layers` layers. `config` may be a strategy
    name, and `options` update it (`DecodeConfig.updated`). Raises `ConfigError` for unknown
    names and bad values."""
    if isinstance(config, str):
        config, options = DecodeConfig(), {"strategy": config, **options}
    config = config.updated(**options) if options else config
    policy = POLICIES[type(config.options)](num_layers, config.options)
    policy.name = config.strategy
    return policy


__all__ = ["POLICIES", "STRATEGIES", "Plan", "Policy", "make_policy"]

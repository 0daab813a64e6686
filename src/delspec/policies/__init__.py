"""Decoding policies by name: what each round drafts, kept apart from how rounds run."""

from __future__ import annotations

from typing import Any

from delspec.errors import ConfigError
from delspec.policies.base import Plan, Policy
from delspec.policies.dynamic_exit import DynamicExit
from delspec.policies.fixed import Autoregressive, DraftAndVerify, FiniteStateDraft, Static

STRATEGIES: dict[str, Any] = {
    "del": DynamicExit,
    "dele": lambda num_layers, **kw: DynamicExit(num_layers, dynamic_draft=False, **kw),
    "static": Static,
    "fs": FiniteStateDraft,
    "dv": DraftAndVerify,
    "ar": Autoregressive,
}


def make_policy(strategy: str, num_layers: int, **options: Any) -> Policy:
    """Build the named policy for a model with `num_layers` layers; unknown names and options
    raise `ConfigError`."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
    try:
        return STRATEGIES[strategy](num_layers, **options)
    except TypeError as exc:
        raise ConfigError(f"strategy {strategy!r}: {exc}") from exc


__all__ = ["STRATEGIES", "Plan", "Policy", "make_policy"]

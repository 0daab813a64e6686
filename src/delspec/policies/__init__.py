"""Decoding policies by name: what each round drafts, kept apart from how rounds run."""

from __future__ import annotations

from typing import Any

import torch

from delspec.errors import ConfigError
from delspec.kernels.products import int8_supported
from delspec.policies.base import Plan, Policy
from delspec.policies.dynamic_exit import DynamicExit
from delspec.policies.fixed import Autoregressive, DraftAndVerify, FiniteStateDraft, Static

# DEL with the CPU/stock-checkpoint improvements: measured costs, no-draft rounds, shadow work
# bounded to ~1% of round time, acceptance in runs, and drafting only from layers seen at 3+
# positions. The first round scores 4 prompt positions (once, not charged to the budget) so
# that a layer worth drafting from is known from the start of a short reply.
FAST_DEL = dict(
    cost="measured", no_draft=True, shadow_budget=0.01, warmup=4, runs=True, min_evidence=3
)
# del-fast drafts with the LM-head rows of the most frequent tokens (when the vocabulary is at
# least twice as large): drafting and shadow tokens then cost a fraction of the full head. Its
# cost model picks, per round, this many rows, twice or four times as many (up to half the
# vocabulary), or the full head: a larger one costs more per draft token and may accept more.
FAST_DRAFT_VOCAB = 16384
FAST_VOCAB_LEVELS = 3

DEFAULT_STRATEGY = "del-fast"


def default_draft_vocab(strategy: str, vocab_size: int) -> list[int | None] | None:
    """The draft vocabularies `draft_vocab="auto"` means: for `del-fast` on a vocabulary of at
    least twice `FAST_DRAFT_VOCAB`, that many tokens, up to `FAST_VOCAB_LEVELS - 1` doublings
    that stay within half the vocabulary, and the full vocabulary (None); else None (no
    pruning)."""
    if strategy != "del-fast" or vocab_size < 2 * FAST_DRAFT_VOCAB:
        return None
    sizes = [FAST_DRAFT_VOCAB << i for i in range(FAST_VOCAB_LEVELS)]
    return [k for k in sizes if 2 * k <= vocab_size] + [None]


def default_int8_draft(strategy: str, device: torch.device) -> bool:
    """Whether `int8_draft="auto"` drafts on int8 weights: for `del-fast`, whose cost model
    weighs the cheaper drafts against verifying every layer again, where the device runs them."""
    return strategy == "del-fast" and int8_supported(device)


STRATEGIES: dict[str, Any] = {
    "del": DynamicExit,
    "dele": lambda num_layers, **kw: DynamicExit(num_layers, dynamic_draft=False, **kw),
    "del-fast": lambda num_layers, **kw: DynamicExit(num_layers, **{**FAST_DEL, **kw}),
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
        policy = STRATEGIES[strategy](num_layers, **options)
    except TypeError as exc:
        raise ConfigError(f"strategy {strategy!r}: {exc}") from exc
    policy.name = strategy
    return policy


__all__ = [
    "DEFAULT_STRATEGY",
    "FAST_DRAFT_VOCAB",
    "STRATEGIES",
    "Plan",
    "Policy",
    "default_draft_vocab",
    "default_int8_draft",
    "make_policy",
]

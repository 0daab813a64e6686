"""delspec: DEL (Dynamic Exit Layer) self-speculative decoding."""

import os

# OpenMP's idle threads spin 300,000 pauses (libgomp's default) before they sleep: on a busy
# machine, torch's pool threads then take the cores from the thread doing the work between
# parallel regions. 10,000 (unless the user set it; only read when libgomp loads, so only when
# delspec is imported before torch, as the CLI does) gives those cores back sooner under load
# and costs nothing on a quiet machine.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from delspec.decode_config import PRESETS, DecodeConfig, DraftConfig
from delspec.decoding.generate import Result, Stats, generate
from delspec.decoding.grammar import Grammar, json_grammar
from delspec.decoding.sampling import Sampling
from delspec.decoding.session import Session
from delspec.drafting.draft_pool import DraftPool
from delspec.errors import ConfigError, ContextLengthError, DelspecError, ModelFormatError
from delspec.weights.loading import LoadedModel, load_model

__all__ = [
    "PRESETS",
    "ConfigError",
    "ContextLengthError",
    "DecodeConfig",
    "DelspecError",
    "DraftConfig",
    "DraftPool",
    "Grammar",
    "LoadedModel",
    "ModelFormatError",
    "Result",
    "Sampling",
    "Session",
    "Stats",
    "generate",
    "json_grammar",
    "load_model",
]

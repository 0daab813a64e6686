"""delspec: DEL (Dynamic Exit Layer) self-speculative decoding."""

from delspec.decode_config import PRESETS, DecodeConfig, DraftConfig
from delspec.errors import ConfigError, ContextLengthError, DelspecError, ModelFormatError
from delspec.generate import Result, Stats, generate
from delspec.loading import LoadedModel, load_model
from delspec.sampling import Sampling

__all__ = [
    "PRESETS",
    "ConfigError",
    "ContextLengthError",
    "DecodeConfig",
    "DelspecError",
    "DraftConfig",
    "LoadedModel",
    "ModelFormatError",
    "Result",
    "Sampling",
    "Stats",
    "generate",
    "load_model",
]

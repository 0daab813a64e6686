"""delspec: DEL (Dynamic Exit Layer) self-speculative decoding."""

from delspec.errors import ConfigError, ContextLengthError, DelspecError, ModelFormatError
from delspec.generate import Result, Stats, generate
from delspec.loading import LoadedModel, load_model

__all__ = [
    "ConfigError",
    "ContextLengthError",
    "DelspecError",
    "LoadedModel",
    "ModelFormatError",
    "Result",
    "Stats",
    "generate",
    "load_model",
]

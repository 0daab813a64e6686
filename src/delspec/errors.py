"""Errors that delspec reports to users as a message, never as a traceback."""

from numbers import Integral, Real
from typing import Any

from safetensors import SafetensorError

# What libraries raise on a file they cannot read; reported as a ModelFormatError.
LIBRARY_ERRORS = (OSError, ValueError, LookupError, TypeError, RuntimeError, SafetensorError)


class DelspecError(Exception):
    """Base class: the message alone tells the user what is wrong."""


class ModelFormatError(DelspecError):
    """A model source is missing, unreadable, corrupt, or of an unsupported kind."""


class ContextLengthError(DelspecError):
    """A prompt does not fit in the model's context."""


class ConfigError(DelspecError, ValueError):
    """An invalid generation or strategy parameter."""


def is_integer(value: Any) -> bool:
    """Whether `value` is an integer (Python's or numpy's), not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether `value` is a real number (an integer or a float), not a bool."""
    return isinstance(value, Real) and not isinstance(value, bool)

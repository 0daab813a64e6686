"""Errors that delspec reports to users as a message, never as a traceback."""

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

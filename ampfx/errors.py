"""ampfx's own exception classes, each a subclass of the builtin a caller would already catch."""
from __future__ import annotations


class TrainingModeError(RuntimeError):
    """A converted module called in a training mode it has no conversion for: the message names
    the mode, why that mode's conversion is missing and how to get one (convert the model in it)."""

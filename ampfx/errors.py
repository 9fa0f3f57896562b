"""ampfx's own error classes, one per concern; each subclasses the builtin an ``except`` clause would expect."""
from __future__ import annotations


class GuardError(ValueError):
    """A converted module was called with inputs outside what it was converted for (structure,
    tensor kind, rank, a specialised size or a value fixed while tracing): see :mod:`ampfx.guards`.
    The message names the input, what it was converted for, what it got, and the fix."""


class ExampleInputsError(ValueError):
    """The model itself does not run on the ``example_inputs`` given to :func:`ampfx.convert`."""

"""ampfx's own error classes, one per concern; each subclasses the builtin an ``except`` clause would expect."""
from __future__ import annotations

from .policy import PolicyError


class StaleModelError(RuntimeError):
    """The model (or the converted module) was changed after :func:`ampfx.convert` in a way the
    converted module cannot follow (a submodule swapped where a graph traced through it, a
    parameter of another shape, a parametrization added, weights made another low dtype), or a
    value a graph fixed while tracing keeps changing past ``reconvert_limit``: calling it would
    compute with what it was converted from. The message names what changed and the fix."""


class UninitializedModelError(ValueError):
    """The model has lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``, ...) whose parameters
    are not initialised yet. Initialising them changes the model itself (the converted module
    must share those parameters), which :func:`ampfx.convert` never does: run the model once
    first, as torch asks before an optimizer is built."""


class TrainingModeError(RuntimeError):
    """A converted module called in a training mode it has no conversion for: the message names
    the mode, why that mode's conversion is missing and how to get one (convert the model in it)."""


class ArgumentError(PolicyError, TypeError):
    """A bad argument to :func:`ampfx.convert` (or the ``ampfx`` command): the wrong kind of
    object or a value out of range. The message names the argument, what was expected and the
    fix. A ``PolicyError`` (so a ``ValueError``) and a ``TypeError``, so either ``except`` works."""


class GuardError(ValueError):
    """A converted module was called with inputs outside what it was converted for (structure,
    tensor kind, rank, a specialised size or a value fixed while tracing): see :mod:`ampfx.guards`.
    The message names the input, what it was converted for, what it got, and the fix."""


class ExampleInputsError(ValueError):
    """The model itself does not run on the ``example_inputs`` given to :func:`ampfx.convert`."""


class OpRegistrationError(PolicyError):
    """A bad :func:`ampfx.register_op` call: a target that is not an op, a category that is not a
    list, an argument slot the op does not have, an op ampfx's tables already hold, or a second
    registration with another rule (``replace=True`` allows it). A ``PolicyError``, so a ``ValueError``."""

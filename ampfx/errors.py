"""ampfx's own error classes, one per concern; each subclasses the builtin an ``except`` clause would expect."""
from __future__ import annotations

from .policy import PolicyError


class ArgumentError(PolicyError, TypeError):
    """A bad argument to :func:`ampfx.convert` (or the ``ampfx`` command): the wrong kind of
    object or a value out of range. The message names the argument, what was expected and the
    fix. A ``PolicyError`` (so a ``ValueError``) and a ``TypeError``, so either ``except`` works."""

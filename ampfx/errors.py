"""Every error class of ampfx, one per concern; each subclasses the builtin an ``except`` clause would
expect. This module imports nothing of ampfx: every other module may raise from it.

The public ones (re-exported by :mod:`ampfx`) are raised to users; the internal ones at the end are
signals between the capture stages (a capture that failed takes the next rung) and never reach a user.
"""
from __future__ import annotations

import difflib
import sys
import warnings
from typing import Any, Iterable, Mapping


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line that called ampfx (the first frame outside ampfx, its passes
    and the wrappers of its decorators), however deep inside a conversion it is said."""
    frame, level = sys._getframe(1), 2
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] in _THROUGH:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


_THROUGH = ("ampfx", "contextlib", "functools")
"""The modules :func:`warn_user` looks through: ampfx's and the wrappers of its decorators."""


class PolicyError(ValueError):
    """A bad policy value: the message names the option or variable, the value and a close match."""


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
    tensor kind, rank, a specialised size or a value fixed while tracing): see :mod:`ampfx.runtime.guards`.
    The message names the input, what it was converted for, what it got, and the fix."""


class BakedValueError(GuardError):
    """A :class:`GuardError` for a value the graph holds as it was while tracing (``None`` for an optional
    argument, a flag): a converted module that can convert again does so for the call's value, as for a
    changed attribute (within ``reconvert_limit``); otherwise it raises this."""


class PlanSizeError(BakedValueError):
    """A call whose sizes cross a size-dependent dtype decision of the graph (:class:`ampfx.runtime.guards.Scale`):
    planned again for them, as for a value the graph holds (within ``reconvert_limit``); where it cannot be, the
    plan runs as it is (its numbers are right, only its speed was planned for other sizes)."""


class PathError(ArgumentError, OSError):
    """A path given to ampfx to write to (``Report.save``'s directory, ``log_path`` / ``AMPFX_LOG_PATH``, a plot's
    file, an ``ampfx`` command's ``--out``) where nothing can be written: the message names the argument, the path
    and what stands in the way. An :class:`ArgumentError` and an ``OSError``, so ``except OSError`` still works."""


class ExampleInputsError(ValueError):
    """The model itself does not run on the ``example_inputs`` given to :func:`ampfx.convert`."""


class OpRegistrationError(PolicyError):
    """A bad :func:`ampfx.register_op` call: a target that is not an op, a category that is not a
    list, an argument slot the op does not have, an op ampfx's tables already hold, or a second
    registration with another rule (``replace=True`` allows it). A ``PolicyError``, so a ``ValueError``."""


class TuneError(RuntimeError):
    """No set of nodes kept float32 brings the metric within tolerance (or the budget ran out
    before one was found): the message gives the metrics measured and what to change."""


class NonFiniteError(FloatingPointError):
    """Raised by a debugged module (:func:`ampfx.tools.debug`) at the first non-finite value; says where and why."""

    def __init__(self, node: str, op: str, module: str, dtype: Any, inputs: list[str], phase: str) -> None:
        self.node, self.op, self.module, self.dtype, self.inputs, self.phase = node, op, module, dtype, inputs, phase
        where = f"{module}.{op}" if module else op
        computing = "None" if dtype is None else str(dtype).removeprefix("torch.")
        super().__init__(f"{phase}: {where} (node {node!r}, computing in {computing}) "
                         f"produced inf/NaN from finite inputs; input ranges: {'; '.join(inputs) or 'none'}")


class AutocastConflictError(RuntimeError):
    """``torch.autocast`` is on around a forward that ampfx converted (a trainer integration,
    :mod:`ampfx.integrations.lazy`): the two would both choose dtypes. The message names the model and
    what turned autocast on (the trainer's own mixed-precision flag, or an autocast block in the training
    step)."""


class PlanMismatchError(RuntimeError):
    """In a run of several processes, a rank converted a model to another plan than rank 0 did (:mod:`ampfx.ranks`):
    the message names the first node that differs, its dtype on both ranks, and the fix."""


class PolicyMismatchError(PolicyError):
    """A trainer checkpoint was written with another policy than the one the resumed run was given."""


class CLIError(Exception):
    """A bad command-line argument of the ``ampfx`` command; the message names it."""


ENTRY_ERRORS = (PolicyError, UninitializedModelError)
"""The user's mistakes a public entry point (:func:`ampfx.convert`, :func:`ampfx.tune`, :func:`ampfx.compare`,
``Policy(...)``) finds before any work: a bad argument, option, policy file or ``AMPFX_*`` variable. The entry
point raises them again from its own frame, without the frames inside ampfx that found them
(``raise e.with_traceback(None) from None``): the traceback a script shows ends at the call the user wrote, the
message first, as torch raises its own configuration errors."""


# ---------------------------------------------------------------------- internal: between capture stages
class RootUntraceable(RuntimeError):
    """The root module's own ``forward`` cannot be traced (:mod:`ampfx.capture.tracer`); ``steps`` says what
    was tried."""

    def __init__(self, error: BaseException, steps: list[str]):
        super().__init__(f"{type(error).__name__}: {error}")
        self.error = error
        self.steps = steps


class ExportFailed(RuntimeError):
    """``torch.export`` could not capture the model (:mod:`ampfx.capture.export`); ``steps`` says what was
    tried."""

    def __init__(self, message: str, steps: list[str]):
        super().__init__(message)
        self.steps = steps


class Unfaithful(RuntimeError):
    """The exported graph would not repeat something the forward does (:mod:`ampfx.capture.semantics`);
    ``paths``: the modules that do it ('' for the exported module itself)."""

    def __init__(self, message: str, paths: tuple[str, ...] = ()):
        super().__init__(message)
        self.paths = paths


class FoldRefused(RuntimeError):
    """A forward writes a buffer that was being read as its values while exporting
    (:mod:`ampfx.capture.fold`): the buffer is the module's state, not a constant."""


class NotReproduced(ValueError):
    """The captured graph does not run on the module's example inputs (:mod:`ampfx.rewrite`)."""


def did_you_mean(word: str, options: Iterable[str], *, cutoff: float = 0.6,
                 written: Mapping[str, str] | None = None) -> str:
    """`` Did you mean 'x' or 'y'?`` for up to three close matches of ``word``, else ``""``: the
    suffix every "unknown name" message of ampfx ends with. ``written`` maps an option to what is
    suggested for it (a class's short name to the name an entry writes), where that differs.

    >>> did_you_mean("softmx", ["softmax", "linear", "gelu"])
    " Did you mean 'softmax'?"
    >>> did_you_mean("Blok", ["Block", "head"], written={"Block": "mypkg.Block"})
    " Did you mean 'mypkg.Block'?"
    """
    written = written or {}
    hits = difflib.get_close_matches(word, list(options), n=3, cutoff=cutoff)
    hits = list(dict.fromkeys(written.get(h, h) for h in hits))
    return f" Did you mean {' or '.join(repr(h) for h in hits)}?" if hits else ""

"""The options of a :class:`~ampfx.policy.Policy` that are not numerics, one frozen record per concern.

A policy is a numerics core (the dtype, the op lists, modules kept float32, thresholds, the fidelity rules,
FP8) with three records beside it, as torch.ao keeps its configs apart:

- :class:`CaptureOptions` (``policy.capture``): how the model becomes graphs (leaf modules, modules kept as
  boundaries, the export time limit);
- :class:`RuntimeOptions` (``policy.runtime``): what the converted module does at call time (conversions made
  again, the weight cache, handing low values through a parent's Python);
- :class:`LogOptions` (``policy.log``): where the report is saved, and the switch that converts nothing.

Every field says in its metadata how the environment sets it (:func:`env`): the environment variables, policy
files, ``ampfx lists`` and the report are derived from the metadata of all four
(:func:`ampfx.policy.option_fields`). ``Policy(...)``, ``convert(...)`` and ``dataclasses.replace`` still take
each option by its own name (``Policy(weight_cache=True)``), and ``policy.weight_cache`` reads it.

>>> CaptureOptions(keep_modules="none").keep_modules, RuntimeOptions().reconvert_limit
((), 8)
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import PolicyError
from .module_match import entries

EXPORT_TIMEOUT = 60.0
"""Seconds ``torch.export`` may take on one module (``Policy.export_timeout``). Most models export in
0.2-10 s; a few spend minutes in export's symbolic size analysis, and a capture that slow takes the
next rung instead (the report's capture steps say so)."""

RECONVERT_LIMIT = 8
"""How many conversions made again at call time one converted graph keeps (``Policy.reconvert_limit``):
torch.compile's recompile limit is 8 too. A value that changes at every call (a counter a graph reads)
reaches it fast, and the error names it."""


def env(var: str, kind: str, help: str, **more: Any) -> dict[str, Any]:
    """A Policy field's environment variable: its name, how its value is read (:data:`ampfx.policy.ENV_KINDS`) and
    its help text (``ampfx lists`` and docs/policy.md show it). The one place an option's variable is defined.
    ``more``: ``example``, a value the variable takes; ``needs``, the other fields (with a value) without which
    setting this one is an error; ``none``, what the field's ``None`` stands for (``ampfx lists`` shows it)."""
    return {"env": var, "kind": kind, "help": help, **more}


def check_bools(record: Any, *names: str) -> None:
    """Each of ``names`` is a bool on ``record`` (a string ``"no"`` is not ``False``)."""
    for name in names:
        if not isinstance(getattr(record, name), bool):
            raise PolicyError(f"{name}={getattr(record, name)!r}: use True or False")


@dataclass(frozen=True)
class CaptureOptions:
    """How the model becomes graphs (``policy.capture``)."""

    leaf_modules: tuple = field(default=(), metadata=env(
        "AMPFX_LEAF_MODULES", "append_leaves", "comma-separated module names or module types traced as opaque leaves"))
    #: modules kept as real module boundaries, each converted on its own (its forward runs: hooks, FSDP2's
    #: fully_shard, checkpoint wrappers and torch.compile see it): "auto" (repeated blocks, modules carrying hooks
    #: or wrappers: ampfx.policy.module_match.auto_kept), names, globs, classes, predicates; () keeps none
    keep_modules: tuple = field(default=("auto",), metadata=env(
        "AMPFX_KEEP_MODULES", "keep", "comma-separated modules kept as module boundaries, each converted on its own "
        "(replaces the default 'auto': repeated blocks and modules carrying hooks or wrappers); names, globs, classes, "
        "'auto'; 'none' keeps none"))
    #: seconds torch.export may take to capture one module (its tries together) before the capture takes
    #: the next rung (a torch.fx graph with leaves, or the module's own Python with its children converted);
    #: None or 0: no limit
    export_timeout: float | None = field(default=EXPORT_TIMEOUT, metadata=env(
        "AMPFX_EXPORT_TIMEOUT", "number_or_off", "seconds torch.export may take on one module before the capture "
        f"takes the next rung (default {EXPORT_TIMEOUT:g}; off: no limit)", example="60"))

    def __post_init__(self) -> None:
        leaves = self.leaf_modules
        object.__setattr__(self, "leaf_modules", (leaves,) if isinstance(leaves, (str, type)) else tuple(leaves))
        for leaf in self.leaf_modules:
            if not isinstance(leaf, (str, type)):
                raise PolicyError(f"leaf_modules: {leaf!r} is neither a module name nor a module type")
        object.__setattr__(self, "keep_modules", entries(self.keep_modules, "keep_modules"))
        timeout = self.export_timeout
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not 0 <= timeout < math.inf):
            raise PolicyError(f"export_timeout={timeout!r}: use seconds >= 0 (default {EXPORT_TIMEOUT:g}), or 0 / None "
                              "for no limit")


@dataclass(frozen=True)
class RuntimeOptions:
    """What the converted module does at call time (``policy.runtime``)."""

    #: after conversion, how many times a converted graph is converted again at a call because a value it
    #: fixed while tracing changed (an attribute, a module's mode, a global, hooks; ampfx.runtime.fixed): each time
    #: costs a conversion; past it the call raises StaleModelError naming the value. 0: raise at once
    reconvert_limit: int = field(default=RECONVERT_LIMIT, metadata=env(
        "AMPFX_RECONVERT_LIMIT", "int", "how many times a converted graph is converted again at a call when a value "
        f"it fixed changed (default {RECONVERT_LIMIT}; 0: raise StaleModelError at the first change)"))
    #: training mode: each weight a low op reads is cast once and reused by every forward, backward and recompute
    #: until its float32 master changes (ampfx.runtime.weight_cache; 2 bytes per cached bf16/fp16 element held while
    #: in use). "auto" (the default): a weight large enough that a cached read pays on the device (measured with the
    #: GEMM break-even, ampfx.ops.device_cost), cached only while its graph runs more than once between writes of its
    #: weights (gradient accumulation, recompute, evaluation) or reads it twice in a call. True: every cast weight,
    #: always. False: none
    weight_cache: bool | str = field(default="auto", metadata=env(
        "AMPFX_WEIGHT_CACHE", "bool_or_auto", "1 to keep low copies of every cast weight in training mode, made "
        "again only when a weight changes; 0 to cast weights at every forward; auto (default) to cache the weights "
        "large enough that a cached copy pays on the device, while a graph runs more than once between weight "
        "updates (gradient accumulation, recompute, evaluation)"))
    #: children of a module that keeps its Python (its control flow could not be captured) hand each other low
    #: values through its Python where it only moves them (ampfx.runtime.handing). Off by default: its per-op
    #: interception of the parent's Python costs more step time than the casts it saves (docs/benchmarks.md)
    hand_low: bool = field(default=False, metadata=env(
        "AMPFX_HAND_LOW", "bool", "1 to let converted children of a module that keeps its Python hand each other "
        "low values through it (fewer casts, but every op of that Python is intercepted; default 0)"))

    def __post_init__(self) -> None:
        check_bools(self, "hand_low")
        if self.weight_cache != "auto" and not isinstance(self.weight_cache, bool):
            raise PolicyError(f"weight_cache={self.weight_cache!r}: use True, False or 'auto' (the default)")
        limit = self.reconvert_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise PolicyError(f"reconvert_limit={limit!r}: use an integer >= 0 (default {RECONVERT_LIMIT}; 0 raises "
                              "at the first change instead of converting again)")


@dataclass(frozen=True)
class LogOptions:
    """The report's place, and the switch that converts nothing (``policy.log``)."""

    log_path: str | None = field(default=None, metadata=env(
        "AMPFX_LOG_PATH", "path", "directory where the report is saved at convert()"))
    disable: bool = field(default=False, metadata=env(
        "AMPFX_DISABLE", "bool", "1 to return an unconverted copy (the report says so)"))

    def __post_init__(self) -> None:
        check_bools(self, "disable")
        if self.log_path is not None and not isinstance(self.log_path, (str, os.PathLike)):
            raise PolicyError(f"log_path={self.log_path!r}: give a directory path (str or pathlib.Path), or None")


RECORDS: dict[str, type] = {"capture": CaptureOptions, "runtime": RuntimeOptions, "log": LogOptions}
"""The records beside the numerics core, by the Policy field that holds each."""

"""The policy: which dtype, which ops on which list, which modules stay float32.

A :class:`Policy` is a small frozen dataclass, validated when it is built and
varied with :func:`dataclasses.replace`. The same options come from Python
arguments and from environment variables; the environment is read once, by
:func:`from_env`, when :func:`ampfx.convert` starts.

Precedence, lowest first (each record in the report names the rule that won):

1. ``table``: the default op tables in :mod:`ampfx.ops` for the chosen dtype, with the ops
   libraries registered (:func:`ampfx.register_op`);
2. ``argument``: list edits given as ``Policy(...)`` arguments;
3. ``env:AMPFX_...``: list edits from the environment, applied after the arguments;
4. ``fp32_modules`` / ``module_filter_fn``: modules kept float32 by name, glob, class or predicate
   (:mod:`ampfx.policy.module_match`; either one is enough, and the report names the first entry that
   matched);
5. ``probe``: a kernel that cannot run in the low dtype on this device;
6. structural facts: non-float values, in-place ops.

Within one source, ADD is applied before REMOVE (as in TF-AMP); the
arguments' edits are applied first, then the environment's. An op that ends
on two lists is an error, so moving an op takes an ADD and a REMOVE. The
size rules for reductions (``shape:*`` in the report) refine only decisions
that come straight from the table.

>>> import torch, ampfx
>>> p = ampfx.Policy("fp16", denylist_add=("gelu",), inferlist_remove=("gelu",))
>>> p.dtype, p.category_of("gelu")
(torch.float16, (<Category.DENY: 'deny'>, 'argument', 'named in denylist_add'))

The package holds what a policy is made of: :mod:`~ampfx.policy.names` (the names users write and the
"did you mean" every unknown one gets), :mod:`~ampfx.policy.policy_file` (policies saved and loaded),
:mod:`~ampfx.policy.module_match` (module entries) and :mod:`~ampfx.policy.decide` (the module and list part of
the precedence chain).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from .. import ops
from ..ops import custom_ops
from . import fp8, module_match, policy_file
from .options import RECORDS, CaptureOptions, LogOptions, RuntimeOptions
from .options import env as _env
from ..errors import PolicyError
from .names import ENV_PREFIX, LIST_NAMES, did_you_mean, import_object, parse_dtype, resolve_op
from ..ops import LISTS, Category
from ..report.records import Rule

def _tuned_pairs(value: Any) -> tuple[tuple[str, str], ...]:
    """``tuned`` as ``((key, reason), ...)``: a mapping or pairs; a key is a node's
    :attr:`~ampfx.report.records.Decision.key` (``module:node``, or the node at the root).

    >>> _tuned_pairs({"head:linear": "tuned"})
    (('head:linear', 'tuned'),)
    """
    pairs = tuple(value.items()) if isinstance(value, Mapping) else value
    if isinstance(pairs, str) or not isinstance(pairs, Iterable):
        raise PolicyError(f"tuned={value!r}: give (node key, reason) pairs or a dict, as ampfx.tools.tune writes them")
    out: dict[str, str] = {}
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
                and pair[0].strip()):
            raise PolicyError(f"tuned: {pair!r} is not a (node key, reason) pair of strings, e.g. "
                              "('encoder.layers.0:add_3', 'kept float32 by ampfx.tools.tune')")
        out[pair[0].strip()] = pair[1]
    return tuple(out.items())


SENSITIVITY_THRESHOLD = 0.1
"""Calibration keeps float32 a node whose rounding alone moves the output or a parameter gradient by more
than this (relative): chosen by measurement, see docs/numerics.md ("Precision sensitivity")."""

FP8_ERROR_THRESHOLD = 0.1
"""With ``calibrate=`` batches and ``fp8=``, a linear layer whose FP8 output differs from its low-dtype output by
more than this (relative, on the batches) stays in the low dtype. Current scaling's rounding alone differs by
about 0.03-0.05 on ordinary activations (e4m3 keeps 3 mantissa bits); outliers that push most of a tensor's
values into FP8's subnormals or to zero go past 0.1 (docs/fp8.md)."""

GEMM_SOURCES = ("measure", "table")
"""The words ``gemm_min_flops`` takes besides a number and ``auto``: where the device's break-even comes from."""

_BOOLS = ("keep_output_dtype", "probe", "float32_stream", "float32_operands", "exact_values")


def _check_fields(p: "Policy") -> None:
    """The scalar fields have the types and ranges they need (a string ``"no"`` is not ``False``)."""
    if p.pad not in ("auto", "always", "never"):
        raise PolicyError(f"pad={p.pad!r}: use 'auto', 'always' or 'never'")
    if p.pad_multiple is not None and (not isinstance(p.pad_multiple, int) or p.pad_multiple < 2):
        raise PolicyError(f"pad_multiple={p.pad_multiple!r}: use an integer >= 2 (8 for 16-bit types)")
    for name, what in (("gemm_min_flops", "FLOPs"), ("gemm_min_rows", "rows")):
        value = getattr(p, name)
        if name == "gemm_min_flops" and value in GEMM_SOURCES:
            continue
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            words = ", or 'auto' for the device's break-even" + (
                " ('measure': measured on any device; 'table': the datasheet's, nothing measured)"
                if name == "gemm_min_flops" else "")
            raise PolicyError(f"{name}={value!r}: use a whole number of {what} >= 0 (0: no such check){words}")
    if not isinstance(p.reduction_threshold, int) or p.reduction_threshold < 1:
        raise PolicyError(f"reduction_threshold={p.reduction_threshold!r}: use a positive integer")
    for name in _BOOLS:
        if not isinstance(getattr(p, name), bool):
            raise PolicyError(f"{name}={getattr(p, name)!r}: use True or False")
    threshold = p.sensitivity_threshold
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                                  or not 0 <= threshold < math.inf):
        raise PolicyError(f"sensitivity_threshold={threshold!r}: use a relative error >= 0 (default "
                          f"{SENSITIVITY_THRESHOLD:g}), or 0 to turn the precision check of calibration off")
    error = p.fp8_error_threshold
    if error is not None and (isinstance(error, bool) or not isinstance(error, (int, float)) or not 0 <= error < math.inf):
        raise PolicyError(f"fp8_error_threshold={error!r}: use a relative error >= 0 (default {FP8_ERROR_THRESHOLD:g}), "
                          "or 0 for no FP8 check in calibration")
    margin = p.calibration_margin
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin > 0:
        raise PolicyError(f"calibration_margin={margin!r}: use a positive number (default 2.0)")
    if p.module_filter_fn is not None and not callable(p.module_filter_fn):
        raise PolicyError(f"module_filter_fn={p.module_filter_fn!r}: give a function (module, fqn) -> bool, or None")


def _set_fp8(p: "Policy") -> None:
    """``fp8`` and ``fp8_roofline`` as a preset's name (lower case) or the user's record (``fp8_roofline`` ``None``
    when not given), the FP8 module lists as entries. (FP8 options without ``fp8`` are checked once the
    environment and a policy file have had their say: :func:`check_fp8_options`.)"""
    recipe = fp8.recipe(p.fp8)
    object.__setattr__(p, "fp8", recipe.name if recipe is not None and recipe in fp8.RECIPES.values() else recipe)
    if p.fp8_roofline is not None:
        roofline = fp8.roofline(p.fp8_roofline)
        object.__setattr__(p, "fp8_roofline", "none" if roofline is None else
                           roofline.name if roofline in fp8.ROOFLINES.values() else roofline)
    for name in ("fp8_modules", "fp8_skip_modules"):
        object.__setattr__(p, name, module_match.entries(getattr(p, name), name))
    if p.fp8_modules and p.fp8_skip_modules:
        both = [e for e in p.fp8_modules if e in p.fp8_skip_modules]
        if both:
            raise PolicyError(f"{both[0]!r} is in both fp8_modules and fp8_skip_modules: name it in one")


_FP8_OPTIONS = ("fp8_roofline", "fp8_modules", "fp8_skip_modules", "fp8_error_threshold")
_FP8_WORDS = (*fp8.RECIPES, "off")
_ROOFLINE_WORDS = (*fp8.ROOFLINES, "none")
"""What ``AMPFX_FP8`` and ``AMPFX_FP8_ROOFLINE`` take (inside :class:`Policy` the name ``fp8`` is its field)."""


def check_fp8_options(p: "Policy", where: str = "") -> "Policy":
    """``p`` once the arguments, a policy file and the environment are merged: FP8 options without ``fp8`` are an
    error (they would change nothing), except where ``AMPFX_FP8=off`` turned FP8 off, which drops them (the
    switch that turns FP8 off without a code edit; the report's environment record says so)."""
    if p.fp8 is not None:
        return p
    defaults = {f.name: f.default for f in dataclasses.fields(p) if f.name in _FP8_OPTIONS}
    given = [name for name in _FP8_OPTIONS if getattr(p, name) != defaults[name]]
    if not given:
        return p
    env = dict(p.env)
    if "AMPFX_FP8" in env:
        return dataclasses.replace(p, **{name: defaults[name] for name in given})
    variables = {name: OPTION_VARS[name] for name in given if OPTION_VARS[name] in env}
    if len(variables) == len(given):  # all set by the environment: said in its words (a script or the command)
        said = ", ".join(f"{var}={env[var]}" for var in variables.values())
        raise PolicyError(f"{said} without AMPFX_FP8: set AMPFX_FP8=tensorwise (or rowwise, rowwise_with_gw_hp), or "
                          f"unset {' and '.join(variables.values())}")
    said = ", ".join(f"{name}={getattr(p, name)!r}" for name in given)
    raise PolicyError(f"{said} without fp8{where}: name an FP8 recipe (fp8='tensorwise', AMPFX_FP8=tensorwise), or "
                      "leave the FP8 options out")


@dataclass(frozen=True, init=False)
class Policy:
    """How to convert: the low dtype, list edits, modules kept float32 (the numerics core), and beside it the
    capture, runtime and log options as records of their own (:mod:`ampfx.policy.options`).

    List edits take op names, torch callables or module types; strings are
    resolved through :func:`resolve_op` and stored as canonical names.
    ``module_filter_fn(module, fqn) -> bool`` is the one escape hatch: return
    ``False`` to keep a module (and everything traced inside it) float32.

    Every option is given by its own name, a record's too, and read so:

    >>> p = Policy("bf16", weight_cache=True, keep_modules="none")
    >>> p.runtime.weight_cache, p.weight_cache, p.capture.keep_modules
    (True, True, ())
    >>> dataclasses.replace(p, export_timeout=5).capture
    CaptureOptions(leaf_modules=(), keep_modules=(), export_timeout=5)
    """

    dtype: torch.dtype | str = torch.bfloat16
    allowlist_add: tuple = ()
    allowlist_remove: tuple = ()
    inferlist_add: tuple = ()
    inferlist_remove: tuple = ()
    clearlist_add: tuple = ()
    clearlist_remove: tuple = ()
    denylist_add: tuple = ()
    denylist_remove: tuple = ()
    #: modules kept float32: names, globs ("head.*"), module classes, predicates (ampfx.policy.module_match)
    fp32_modules: tuple = field(default=(), metadata=_env(
        "AMPFX_FP32_MODULES", "append", "comma-separated modules kept float32: names (head), globs (encoder.layers.*.attn) "
        "or module classes (LayerNorm, mypkg.blocks.Attn)"))
    keep_output_dtype: bool = True
    #: reductions over more elements than this compute and return float32 (see ampfx.passes.reductions)
    reduction_threshold: int = field(default=65536, metadata=_env(
        "AMPFX_REDUCTION_THRESHOLD", "int", "reductions over more elements than this stay float32 (default 65536)"))
    #: GEMMs whose forward FLOPs are under this stay float32 (rule cost:small-gemm); None: the device's break-even,
    #: measured on CPUs (ampfx.ops.device_cost), the datasheet's elsewhere (ampfx.ops.gemm_cost: 0 on GPUs);
    #: "measure": measured on any device; "table": the datasheet's, nothing measured; 0: every GEMM low
    #: (gemm_min_rows is not checked either)
    gemm_min_flops: int | str | None = field(default=None, metadata=_env(
        "AMPFX_GEMM_MIN_FLOPS", "int_or_auto", "GEMMs under this many forward FLOPs stay float32, where the low dtype "
        "is slower (default auto: the device's break-even, measured on CPUs at first need and cached, the "
        "datasheet's elsewhere; measure: measured on any device; table: the datasheet's, 16777216 on CPUs, nothing "
        "measured; 0: every GEMM low, gemm_min_rows too)",
        example="0", none="auto", words=("measure", "table")))
    #: weight GEMMs whose weight is used for fewer rows than this in one call stay float32 (rule cost:small-gemm):
    #: casting the weight each way costs more than the arithmetic saved; None: the device's (64 on CPUs, 0
    #: elsewhere); 0: no such check (gemm_min_flops=0 turns both off)
    gemm_min_rows: int | None = field(default=None, metadata=_env(
        "AMPFX_GEMM_MIN_ROWS", "int_or_auto", "GEMMs whose weight is used for fewer rows (tokens, pixels times batch) "
        "than this in one call stay float32 (default auto: the device's break-even, 64 on CPUs, 0 elsewhere; 0: no "
        "such check)", example="0", none="auto"))
    #: GEMM padding: "auto" (CUDA only), "always", "never"; ``pad_multiple`` None = 8 (16-bit types)
    pad: str = field(default="auto", metadata=_env(
        "AMPFX_PAD", "word", "GEMM padding to multiples of 8: auto (CUDA only, default), always, never",
        choices=("auto", "always", "never")))
    pad_multiple: int | None = field(default=None, metadata=_env(
        "AMPFX_PAD_MULTIPLE", "int", "the multiple GEMM dimensions are padded to (default 8)", example="8"))
    #: calibration keeps float32 the nodes whose values exceed the dtype's max divided by this
    calibration_margin: float = 2.0
    #: calibration keeps float32 the nodes whose rounding alone moves the output or a parameter gradient
    #: by more than this relative error (ampfx.passes.sensitivity); 0 or None: off
    sensitivity_threshold: float | None = field(default=SENSITIVITY_THRESHOLD, metadata=_env(
        "AMPFX_SENSITIVITY_THRESHOLD", "number_or_off", "calibration keeps float32 the nodes whose rounding alone moves "
        f"the output or a gradient by more than this relative error (default {SENSITIVITY_THRESHOLD:g}; 0 or off: no "
        "precision check)", example="0.05"))
    probe: bool = True
    #: FP8 GEMMs on top of the low-precision plan (ampfx.passes.fp8): a recipe's name ("tensorwise", "rowwise",
    #: "rowwise_with_gw_hp"), an ampfx.policy.fp8.Recipe, or None (no FP8)
    fp8: Any = field(default=None, metadata=_env(
        "AMPFX_FP8", "word", "an FP8 recipe for the linear layers' GEMMs where they pay: tensorwise, rowwise, "
        "rowwise_with_gw_hp; off (default): none", example="tensorwise", choices=_FP8_WORDS,
        also=("none", "")))
    #: the target device whose peak rates and bandwidth decide where an FP8 GEMM pays (rule fp8:cost): None (not
    #: given: "h100"), "h100", "h200", "b200", an ampfx.policy.fp8.Roofline, or "none" (every size)
    fp8_roofline: Any = field(default=None, metadata=_env(
        "AMPFX_FP8_ROOFLINE", "word", "the device whose rates decide where an FP8 GEMM pays: h100 (the default), h200, "
        "b200; none: every size", example="none", needs={"fp8": "tensorwise"}, choices=_ROOFLINE_WORDS,
        also=("off",)))
    #: modules whose linear layers run in FP8 whatever their size or position (rule fp8:forced)
    fp8_modules: tuple = field(default=(), metadata=_env(
        "AMPFX_FP8_MODULES", "append", "comma-separated modules whose linear layers run in FP8 whatever their size or "
        "position: names, globs, classes", needs={"fp8": "tensorwise"}))
    #: with calibrate= batches, a linear layer whose FP8 output differs from its low-dtype output by more than this
    #: (relative) on them stays in the low dtype (rule fp8:sensitive); 0 or None: no such check
    fp8_error_threshold: float | None = field(default=FP8_ERROR_THRESHOLD, metadata=_env(
        "AMPFX_FP8_ERROR_THRESHOLD", "number_or_off", "with calibration batches, linear layers whose FP8 output "
        "differs from their low-dtype output by more than this relative error stay in the low dtype (default "
        f"{FP8_ERROR_THRESHOLD:g}; off: no check)", example="0.1", needs={"fp8": "tensorwise"}))
    #: modules whose linear layers stay in the low dtype under fp8= (rule fp8:module)
    fp8_skip_modules: tuple = field(default=(), metadata=_env(
        "AMPFX_FP8_SKIP_MODULES", "append", "comma-separated modules whose linear layers stay in the low dtype under "
        "fp8: names, globs, classes", needs={"fp8": "tensorwise"}))
    #: fidelity rules (ampfx.passes.fidelity; docs/numerics.md): each keeps float32 values that autocast's type
    #: promotion keeps; switch one off to trade its fidelity for fewer bytes
    float32_stream: bool = field(default=True, metadata=_env(
        "AMPFX_FLOAT32_STREAM", "bool", "0 to let float32 activations (residual streams, carried state) be cast down "
        "(rule fidelity:stream; default 1)"))
    float32_operands: bool = field(default=True, metadata=_env(
        "AMPFX_FLOAT32_OPERANDS", "bool", "0 to let add/sub cast float32 parameters, buffers and factory values down, "
        "and products cast float32 parameters (layer scale) down (rule fidelity:operand; default 1)"))
    exact_values: bool = field(default=True, metadata=_env(
        "AMPFX_EXACT_VALUES", "bool", "0 to let values that reach integer conversions or comparisons be rounded "
        "(rule fidelity:exact; default 1)"))
    #: nodes ampfx.tools.tune keeps float32: (node key, reason) pairs (Decision.key: "module:node"; rule "tune")
    tuned: tuple[tuple[str, str], ...] = ()
    module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = field(default=None, compare=False)
    #: how the model becomes graphs, what the converted module does at call time, the report's place
    #: (ampfx.policy.options: each option also given and read by its own name)
    capture: CaptureOptions = field(default_factory=CaptureOptions, metadata={"record": True})
    runtime: RuntimeOptions = field(default_factory=RuntimeOptions, metadata={"record": True})
    log: LogOptions = field(default_factory=LogOptions, metadata={"record": True})
    #: where each list entry came from: ((field, op name), rule) pairs; Rule.ARGUMENT unless an env var
    origins: tuple[tuple[tuple[str, str], Rule], ...] = field(default=(), metadata={"internal": True})
    #: the AMPFX_* environment values that were read, for the log
    env: tuple[tuple[str, str], ...] = field(default=(), metadata={"internal": True})
    #: user functions / module types named in lists: (object, qualified name)
    user_ops: tuple[tuple[Any, str], ...] = field(default=(), compare=False, metadata={"internal": True})

    def __init__(self, dtype: torch.dtype | str = torch.bfloat16, **options: Any) -> None:
        try:
            self._set(dtype, options)
        except PolicyError as e:  # the user's mistake, raised from here: the traceback ends at their call
            raise e.with_traceback(None) from None

    def _set(self, dtype: torch.dtype | str, options: dict[str, Any]) -> None:
        """The fields of ``Policy(dtype, **options)``, set and checked."""
        set_ = object.__setattr__
        for name, record in RECORDS.items():  # a record given whole, then its options given by name on top
            base = options.pop(name, None)
            if base is None:
                base = record()
            elif not isinstance(base, record):
                raise PolicyError(f"{name}={base!r}: give an ampfx.policy.options.{record.__name__}, or its options by "
                                  f"name ({', '.join(f.name for f in dataclasses.fields(record))})")
            mine = {k: options.pop(k) for k in [k for k in options if OWNER.get(k) == name]}
            set_(self, name, dataclasses.replace(base, **mine) if mine else base)
        for f in dataclasses.fields(self):
            if f.name in RECORDS:
                continue
            if f.name in options:
                set_(self, f.name, options.pop(f.name))
            elif f.name == "dtype":
                set_(self, "dtype", dtype)
            else:
                set_(self, f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)
        if options:
            name = next(iter(options))
            raise TypeError(f"Policy() got an unexpected keyword argument {name!r}")
        self.__post_init__()

    def __getattr__(self, name: str) -> Any:
        """An option of a record read by its own name (``policy.weight_cache`` is ``policy.runtime.weight_cache``)."""
        owner = OWNER.get(name)
        if owner is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, owner), name)

    @classmethod
    def option_fields(cls) -> tuple[dataclasses.Field, ...]:
        """Every option a policy holds, flat: the numerics core's fields, then each record's (:data:`RECORDS`), as
        environment variables, policy files, ``ampfx lists`` and the report walk them."""
        return OPTION_FIELDS

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "dtype", parse_dtype(self.dtype))
        user = dict((name, obj) for obj, name in self.user_ops)
        for cat in LISTS:
            for action in ("add", "remove"):
                fname = f"{LIST_NAMES[cat]}_{action}"
                raw = getattr(self, fname)
                if isinstance(raw, (str, type)) or callable(raw):
                    raw = (raw,)
                names = []
                for spec in raw:
                    name, obj = resolve_op(spec, where=f"Policy({fname}=...)")
                    if obj is not None:
                        user[name] = obj
                    if name not in names:
                        names.append(name)
                set_(self, fname, tuple(names))
        set_(self, "fp32_modules", module_match.entries(self.fp32_modules))
        set_(self, "tuned", _tuned_pairs(self.tuned))
        for name in ("gemm_min_flops", "gemm_min_rows"):  # "auto": the device's break-even, as in the variables
            if isinstance(getattr(self, name), str) and getattr(self, name).strip().lower() == "auto":
                set_(self, name, None)
            elif name == "gemm_min_flops" and isinstance(self.gemm_min_flops, str):
                set_(self, name, self.gemm_min_flops.strip().lower())
        _set_fp8(self)
        _check_fields(self)
        set_(self, "user_ops", tuple((obj, name) for name, obj in user.items()))
        self.lists()  # validates: no op on two lists, removals name listed ops

    # ------------------------------------------------------------------ effective lists
    def _origin(self, fname: str, name: str) -> Rule:
        return Rule(dict(self.origins).get((fname, name), Rule.ARGUMENT))

    def lists(self) -> dict[str, tuple[Category, Rule, str]]:
        """The effective lists: op name -> ``(category, source, reason)``; the
        source is the :class:`~ampfx.report.records.Rule` a record names.

        Ops on no list are absent (they stay float32, counted as unlisted).
        Raises :class:`PolicyError` when an edit leaves an op on two lists or
        removes an op from a list it is not on.
        """
        members: dict[Category, dict[str, tuple[Rule, str]]] = {c: {} for c in LISTS}
        for name, entry in ops.ENTRIES.items():
            cat, reason = entry.for_dtype(self.dtype)
            if cat in members:
                members[cat][name] = (Rule.TABLE, reason)
        for from_env_vars in (False, True):  # arguments first, the environment on top
            def mine(fname: str, name: str) -> bool:
                return (self._origin(fname, name).env_var is not None) == from_env_vars
            for cat in LISTS:
                fname = f"{LIST_NAMES[cat]}_add"
                for name in getattr(self, fname):
                    if mine(fname, name):
                        members[cat][name] = (self._origin(fname, name), f"named in {fname}")
            for cat in LISTS:
                fname = f"{LIST_NAMES[cat]}_remove"
                for name in getattr(self, fname):
                    if not mine(fname, name):
                        continue
                    if name not in members[cat]:
                        where = [LIST_NAMES[c] for c in LISTS if name in members[c]] or ["no list"]
                        raise PolicyError(
                            f"{self._origin(fname, name).replace('argument', 'Policy argument')} {fname}: "
                            f"{name!r} is not on the {LIST_NAMES[cat]} (it is on {', '.join(where)}).")
                    del members[cat][name]
        out: dict[str, tuple[Category, Rule, str]] = {}
        for cat in LISTS:
            for name, (source, reason) in members[cat].items():
                if name in out:
                    other = out[name]
                    raise PolicyError(
                        f"op lists have conflicting entries: {name!r} is on the {LIST_NAMES[other[0]]} "
                        f"({other[1]}) and on the {LIST_NAMES[cat]} ({source}). Moving an op takes an ADD "
                        f"and a REMOVE, e.g. AMPFX_{LIST_NAMES[cat].upper()}_ADD={name} with "
                        f"AMPFX_{LIST_NAMES[other[0]].upper()}_REMOVE={name}.")
                out[name] = (cat, source, reason)
        return out

    def category_of(self, name: str) -> tuple[Category, Rule, str] | None:
        """``(category, source, reason)`` for a canonical op name, or ``None`` if unlisted."""
        return self._effective.get(name)

    @functools.cached_property
    def _effective(self) -> dict[str, tuple[Category, Rule, str]]:
        """:meth:`lists`, made once (a policy is frozen)."""
        return self.lists()

    def op_name(self, key: Any) -> str | None:
        """The name a node's target has under this policy (user ops included)."""
        name = ops.lookup_name(key)
        if name is not None:
            return name
        ref = custom_ops.ref_of(key)
        if ref is not None:
            return self._torch_op_name(ref)
        for obj, uname in self.user_ops:
            if isinstance(obj, str):
                if key == obj:
                    return uname
                continue
            if key is obj or (isinstance(key, type) and isinstance(obj, type) and issubclass(key, obj)):
                return uname
        return None

    def save(self, path: str | os.PathLike) -> Any:
        """Write this policy to ``path`` as JSON (:mod:`ampfx.policy.policy_file`), to load with
        :meth:`from_file` or ``AMPFX_POLICY_FILE``; returns the path."""
        return policy_file.save(self, path)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Policy":
        """The policy :meth:`save` wrote to ``path`` (:mod:`ampfx.policy.policy_file`)."""
        return policy_file.load(path, cls)

    @classmethod
    def from_json(cls, data: Any, *, where: str = "Policy.from_json") -> "Policy":
        """The policy of ``data``, the content :meth:`save` writes (:func:`ampfx.policy.policy_file.as_json`), as a
        trainer's checkpoint keeps it; a bad value is a :class:`PolicyError` naming ``where``."""
        return policy_file.from_json(data, cls, where=where)

    def _torch_op_name(self, ref: custom_ops.OpRef) -> str:
        """A graph's torch op (not in ampfx's tables) by its list name: ``"ns::op.overload"`` when a list
        names that overload, else ``"ns::op"``. A call of the op without overload (``torch.ops.ns.op(x)``
        under ``torch.fx``) runs an overload only torch's dispatch picks: when the lists give some
        overload another list than the op's, which one is unknown, and that is an error."""
        listed = self._effective
        if ref.overload is not None:
            return ref.name if ref.name in listed else ref.packet
        overloads = ref.overloads()
        named = [f"{ref.packet}.{o}" for o in overloads if f"{ref.packet}.{o}" in listed]
        if len(overloads) == 1 and named:
            return named[0]
        whole = listed.get(ref.packet, (None,))[0]
        other = [n for n in named if listed[n][0] is not whole]
        if other:
            raise PolicyError(
                f"the graph calls torch.ops.{ref.namespace}.{ref.op}(...) without naming an overload, and the lists "
                f"put {', '.join(other)} on another list than {ref.packet} ({whole.value if whole else 'no list'}): "
                f"which overload runs is unknown. Name the op without overload ({ref.packet}) on the lists, call "
                f"the overload in the model (torch.ops.{ref.namespace}.{ref.op}.<overload>(...)), or convert with "
                "tracer='export' (its graphs name overloads).")
        return ref.packet

    def is_user_leaf(self, module_type: type) -> bool:
        """A module type named on a list or in ``leaf_modules`` is traced as one opaque op."""
        for obj, _ in self.user_ops:
            if isinstance(obj, type) and issubclass(module_type, obj):
                return True
        return any(isinstance(t, type) and issubclass(module_type, t) for t in self.capture.leaf_modules)


@dataclass(frozen=True)
class Resolved:
    """What :func:`ampfx.request.resolve` found a :class:`~ampfx.policy.Policy` to mean in one model.

    ``fp32_matched``: the module paths ``fp32_modules`` keeps float32, each with the words the report
    uses (:func:`ampfx.policy.module_match.resolve`); ``keep_matched``: the paths ``keep_modules`` keeps as
    boundaries, each with why (``None``: not resolved, and passes run on their own keep nothing);
    ``filter_rejected``: every name of the modules ``module_filter_fn`` rejects (``None``: not resolved,
    the filter is asked during classification); ``leaf_names``: every name of the modules ``leaf_modules``
    names (a module registered twice, ``self.alias = self.fc``, is a leaf under both: the converted tree
    copies each name's module apart, and a graph records the name ``forward`` used). With ``fp8``:
    ``fp8_forced`` / ``fp8_skipped``, the paths ``fp8_modules`` / ``fp8_skip_modules`` match, each with the words
    the report uses; ``linear_ends``, the names of the model's first and last ``nn.Linear`` (registration order; ``()``: it has none;
    ``None``: not resolved, and the fp8 pass on its own decides no position).

    >>> Resolved().fp32_matched, Resolved().keep_matched
    ((), None)
    """

    fp32_matched: tuple[tuple[str, str], ...] = ()
    keep_matched: tuple[tuple[str, str], ...] | None = None
    filter_rejected: frozenset[str] | None = None
    leaf_names: frozenset[str] = frozenset()
    fp8_forced: tuple[tuple[str, str], ...] = ()
    fp8_skipped: tuple[tuple[str, str], ...] = ()
    linear_ends: tuple[str, ...] | None = None

    def below(self, prefix: str) -> frozenset[str]:
        """The names in ``leaf_names`` under the module at ``prefix`` (``"enc."``), as paths in that module."""
        return frozenset(n[len(prefix):] for n in self.leaf_names if n.startswith(prefix) and len(n) > len(prefix))

    def as_json(self) -> dict[str, Any]:
        """The report's view of it (``Report.policy``'s ``fp32_matched`` / ``keep_matched``)."""
        return {"fp32_matched": dict(self.fp32_matched), "keep_matched": dict(self.keep_matched or ())}



OWNER: dict[str, str] = {f.name: name for name, record in RECORDS.items() for f in dataclasses.fields(record)}
"""The record (:data:`RECORDS`' key) each of the records' options sits in, by the option's name."""
OPTION_FIELDS: tuple[dataclasses.Field, ...] = (
    *(f for f in dataclasses.fields(Policy) if f.name not in RECORDS),
    *(f for record in RECORDS.values() for f in dataclasses.fields(record)))
"""Every option of a :class:`Policy`, flat (:meth:`Policy.option_fields`)."""


# ---------------------------------------------------------------------- environment
_LIST_VARS = {f"{ENV_PREFIX}{LIST_NAMES[c].upper()}_{a.upper()}": f"{LIST_NAMES[c]}_{a}"
              for c in LISTS for a in ("add", "remove")}
INTERNAL: tuple[str, ...] = tuple(f.name for f in OPTION_FIELDS if f.metadata.get("internal"))
"""Policy fields ampfx fills itself (where list entries came from, the environment read, user objects named):
never an option, never saved in a policy file."""
ENV_FIELDS: dict[str, dataclasses.Field] = {f.metadata["env"]: f for f in OPTION_FIELDS if "env" in f.metadata}
"""Each Policy field's environment variable (the field's metadata: :func:`_env`), by variable name."""
OPTION_VARS: dict[str, str] = {f.name: var for var, f in ENV_FIELDS.items()}
"""Each field's environment variable, by field name."""

ENV_VARS: dict[str, str] = {
    **{v: f"comma-separated op names added to / removed from the {f.split('_')[0]}" for v, f in _LIST_VARS.items()},
    "AMPFX_POLICY_FILE": "a policy file (Policy.save, ampfx.tools.tune) merged into convert()'s policy before the other "
                         "variables: list edits and tuned nodes added, unset fields taken from it",
    **{var: f.metadata["help"] for var, f in ENV_FIELDS.items()},
    "AMPFX_CACHE_DIR": "the directory where the device tables measured for gemm_min_flops are cached (default "
                       "$XDG_CACHE_HOME/ampfx, else ~/.cache/ampfx; `ampfx device` prints the table and its file)",
}
"""Every ``AMPFX_*`` variable with its help text: the op lists', the policy file's, and the fields' own."""


def _bool_env(var: str, value: str, default: bool) -> bool:
    flag = value.strip().lower()
    if flag not in ("", "0", "1", "true", "false", "yes", "no"):
        raise PolicyError(f"{var}={value!r}: use 1 or 0 (true/false, yes/no also work)")
    return flag in ("1", "true", "yes") if flag else default


def _env_value(var: str, value: str, f: dataclasses.Field, current: Any) -> Any:
    """The value of field ``f`` that ``var=value`` asks for (``current``: the field's value before), by the
    kind its metadata names (:data:`ENV_KINDS`)."""
    kind = f.metadata["kind"]
    if kind == "bool":
        return _bool_env(var, value, f.default)
    if kind == "bool_or_auto":
        if value.strip().lower() == "auto":
            return "auto"
        try:
            return _bool_env(var, value, f.default)
        except PolicyError:
            raise PolicyError(f"{var}={value!r}: use auto, 1 or 0 (true/false, yes/no also work)") from None
    if kind == "int":
        return _int_env(var, value, f.metadata.get("example", f.default))
    if kind == "int_or_auto":
        word = value.strip().lower()
        if word in f.metadata.get("words", ()):
            return word
        return None if word in ("", "auto") else _int_env(var, value, f.metadata["example"], auto=True,
                                                          words=f.metadata.get("words", ()))
    if kind == "number_or_off":
        return _number_or_off(var, value, f.metadata["example"])
    if kind == "word":
        return _word_env(var, value, f)
    if kind == "path":
        return value or None
    if kind == "append":
        return current + _split(var, value)
    if kind == "keep":
        given = _split(var, value)
        return () if tuple(g.lower() for g in given) in ((), ("none",)) else given
    if kind == "append_leaves":  # an importable class name is the class
        extra = [import_object(spec) if "." in spec else None for spec in _split(var, value)]
        return current + tuple(obj if isinstance(obj, type) else spec
                               for obj, spec in zip(extra, _split(var, value)))
    raise AssertionError(f"{f.name}: unknown environment kind {kind!r}")


ENV_KINDS = ("bool", "bool_or_auto", "int", "int_or_auto", "number_or_off", "word", "path", "append", "keep", "append_leaves")
"""How a field's variable is read: a flag, a flag or ``auto``, a whole number, a whole number or ``auto``, a number or ``off``, a lower-cased word, a path
(empty: none), names added to the field's, names replacing it (``none``: none), leaf names or classes added."""


def _int_env(var: str, value: str, example: Any, *, auto: bool = False, words: tuple[str, ...] = ()) -> int:
    try:
        return int(value.replace("_", "").replace(",", ""))
    except ValueError:
        others = ("auto",) * auto + tuple(words)
        more = f", or {', '.join(others)}" if others else ""
        raise PolicyError(f"{var}={value!r}: use a whole number, e.g. {example}{more}") from None


def _word_env(var: str, value: str, f: dataclasses.Field) -> str:
    """One of the words ``f``'s variable takes (its metadata's ``choices``, and the ``also`` it accepts unsaid), lower
    case; a :class:`PolicyError` in the variable's own words otherwise (not the Python values of the field).

    >>> _word_env("AMPFX_PAD", "sometimes", ENV_FIELDS["AMPFX_PAD"])
    Traceback (most recent call last):
    ...
    ampfx.errors.PolicyError: AMPFX_PAD='sometimes': use auto, always or never.
    """
    word, choices = value.strip().lower(), f.metadata.get("choices")
    if choices is None or word in choices or word in f.metadata.get("also", ()):
        return word
    said = ", ".join(choices[:-1]) + f" or {choices[-1]}"
    raise PolicyError(f"{var}={value!r}: use {said}.{did_you_mean(word, choices)}")


def _number_or_off(var: str, value: str, example: str) -> float | None:
    """A number, or ``off`` / ``none`` / empty for none (``AMPFX_SENSITIVITY_THRESHOLD``,
    ``AMPFX_EXPORT_TIMEOUT``); a :class:`PolicyError` naming ``var`` and ``example`` otherwise.

    >>> _number_or_off("AMPFX_EXPORT_TIMEOUT", "30", "60"), _number_or_off("AMPFX_EXPORT_TIMEOUT", "off", "60")
    (30.0, None)
    """
    if value.strip().lower() in ("", "off", "none"):
        return None
    try:
        return float(value)
    except ValueError:
        raise PolicyError(f"{var}={value!r}: use a number such as {example}, or off") from None


def _split(var: str, value: str) -> tuple[str, ...]:
    items = tuple(v.strip() for v in value.split(","))
    if any(not v for v in items) and value.strip():
        raise PolicyError(f"{var}={value!r}: empty entry in comma-separated list")
    return tuple(v for v in items if v)


def from_env(base: Policy, environ: Mapping[str, str] | None = None, *, dtype_given: bool = True) -> Policy:
    """``base`` with the ``AMPFX_*`` variables of ``environ`` applied on top.

    Unknown ``AMPFX_*`` variables are an error (a typo must not be ignored). ``AMPFX_POLICY_FILE``
    is merged first (:func:`ampfx.policy.policy_file.merge`; ``dtype_given``: the call named a dtype,
    which the file's must then equal).

    >>> p = from_env(Policy(), {"AMPFX_DENYLIST_ADD": "gelu", "AMPFX_INFERLIST_REMOVE": "gelu"})
    >>> p.category_of("gelu")[:2]
    (<Category.DENY: 'deny'>, 'env:AMPFX_DENYLIST_ADD')
    """
    environ = os.environ if environ is None else environ
    seen = {k: v for k, v in environ.items() if k.startswith(ENV_PREFIX)}
    for var in seen:
        if var not in ENV_VARS:
            raise PolicyError(f"unknown environment variable {var}.{did_you_mean(var, ENV_VARS)} "
                              f"Known: {', '.join(sorted(ENV_VARS))}.")
    if not seen:
        return check_fp8_options(base)
    if seen.get("AMPFX_POLICY_FILE", "").strip():  # the file first: the other variables apply on top of it
        base = policy_file.merge(base, seen["AMPFX_POLICY_FILE"].strip(), dtype_given=dtype_given)
    changes: dict[str, Any] = {}
    origins = dict(base.origins)
    for var, fname in _LIST_VARS.items():
        if var in seen:
            names = []
            for spec in _split(var, seen[var]):
                name, _ = resolve_op(spec, where=f"{var}={seen[var]!r}")
                names.append(name)
                origins[(fname, name)] = Rule.env(var)
            changes[fname] = tuple(getattr(base, fname)) + tuple(names)
    for var, f in ENV_FIELDS.items():
        if var in seen:
            changes[f.name] = _env_value(var, seen[var], f, getattr(base, f.name))
    try:
        return check_fp8_options(dataclasses.replace(base, origins=tuple(origins.items()),
                                                     env=tuple(sorted(seen.items())), user_ops=base.user_ops,
                                                     **changes))
    except PolicyError as e:
        raise _env_error(e, base, changes, seen) from None


def _env_error(error: PolicyError, base: Policy, changes: Mapping[str, Any], seen: Mapping[str, str]) -> PolicyError:
    """``error`` (the policy with the environment's ``changes`` on top of ``base`` failed) in the environment's words:
    when one variable's value fails on its own, led by that variable (``AMPFX_PAD_MULTIPLE='1': use an integer >= 2``,
    not the field's Python name); else, as the problem comes from the combination, ended by the variables read
    (unless it names them already)."""
    for var, f in ENV_FIELDS.items():
        if var not in seen or f.name not in changes:
            continue
        try:
            dataclasses.replace(base, **{f.name: changes[f.name]})
        except PolicyError as alone:
            text = str(alone)
            if text.startswith(f"{f.name}=") and ": " in text:  # "pad_multiple=1: use ..." -> "use ..."
                text = text.split(": ", 1)[1]
            return PolicyError(f"{var}={seen[var]!r}: {text}")
    if str(error).startswith(ENV_PREFIX):  # said in the variables' words already
        return error
    return PolicyError(f"{error} (environment: {', '.join(f'{k}={v}' for k, v in sorted(seen.items()))})")

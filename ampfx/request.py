"""One request: what a caller of ampfx asked for, checked once, and what ``convert`` resolved of it.

Every entry point that converts (:func:`ampfx.convert`, :func:`ampfx.tools.tune`, :func:`ampfx.tools.compare`, the
``ampfx`` command) builds its policy with :func:`policy_of` and its request with :func:`build`, so the same
mistake gets the same error, with the same suggestion, wherever it is made:

>>> import torch, ampfx
>>> from ampfx.request import policy_of
>>> policy_of("tune", "bf16", None, {"fp32_modulez": ("head",)})
Traceback (most recent call last):
...
ampfx.errors.ArgumentError: tune() got an unknown option fp32_modulez=('head',). Did you mean 'fp32_modules' or ...?...

Three records, each with one owner:

- :class:`~ampfx.policy.Policy`: what the user asked for (arguments, then the ``AMPFX_*`` environment),
  frozen and never changed afterwards; it can be saved and loaded (:mod:`ampfx.policy.policy_file`);
- :class:`~ampfx.policy.Resolved`: what ``convert`` found that policy to mean in one model (the modules
  ``fp32_modules`` and ``keep_modules`` match there, the modules ``module_filter_fn`` rejects);
- :class:`Request`: both, with the checked example inputs, tracer, mode and calibration batches.

What the tree walk learns while it converts (export's size tries, modules export found unfaithful) is
its own mutable state (:class:`ampfx.tree.Memo`), not part of any of these.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from . import arguments as args
from . import libraries
from .capture import guarding
from .policy import module_match
from .capture import export
from .errors import ArgumentError, PolicyError, UninitializedModelError
from .inputs import ExampleInputs
from .paths import check_writable
from .policy.names import did_you_mean, parse_dtype
from .policy import INTERNAL, Policy, Resolved, from_env


@dataclass(frozen=True)
class Request:
    """What the caller of :func:`ampfx.convert` asked for, checked, and what was resolved of it."""

    policy: Policy
    inputs: ExampleInputs | None
    tracer: str = "auto"
    dynamic_dims: dict[int, str] | None = None
    calibrate: tuple[list[Any], Callable[[Any], torch.Tensor] | None] | None = None
    resolved: Resolved = Resolved()
    mode: str = "train"


TRACERS = {"auto": "torch.fx, then torch.export where fx fails", "fx": "torch.fx", "export": "torch.export"}
MODES = {"train": "float32 master weights", "inference": "weights stored in the low dtype once"}


def options() -> list[str]:
    """The keyword options every converting entry point takes: the fields of :class:`~ampfx.policy.Policy`
    a user sets."""
    return [f.name for f in Policy.option_fields() if f.name not in INTERNAL and f.name != "dtype"]


def check_options(caller: str, given: Mapping[str, Any]) -> None:
    """Every keyword option names a field of :class:`~ampfx.policy.Policy`, with a suggestion if not."""
    known = options()
    for key in given:
        if key not in known:
            raise ArgumentError(f"{caller}() got an unknown option {key}={given[key]!r}.{did_you_mean(key, known)} "
                                f"Options: {', '.join(known)} (see ampfx.Policy).")


def policy_of(caller: str, dtype: Any, policy: Policy | None, given: Mapping[str, Any]) -> Policy:
    """The policy a ``caller`` (``"convert"``, ``"tune"``, ``"compare"``) was given: ``policy``, or one built
    from ``dtype`` and the keyword options ``given``; both at once, an option that is no field, a ``policy``
    that is no :class:`~ampfx.policy.Policy` and a ``dtype`` that disagrees with it are errors. The
    environment is not read here (:func:`build` reads it, once per conversion)."""
    if policy is None:
        check_options(caller, given)
        return Policy(dtype=dtype if dtype is not None else torch.bfloat16, **given)
    if not isinstance(policy, Policy):
        raise ArgumentError(f"{caller}(): policy={policy!r}: give an ampfx.Policy(...), or pass its fields as "
                            f"keywords ({caller}(model, 'bf16', fp32_modules=...))")
    if given:
        check_options(caller, given)
        raise ArgumentError(f"{caller}(): pass either policy= or policy options, not both: {sorted(given)}")
    if dtype is not None and parse_dtype(dtype) != policy.dtype:
        raise ArgumentError(f"{caller}(): dtype={dtype!r} disagrees with policy.dtype={policy.dtype}; give one of them")
    return policy


@dataclass(frozen=True)
class Asked:
    """What a converting entry point was given, as given (:func:`build` checks it): the dtype, the example inputs,
    a :class:`~ampfx.policy.Policy` and keyword ``options`` (its fields), and the capture and mode arguments of
    :func:`ampfx.convert`."""

    dtype: Any = None
    example_inputs: Any = None
    policy: Policy | None = None
    options: Mapping[str, Any] | None = None
    dynamic_dims: Any = None
    tracer: str = "auto"
    mode: str = "train"
    calibrate: Any = None
    calibrate_loss: Any = None


def build(model: nn.Module, asked: Asked, *, caller: str = "convert",
          environ: Mapping[str, str] | None = None) -> Request:
    """The request of one conversion of ``model``: every argument ``asked`` checked, the policy built
    (:func:`policy_of`), the ``AMPFX_*`` variables of ``environ`` (default ``os.environ``) applied on top
    (:func:`ampfx.policy.from_env`), and resolved against the model (:func:`resolve`)."""
    dtype, example_inputs, policy, given = asked.dtype, asked.example_inputs, asked.policy, asked.options
    dynamic_dims, tracer, mode = asked.dynamic_dims, asked.tracer, asked.mode
    calibrate, calibrate_loss = asked.calibrate, asked.calibrate_loss
    given = dict(given or {})
    args.check_model(model)
    _check_unwrapped(model)
    args.check_choice("mode", mode, MODES)
    args.check_choice("tracer", tracer, TRACERS)
    environ = os.environ if environ is None else environ
    if not isinstance(environ, Mapping):
        raise ArgumentError(f"environ={type(environ).__name__}: give a mapping of variable names to strings "
                            "(like os.environ), or leave it out to read os.environ")
    dtype_given = dtype is not None or policy is not None  # else AMPFX_POLICY_FILE's dtype is taken
    policy = from_env(policy_of(caller, dtype, policy, given), environ, dtype_given=dtype_given)
    if policy.log.log_path:  # the report is saved there at the end: a place that cannot take it fails first
        check_writable(policy.log.log_path, log_path_name(policy), directory=True)
    resolved = resolve(model, policy)
    _check_initialised(model)
    if policy.log.disable:
        return Request(policy, None, resolved=resolved, mode=mode)
    if tracer == "export" and example_inputs is None:
        raise ArgumentError("tracer='export' runs the model on example_inputs: give example_inputs=(x,) (or a "
                            "dict of keyword inputs), or use tracer='fx'")
    if tracer == "export" and export.unavailable():
        raise RuntimeError(export.unavailable())
    if dynamic_dims and example_inputs is None:
        raise ArgumentError("dynamic_dims names dimensions of example_inputs; give example_inputs too")
    inputs = args.check_inputs(model, example_inputs, "example_inputs")
    calib = args.check_calibration(model, calibrate, calibrate_loss, inputs)
    if calib is not None and inputs is None:
        inputs = ExampleInputs.of(calib[0][0])
    if dynamic_dims is not None and inputs is not None:
        guarding.check_dynamic_dims(dynamic_dims, inputs)
    return Request(policy, inputs, tracer, dynamic_dims, calib, resolved, mode)


def log_path_name(policy: Policy) -> str:
    """How a message names ``policy``'s report directory: the variable that set it (``AMPFX_LOG_PATH='run1/'``) or
    the option (``log_path='run1/'``)."""
    path = policy.log.log_path
    return f"{'AMPFX_LOG_PATH' if dict(policy.env).get('AMPFX_LOG_PATH') else 'log_path'}={str(path)!r}"


def resolve(model: nn.Module, policy: Policy) -> Resolved:
    """What ``policy`` means in ``model`` (see :class:`Resolved`): ``fp32_modules`` and ``keep_modules``
    resolved once (:func:`ampfx.policy.module_match.resolve`: an entry that matches nothing is an error),
    ``module_filter_fn`` asked once about every module (:func:`ampfx.policy.module_match.filter_rejected`, so it
    also holds inside modules converted on their own under a rejected parent), and every name in
    ``leaf_modules`` checked to be a module of ``model`` and found under all its names."""
    named = list(model.named_modules(remove_duplicate=False))
    names = [n for n, _ in named if n]
    matched = module_match.resolve(model, policy.fp32_modules)
    # another library's module (a DGL conv) is a leaf its integration runs: its forward runs already
    plugged = [n for n, m in named if n and libraries.library_of(m) is not None]
    kept = tuple((p, why) for p, why in module_match.resolve(model, policy.capture.keep_modules, "keep_modules")
                 if not any(p == lib or p.startswith(lib + ".") for lib in plugged))
    rejected = (module_match.filter_rejected(model, policy.module_filter_fn)
                if policy.module_filter_fn is not None else None)
    leaves: list[str] = []
    for leaf in policy.capture.leaf_modules:
        if isinstance(leaf, str) and leaf not in names:
            raise PolicyError(f"leaf_modules / AMPFX_LEAF_MODULES names {leaf!r}, which is neither a module "
                              f"of {type(model).__name__} nor an importable module type."
                              f"{did_you_mean(leaf, names, cutoff=0.5)}")
        if isinstance(leaf, str):
            module = model.get_submodule(leaf)
            leaves += [n for n, m in named if n and m is module]
    fp8_ends = None
    if policy.fp8 is not None:
        linears = [n for n, m in named if n and isinstance(m, nn.Linear)]
        fp8_ends = tuple(dict.fromkeys((linears[0], linears[-1]))) if linears else ()
    return Resolved(fp32_matched=matched, keep_matched=kept, filter_rejected=rejected,
                    leaf_names=frozenset(leaves),
                    fp8_forced=module_match.resolve(model, policy.fp8_modules, "fp8_modules"),
                    fp8_skipped=module_match.resolve(model, policy.fp8_skip_modules, "fp8_skip_modules"),
                    linear_ends=fp8_ends)


def _check_initialised(model: nn.Module) -> None:
    """Lazy modules must have their parameters before conversion (see :class:`UninitializedModelError`)."""
    lazy = [name or "<root>" for name, m in model.named_modules()
            if any(nn.parameter.is_lazy(t) for t in (*m._parameters.values(), *m._buffers.values()))]
    if lazy:
        raise UninitializedModelError(
            f"{type(model).__name__} has lazy modules with uninitialised parameters ({', '.join(lazy[:5])}): "
            "initialising them changes the model, which ampfx.convert does not do. Run the model once first "
            "(model(*example_inputs), as torch asks before an optimizer is built), then convert it.")


def _check_unwrapped(model: nn.Module) -> None:
    """A model already sharded, wrapped for data parallelism or compiled cannot be converted inside
    (:func:`ampfx.policy.module_match.wrapped_first`): the error names the module and the order that works."""
    found = module_match.wrapped_first(model)
    if found is None:
        return
    path, wrapper = found
    raise ArgumentError(
        f"{'model.' + path if path else 'the model'} is already wrapped by {wrapper}: ampfx converts a plain model, "
        "and the wrapper goes on the converted one (it holds the parameters as shards, or a forward bound when it "
        "was made, which a conversion cannot reach inside). Convert first, then wrap: amp = ampfx.convert(model, ...); "
        "then fully_shard(amp.blocks[i]) for each block and fully_shard(amp), DDP(amp) or torch.compile(amp) "
        "(see docs/scale.md). Activation-checkpoint wrappers may go on before or after.")

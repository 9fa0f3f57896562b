"""What the trainer integrations share: conversion at a model's first call, and the policy a checkpoint keeps.

A trainer hands its precision plugin the model before any data is seen (Lightning's ``convert_module``,
Accelerate's ``prepare_model``), and the model's forward may take whatever its training step gives it. So
the model is converted at its first call, with that call's inputs as example inputs (exact dtypes and
shapes, and ``torch.export`` where ``torch.fx`` cannot capture the model), and every call after runs the
converted module. The model object stays the one the trainer holds: its ``forward`` is routed through
an instance attribute (as Accelerate routes its autocast), so its parameters, ``state_dict()``, hooks and
methods (``training_step``, ``save_pretrained``) are untouched. While the converted module runs (and while
it is converted) the attribute is taken away, so ampfx sees the model's own ``forward``.

This module imports no trainer library, and uses ampfx's public API only.

>>> import torch, torch.nn as nn
>>> net = nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1))
>>> first = FirstCall(net, Setup.of("example", "bf16", None, {}))
>>> first.install()
>>> first.report is None                        # nothing converted before the first call
True
>>> net(torch.randn(2, 4)).dtype, first.report.by_node("linear").dtype, first.report.by_node("softmax").dtype
(torch.float32, torch.bfloat16, torch.float32)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from ..api import convert
from ..policy import policy_file
from ..errors import ArgumentError, AutocastConflictError, PolicyMismatchError
from ..errors import PolicyError
from ..policy import Policy
from ..request import policy_of
from ..report.records import dtype_name
from ..report import Report

log = logging.getLogger(__name__)

CONVERT_OPTIONS = {"tracer": "auto", "dynamic_dims": None}
"""The options of :func:`ampfx.convert` an integration passes on besides the policy's fields, with their defaults.
``example_inputs`` come from the first call; ``mode`` is ``"train"`` (the optimizer updates the float32
masters); ``calibrate`` needs batches before training, so is not offered here (convert by hand for it)."""

@dataclass(frozen=True)
class Setup:
    """What a trainer integration was asked for: the :class:`~ampfx.Policy` (validated when the integration
    is made, not at the first batch) and the options of :data:`CONVERT_OPTIONS`."""

    policy: Policy
    tracer: str = "auto"
    dynamic_dims: dict | None = None

    @classmethod
    def of(cls, who: str, dtype: Any, policy: Policy | None, options: dict[str, Any]) -> "Setup":
        """The setup of ``who``'s arguments: ``dtype`` (``"bf16"``, ``"fp16"`` or a torch dtype), an optional
        ``policy`` and keyword options (Policy fields or :data:`CONVERT_OPTIONS`); an unknown or
        conflicting argument is an :class:`~ampfx.errors.ArgumentError` naming it."""
        convert = {k: options.pop(k) for k in list(options) if k in CONVERT_OPTIONS}
        for key in options:  # what only a hand-made conversion offers gets its own words; the rest as convert()
            if key in ("example_inputs", "mode", "calibrate", "calibrate_loss", "environ"):
                extra = ("example_inputs come from the model's first call." if key == "example_inputs" else
                         f"{key!r} is not offered by {who}: convert the model by hand with ampfx.convert for it.")
                raise ArgumentError(f"{who} got the option {key}={options[key]!r}: {extra}")
        policy = policy_of(who, dtype, policy, options)  # the same checks and errors as ampfx.convert
        if convert.get("tracer", "auto") not in ("auto", "fx", "export"):
            raise ArgumentError(f"{who}: tracer={convert['tracer']!r}: use 'auto', 'fx' or 'export'")
        return cls(policy, **convert)

    @property
    def dtype(self) -> torch.dtype:
        return self.policy.dtype

    def convert(self, module: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
        """``ampfx.convert`` of ``module`` with the inputs of one call as example inputs."""
        if kwargs:  # example inputs by keyword: positional ones named by the forward's parameters
            names = [p.name for p in inspect.signature(type(module).forward).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
            if len(args) > len(names):
                raise ArgumentError(f"ampfx: {type(module).__name__}.forward was called with {len(args)} positional "
                                    "inputs and keywords; its first call is converted from keywords only")
            inputs: Any = {**dict(zip(names, args)), **kwargs}
        else:
            inputs = args
        return convert(module, example_inputs=inputs, policy=self.policy, tracer=self.tracer,
                             dynamic_dims=self.dynamic_dims)

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the dtype, the policy as a policy file holds it (``None`` where a field
        cannot be named in a file, such as a ``module_filter_fn``: then only the dtype is checked on resume,
        and a warning says so) and the convert options. Plain data (``torch.load(weights_only=True)`` reads it)."""
        try:
            saved, why = policy_file.as_json(self.policy), None
        except PolicyError as e:
            saved, why = None, str(e)
        return {"dtype": dtype_name(self.dtype), "policy": saved, "unsaved": why, "tracer": self.tracer,
                "dynamic_dims": None if self.dynamic_dims is None else {
                    str(k): v for k, v in self.dynamic_dims.items()}}

    def check_state(self, saved: dict[str, Any], who: str, fix: str) -> None:
        """Raise :class:`PolicyMismatchError` where ``saved`` (:meth:`state` of the run that wrote a
        checkpoint) differs from this setup, naming each difference and ``fix``."""
        mine = self.state()
        diffs = [f"{k}: checkpoint {saved.get(k)!r}, this run {mine[k]!r}"
                 for k in ("dtype", "tracer", "dynamic_dims") if saved.get(k) != mine[k]]
        if saved.get("policy") is not None and mine["policy"] is not None:
            theirs, ours = saved["policy"], mine["policy"]
            diffs += [f"policy.{k}: checkpoint {theirs.get(k)!r}, this run {ours.get(k)!r}"
                      for k in sorted(set(theirs) | set(ours)) if k != "dtype" and theirs.get(k) != ours.get(k)]
        elif saved.get("policy") is not None or mine["policy"] is not None:
            log.warning("%s: the policy of the checkpoint or of this run cannot be saved (%s); only the dtype and the "
                        "convert options were compared", who, saved.get("unsaved") or mine["unsaved"])
        if diffs:
            raise PolicyMismatchError(f"{who}: the checkpoint was trained with another ampfx policy than this run's: "
                                      f"{'; '.join(diffs)}. {fix}")

    @classmethod
    def from_state(cls, saved: dict[str, Any], where: str) -> "Setup":
        """The setup a checkpoint's :meth:`state` describes."""
        if saved.get("policy") is None:
            raise PolicyError(f"{where}: the checkpoint holds no policy ({saved.get('unsaved')}); give the policy "
                              "in code")
        dims = saved.get("dynamic_dims")
        return cls(Policy.from_json(saved["policy"], where=where), tracer=saved.get("tracer", "auto"),
                   dynamic_dims=None if dims is None else {int(k): v for k, v in dims.items()})


def applied_policy(report: Report) -> dict[str, Any]:
    """The policy a conversion applied (arguments, then ``AMPFX_*`` variables), as plain data."""
    return json.loads(json.dumps(report.policy, default=str))


def check_applied(saved: dict[str, Any] | None, report: Report, who: str) -> None:
    """Raise :class:`PolicyMismatchError` where the policy a resumed run's conversion applied differs from the
    one the checkpoint's run applied (an ``AMPFX_*`` variable set in one run and not the other)."""
    if saved is None:
        return
    now = applied_policy(report)
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, this run {now.get(k)!r}"
             for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)]
    if diffs:
        raise PolicyMismatchError(f"{who}: this run's conversion applied another policy than the checkpoint's run: "
                                  f"{'; '.join(diffs)}. The AMPFX_* environment variables apply on top of the "
                                  "policy given in code: set the same ones as the run that wrote the checkpoint")


def autocast_on() -> list[str]:
    """The device types ``torch.autocast`` is enabled for here."""
    return [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


class FirstCall:
    """Converts ``module`` with ampfx at its first call (:meth:`install`), with that call's inputs as example
    inputs; every later call runs the converted module. ``on_convert(report)`` runs once, after conversion.

    A call under ``torch.autocast`` raises :class:`AutocastConflictError`: ampfx and autocast are never on
    together."""

    def __init__(self, module: nn.Module, setup: Setup, on_convert: Callable[[Report], None] | None = None,
                 who: str = "ampfx") -> None:
        self.module, self.setup, self.on_convert, self.who = module, setup, on_convert, who
        self.converted: nn.Module | None = None

    @property
    def report(self) -> Report | None:
        """The decision log, once the model has been converted (``None`` before its first call)."""
        return None if self.converted is None else self.converted.ampfx_report

    def install(self) -> None:
        """Route ``module``'s calls through this object; a module already routed is an error naming it."""
        if isinstance(self.module.__dict__.get("forward"), _Routed):
            raise ArgumentError(f"{self.who}: {type(self.module).__name__} is already converted by ampfx at its first "
                                "call (given to two trainers or plugins?): give it to one")
        if getattr(self.module, "ampfx_report", None) is not None:
            raise ArgumentError(f"{self.who}: {type(self.module).__name__} is already a module converted by "
                                "ampfx.convert: give the trainer integration the model itself (it converts it at "
                                "its first call), or train the converted module with the trainer's precision off")
        if "forward" in self.module.__dict__:
            raise ArgumentError(f"{self.who}: {type(self.module).__name__}.forward was replaced on the object (by "
                                "another wrapper, such as Accelerate's autocast): give ampfx the model before any "
                                "wrapper changes its forward")
        if getattr(self.module, "_compiled_call_impl", None) is not None:
            raise ArgumentError(f"{self.who}: {type(self.module).__name__} was compiled with module.compile(): ampfx "
                                "converts the model first, then torch.compile may compile the converted forward")
        self.module.__dict__["forward"] = _Routed(self)

    def uninstall(self) -> None:
        """The model's own ``forward`` again."""
        if isinstance(self.module.__dict__.get("forward"), _Routed):
            del self.module.__dict__["forward"]

    @contextlib.contextmanager
    def _own_forward(self) -> Iterator[None]:
        routed = self.module.__dict__.pop("forward")
        try:
            yield
        finally:
            self.module.__dict__["forward"] = routed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        on = autocast_on()
        if on:
            raise AutocastConflictError(
                f"{self.who}: torch.autocast is on ({', '.join(on)}) around the forward of "
                f"{type(self.module).__name__}, which ampfx converts: the two would both choose dtypes. Turn the "
                "trainer's own mixed precision off (Lightning: no precision= flag beside the ampfx plugin; "
                "Accelerate: mixed_precision='no'; HF Trainer: bf16=False, fp16=False) and remove any "
                "torch.autocast block around the model's call")
        with self._own_forward():
            if self.converted is None:
                self.converted = self.setup.convert(self.module, args, kwargs)
                log.info("%s: %s", self.who, self.report.summary().splitlines()[0])
                if self.on_convert is not None:
                    self.on_convert(self.report)
            # forward, not __call__: the model's call already ran its hooks, which the converted module shares
            return self.converted.forward(*args, **kwargs)


class _Routed:
    """The ``forward`` attribute :meth:`FirstCall.install` sets: calls the :class:`FirstCall`, and shows the
    model's own forward's signature (HF Trainer reads it to choose the dataset columns to keep)."""

    def __init__(self, first: FirstCall) -> None:
        self.first = first
        own = type(first.module).forward.__get__(first.module)
        functools.update_wrapper(self, own)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.first(*args, **kwargs)

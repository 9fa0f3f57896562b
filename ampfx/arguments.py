"""The checks :func:`ampfx.convert` runs on its arguments before doing any work.

Each check raises :class:`~ampfx.errors.ArgumentError` with one line naming the
argument, what it got, what was expected and the fix, so a user error never
surfaces as an ``AttributeError`` from deep inside torch.

>>> import torch
>>> check_model(torch.nn.Linear)
Traceback (most recent call last):
...
ampfx.errors.ArgumentError: convert() takes an nn.Module instance; got the class Linear - did you mean Linear(...)?
>>> check_choice("mode", "inferenc", {"train": "float32 masters", "inference": "low weights"})
Traceback (most recent call last):
...
ampfx.errors.ArgumentError: mode='inferenc': use 'train' (float32 masters) or 'inference' (low weights). Did you mean 'inference'?
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_leaves

from .errors import ArgumentError
from .inputs import ExampleInputs
from .policy.names import did_you_mean

_PLAIN = (str, bytes, int, float, bool, type(None))  # leaves that cannot be (or hold) model data


def _what(value: Any) -> str:
    """A short description of ``value`` for a message: ``the class Net``, ``the function f``, ``None``."""
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__}"
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value):
        return f"the function {getattr(value, '__qualname__', value)}"
    return f"{_short(value)} (a {type(value).__name__})"


def check_model(model: Any) -> None:
    """``model`` is an ``nn.Module`` instance (not its class, a function or ``None``), written in Python
    (TorchScript is not: its submodules may be scripted, which stay as they are)."""
    if isinstance(model, torch.jit.ScriptModule):
        raise ArgumentError(f"convert() takes a Python nn.Module; got a TorchScript module ({type(model).__name__}, "
                            "from torch.jit.script or torch.jit.trace), whose code ampfx cannot rewrite. Convert the "
                            "Python model before scripting it; scripted submodules inside a Python model are kept "
                            "as they are")
    if isinstance(model, nn.Module):
        return
    hint = ""
    if isinstance(model, type) and issubclass(model, nn.Module):
        takes = [p for p in inspect.signature(model.__init__).parameters.values()
                 if p.name != "self" and p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        hint = f" - did you mean {model.__name__}({'...' if takes else ''})?"
    elif callable(model) and not isinstance(model, type):
        hint = " - wrap it in an nn.Module, or pass the module that calls it"
    raise ArgumentError(f"convert() takes an nn.Module instance; got {_what(model)}{hint}")


def check_choice(name: str, value: Any, options: Mapping[str, str]) -> None:
    """``value`` is one of ``options`` (name -> what it means)."""
    if isinstance(value, str) and value in options:
        return
    listed = " or ".join(f"{k!r} ({v})" for k, v in options.items())
    close = did_you_mean(value, options) if isinstance(value, str) else ""
    raise ArgumentError(f"{name}={value!r}: use {listed}.{close}")


def check_inputs(model: nn.Module, value: Any, where: str) -> ExampleInputs | None:
    """``value`` as example inputs for ``model``: a tuple or list of positional inputs, a dict of
    keyword inputs or one value, holding model data, and fitting ``model.forward``'s signature."""
    if value is None or isinstance(value, ExampleInputs):
        return value
    if isinstance(value, Iterator) or inspect.isgenerator(value):
        raise ArgumentError(f"{where} is a {type(value).__name__}, which is used up once read: give a tuple of "
                            "positional inputs (x,), a dict of keyword inputs, or one tensor")
    if isinstance(value, Mapping) and not all(isinstance(k, str) for k in value):
        raise ArgumentError(f"{where} is a dict with keys {list(value)[:4]}: a dict gives keyword inputs, so its "
                            "keys must be forward's parameter names")
    if all(isinstance(leaf, _PLAIN) for leaf in tree_leaves(value)):
        raise ArgumentError(f"{where}={_short(value)} holds no tensor (only Python values): give the tensors the "
                            "model is called with, e.g. (torch.randn(8, 16),)")
    inputs = ExampleInputs.of(value)
    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a forward with no readable signature: the model's call will tell
        return inputs
    try:
        signature.bind(*inputs.args, **inputs.kwargs)
    except TypeError as e:
        raise ArgumentError(f"{where} does not fit {type(model).__name__}.forward{signature}: {e}. Give a tuple "
                            "of positional inputs or a dict of keyword inputs for forward's parameters") from None
    return inputs


def _short(value: Any) -> str:
    """``repr(value)`` on one line, at most 60 characters; a tensor by its dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, shape {list(value.shape)})"
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def _kinds(inputs: ExampleInputs) -> tuple[Any, list[tuple[int, str] | None]]:
    """The pytree structure of ``inputs`` and each leaf's (rank, float/int kind) if a tensor."""
    leaves, spec = tree_flatten((inputs.args, dict(sorted(inputs.kwargs.items()))))  # keyword order is free
    return spec, [(t.dim(), "float" if t.is_floating_point() else str(t.dtype)) if isinstance(t, torch.Tensor)
                  else None for t in leaves]


def check_calibration(model: nn.Module, calibrate: Any, loss: Any,
                      inputs: ExampleInputs | None) -> tuple[list[Any], Callable | None] | None:
    """``calibrate`` as a list of batches, each given like ``example_inputs`` and of the same
    structure, tensor ranks and kinds (the graph is built for those); ``loss`` wrapped so that
    it must return a scalar."""
    if calibrate is None:
        if loss is not None:
            raise ArgumentError("calibrate_loss is given without calibrate=: pass calibration batches too")
        return None
    if isinstance(calibrate, (torch.Tensor, Mapping)) or not isinstance(calibrate, Iterable):
        raise ArgumentError(f"calibrate={_what(calibrate)}: give a list of batches, each like example_inputs "
                            "(e.g. [(x1,), (x2,)])")
    batches = list(calibrate)
    if not batches:
        raise ArgumentError("calibrate= has no batches: give a few batches like example_inputs, or leave it out")
    reference = inputs
    for i, batch in enumerate(batches):
        got = check_inputs(model, batch, f"calibrate batch {i}")
        if reference is None:
            reference = got
        elif _kinds(got) != _kinds(reference):
            raise ArgumentError(f"calibrate batch {i} differs from example_inputs in structure, tensor ranks or "
                                f"dtypes ({_describe(got)} vs {_describe(reference)}): give batches like "
                                "example_inputs (sizes may differ)")
    if loss is not None and not callable(loss):
        raise ArgumentError(f"calibrate_loss={_short(loss)}: give a function output -> scalar loss tensor")
    return batches, (ScalarLoss(loss) if loss is not None else None)


def _describe(inputs: ExampleInputs) -> str:
    return ", ".join(f"{'float' if t.is_floating_point() else t.dtype}[{t.dim()}-d]" for t in inputs.tensors())


@dataclass(frozen=True)
class ScalarLoss:
    """A user's ``calibrate_loss`` that must return a scalar float tensor to back-propagate."""

    fn: Callable[[Any], Any]

    def __call__(self, output: Any) -> torch.Tensor:
        loss = self.fn(output)
        if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
            return loss
        got = (f"a {loss.dtype} tensor of shape {list(loss.shape)}" if isinstance(loss, torch.Tensor)
               else _what(loss))
        raise ArgumentError(f"calibrate_loss returned {got}: return one float number as a tensor, "
                            "e.g. lambda out: out.pow(2).mean()")

"""Verification of a capture: does the captured graph compute what the model computes?"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import ExampleInputsError
from ..runtime.graph_module import graph_module
from ..inputs import ExampleInputs
from ..state import keep_hooks, kept_attributes, kept_buffers, kept_rng
from .base import short
from .semantics import python_changes


def reproduces(model: nn.Module, graph: fx.Graph | fx.GraphModule, inputs: ExampleInputs,
               rtol: float = 1e-4, seen: dict[str, tuple[str, ...]] | None = None) -> str | None:
    """``None`` if ``graph`` does what ``model`` does on ``inputs``, else why not. ``graph`` may be the
    graph module :func:`~ampfx.runtime.graph_module.graph_module` made of it over ``model`` (the conversion then
    goes on with it rather than generate the same code again).

    Both run in float32 in the model's current mode (the mode being captured),
    from the same random seed (dropout draws the same masks) and the same
    buffers, and are compared on three things: the outputs; the gradients of
    the parameters (which ones get one, and their values) for one backward of
    the outputs against fixed random weights; and the buffers after the call.
    Python that branches on sizes or values can trace into a graph that runs
    but computes something else, and a graph can lose a ``no_grad`` region or a
    buffer update that its outputs do not show; this catches both before
    conversion. Buffers, parameters' ``.grad`` and the random state are left as found.
    ``seen``, where given, gets the modules whose forward, in the model's own run, changed Python
    state a graph would not repeat (:func:`~ampfx.capture.semantics.python_changes`).
    """
    gm = graph if isinstance(graph, fx.GraphModule) else graph_module(model, graph)
    want = reference(model, inputs, seen)
    return None if want is None else compare(model, gm, inputs, want, rtol)


def reference(model: nn.Module, inputs: ExampleInputs, seen: dict[str, tuple[str, ...]] | None = None) -> _Run | None:
    """The model's own run that :func:`reproduces` compares a graph with; ``None`` where it gives nothing
    to compare (a meta-device model, outputs that take no weighting). Raises
    :class:`~ampfx.errors.ExampleInputsError` when the model does not run on ``inputs`` at all."""
    try:
        return _run(model, model, inputs, seen)
    except ExampleInputsError as e:
        try:  # a forward that runs only without autograd (torch.add(y, 1, out=self.buf)): the inputs are fine
            return _run(model, model, inputs, seen, grad=False)
        except Exception:  # noqa: BLE001 - it does not run without autograd either: the inputs are wrong
            raise e from e.__cause__
    except Exception:  # noqa: BLE001 - nothing to compare
        return None


def compare(model: nn.Module, gm: fx.GraphModule, inputs: ExampleInputs, want: _Run, rtol: float = 1e-4) -> str | None:
    """:func:`reproduces`'s second half: run ``gm`` (over ``model``) and compare with ``want``."""
    keep_hooks(gm, model)  # the converted module calls the model's own hooks around its graph (rewrite)
    try:
        got = _run(gm, model, inputs, grad=want.grad)
    except Exception as e:  # noqa: BLE001
        return f"the torch.fx graph does not run on the example inputs ({short(e)})"
    return _compare_outputs(want.outputs, got.outputs, rtol) or _compare_named(want, got, rtol)


@dataclass(frozen=True)
class _Run:
    """What one run shows: output tensors, each parameter's gradient (``None``: it gets none;
    all ``None`` when no gradient could be taken), each buffer after the call; ``grad``: whether
    it ran with autograd (a forward that fails with it, as ``out=`` into a tensor that needs no
    gradient does, is compared without)."""

    outputs: list[torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    backward: bool
    grad: bool = True


def _run(m: nn.Module, model: nn.Module, inputs: ExampleInputs, seen: dict | None = None,
         grad: bool = True) -> _Run:
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad] if grad else []
    with kept_rng(*model.parameters()), kept_buffers(model), kept_attributes(model, bookkeeping=False), \
            torch.set_grad_enabled(grad):
        torch.manual_seed(0)
        try:  # a copy of the inputs each time: the forward may change what it is given (caches)
            with python_changes(model) if seen is not None else contextlib.nullcontext({}) as changed:
                result = inputs.snapshot().call(m)
            if seen is not None:
                seen.update(changed)
        except Exception as e:  # noqa: BLE001
            if m is model:
                _reject(model, inputs, e)
            raise
        out = [t for t in torch.utils._pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        grads, backward = _grads(out, params)
    return _Run([t.detach() for t in out], grads, buffers, backward, grad)


def _grads(out: list[torch.Tensor], params: list[tuple[str, nn.Parameter]]) -> tuple[dict, bool]:
    """Each parameter's gradient of the outputs weighted by fixed random numbers (a plain sum
    would give zero through a softmax), without touching ``.grad``; ``None`` for unused ones."""
    gen = torch.Generator().manual_seed(0)
    terms = [(t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum()
             for t in out if t.requires_grad and t.is_floating_point() and t.device.type != "meta"]
    if not terms or not params:
        return {n: None for n, _ in params}, False
    try:
        got = torch.autograd.grad(sum(terms), [p for _, p in params], allow_unused=True)
    except RuntimeError:  # no backward here (an output the model computes without autograd history)
        return {n: None for n, _ in params}, False
    return {n: (g.detach() if g is not None else None) for (n, _), g in zip(params, got)}, True


def _compare_outputs(want: list[torch.Tensor], got: list[torch.Tensor], rtol: float) -> str | None:
    if len(want) != len(got):
        return f"the torch.fx graph returns {len(got)} tensors, the model {len(want)}"
    for i, (a, b) in enumerate(zip(want, got)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return (f"the torch.fx graph's output {i} is {b.dtype}{list(b.shape)}, the model's "
                    f"{a.dtype}{list(a.shape)}")
        if "meta" in (a.device.type, b.device.type):
            continue  # no values to compare (a model on the meta device): shapes and dtypes agree
        wrong = _differs(a, b, rtol)
        if wrong is not None:
            return f"the torch.fx graph's output {i} differs from the model's{wrong}"
    return None


def _compare_named(want: _Run, got: _Run, rtol: float) -> str | None:
    """Gradients (when the model's backward ran), then buffers after the call."""
    if want.backward:
        for name, a in want.grads.items():
            b = got.grads.get(name)
            if (a is None) != (b is None):
                return (f"the torch.fx graph gives parameter {name!r} {'a' if b is not None else 'no'} gradient, "
                        f"the model {'a' if a is not None else 'none'} (a grad-mode region or a custom backward "
                        "the graph does not keep?)")
            if a is not None and (wrong := _differs(a, b, rtol)) is not None:
                return f"the torch.fx graph's gradient of parameter {name!r} differs from the model's{wrong}"
    for name, a in want.buffers.items():
        b = got.buffers.get(name)
        if b is None or a.shape != b.shape or a.device.type == "meta":
            continue
        if (wrong := _differs(a, b, rtol)) is not None:
            return (f"after a call, buffer {name!r} differs between the torch.fx graph and the model{wrong} "
                    "(an update of it that the graph does not repeat?)")
    return None


def _reject(model: nn.Module, inputs: ExampleInputs, error: Exception) -> None:
    """Raise :class:`~ampfx.errors.ExampleInputsError`: ``model`` does not run on ``inputs`` in
    float32 (an integer example for a float model). A model on the meta device (no values) is
    left to the later stages."""
    if any(t.device.type == "meta" for t in [*inputs.tensors(), *model.parameters(), *model.buffers()]):
        return
    raise ExampleInputsError(f"the model does not run on example_inputs ({short(error)}); example_inputs: "
                             f"{inputs.describe()}. Give inputs it accepts, with the dtypes its forward expects "
                             "(a tuple of positional inputs or a dict of keyword inputs)") from error


def _differs(a: torch.Tensor, b: torch.Tensor, rtol: float) -> str | None:
    """``None`` if ``b`` equals ``a`` within ``rtol`` of ``a``'s largest finite magnitude, with NaN and
    infinities in the same places (a fully masked attention row is NaN in both); else what differs.

    >>> nan, inf = float("nan"), float("inf")
    >>> _differs(torch.tensor([1.0, nan, -inf]), torch.tensor([1.0, nan, -inf]), 1e-4) is None
    True
    >>> _differs(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0]), 1e-4)
    ' (non-finite values in other places)'
    """
    if not (a.is_floating_point() or a.is_complex()):
        return None if torch.equal(a, b) else ""
    finite = torch.isfinite(a)
    same_place = torch.equal(finite, torch.isfinite(b)) and torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num())
    if not same_place:
        return " (non-finite values in other places)"
    a, b = a[finite], b[finite]
    scale = a.abs().max().item() if a.numel() else 0.0
    if torch.allclose(b, a, rtol=rtol, atol=rtol * max(scale, 1e-6)):
        return None
    return f" (max abs difference {(b - a).abs().max().item():.3g})"

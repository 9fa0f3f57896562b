"""Verification of a capture: does the captured graph compute what the model computes?"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import ExampleInputsError
from ..graph_module import graph_module
from ..inputs import ExampleInputs
from ..state import kept_buffers, kept_rng
from .base import short


def reproduces(model: nn.Module, graph: fx.Graph, inputs: ExampleInputs, rtol: float = 1e-4) -> str | None:
    """``None`` if ``graph`` gives ``model``'s outputs on ``inputs``, else why not.

    Both run in float32 in the model's current mode, without gradients, from
    the same random seed (dropout draws the same masks), and leave buffers
    as found. Python that branches on sizes or values can trace into a graph
    that runs but computes something else; this catches it before conversion.
    """
    gm = graph_module(model, graph)

    def run(m: nn.Module) -> list[Any]:
        with kept_rng(*model.parameters()), kept_buffers(model), torch.no_grad():
            torch.manual_seed(0)
            # a copy of the inputs each time: the forward may change what it is given (caches)
            return torch.utils._pytree.tree_leaves(inputs.snapshot().call(m))

    try:
        want = run(model)
    except Exception as e:  # noqa: BLE001 - the model itself does not run on its example inputs
        _rejects(model, inputs, e)
        return None
    try:
        got = run(gm)
    except Exception as e:  # noqa: BLE001
        return f"the torch.fx graph does not run on the example inputs ({short(e)})"
    want = [t for t in want if isinstance(t, torch.Tensor)]
    got = [t for t in got if isinstance(t, torch.Tensor)]
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


def _rejects(model: nn.Module, inputs: ExampleInputs, error: Exception) -> None:
    """Raise :class:`~ampfx.errors.ExampleInputsError` when ``model`` does not run on ``inputs`` in
    float32 (an integer example for a float model); a model on the meta device (no values) or
    one that needs gradients inside its forward is left to the later stages."""
    tensors = [*inputs.tensors(), *model.parameters(), *model.buffers()]
    if any(t.device.type == "meta" for t in tensors):
        return
    try:
        with kept_rng(*model.parameters()), kept_buffers(model), torch.enable_grad():
            inputs.snapshot().call(model)
        return
    except Exception:  # noqa: BLE001 - fails with gradients too: the inputs are wrong for this model
        pass
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

"""Converted children of a module that keeps its Python hand each other low-precision values through it
(ampfx.runtime.handing): cheaper boundaries, and the Python sees what it saw before on every path it takes.

The reference for "what it saw before" is the module's own ``forward`` called on the converted module without
its handing: each child then returns its outputs in their original dtypes, as every child did before.
"""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.runtime import handing
from tests.support.lean import against_autocast


class Stage(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))


class Branchy(nn.Module):
    """Python steered by an input's value (never captured). On the example input (``k == 0``) it only moves
    ``a``'s output into ``b``; other values of ``k`` take paths conversion never saw, each doing with ``a``'s
    output what Python written for float32 does: a product with a float32 parameter, an ``nn.Linear`` called
    directly, a write through a view, a write into ``h.float()`` (``h`` itself in the model), a tensor made
    with ``h.dtype``, the value returned as it is, or turned into a Python number."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Stage(), Stage(), Stage()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        which = int(k)
        if which == 0:
            g = h.transpose(0, 1).contiguous().transpose(0, 1)
        elif which == 1:
            g = h @ self.w
        elif which == 2:
            g = self.lin(h) + h
        elif which == 3:
            v = h.view(-1)
            v.mul_(2)  # a write into h through a view (exact in any float format, so compared exactly)
            g = h
        elif which == 4:
            y = h.float()  # h itself in the model: the write below is h's
            y.add_(0.1)
            g = h
        elif which == 5:
            g = torch.full(h.shape, 0.1, dtype=h.dtype) + h
        elif which == 6:
            return h
        else:
            g = h * float(h.abs().amax().item())
        return self.c(self.b(g))


def _converted() -> tuple[Branchy, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    net, x = Branchy(), torch.randn(8, 16)
    return net, ampfx.convert(net, "bf16", example_inputs=(x, torch.tensor(0))), x


def _before(amp: nn.Module, x: torch.Tensor, k: int) -> torch.Tensor:
    """The converted module's Python run without handing: each child returns its original dtypes."""
    return type(amp).forward(amp, x, torch.tensor(k))


def test_children_hand_each_other_low_values_through_moves():
    """On the path conversion saw, ``a`` returns bfloat16 and ``b`` takes it as it comes: no cast between."""
    net, amp, x = _converted()
    seen = []

    def hook(module: nn.Module, args: tuple) -> None:
        with torch._C.DisableTorchFunction():  # the dtype itself, not what the parent's Python is shown
            seen.append(args[0].dtype)
    amp.b.register_forward_pre_hook(hook)
    amp(x, torch.tensor(0))
    assert seen == [torch.bfloat16]
    b_input = next(r for r in amp.ampfx_report.records if r.module == "b" and r.kind == "placeholder")
    assert b_input.out == torch.bfloat16, b_input


@pytest.mark.parametrize("k", range(8))
def test_every_path_of_the_python_sees_what_it_saw_before(k):
    """Paths conversion never saw give exactly the values (and gradients) of the converted module whose
    children return float32: nothing raises (``h @ w`` with a float32 ``w``), ``h.dtype`` is float32, a
    write into ``h.float()`` reaches ``b``, the value returned is float32."""
    net, amp, x = _converted()
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    got, want = amp(xs[0], torch.tensor(k)), _before(amp, xs[1], k)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=0, atol=0)


def test_a_child_called_from_outside_returns_its_original_dtypes():
    """A child that hands its parent bfloat16 returns float32 when user code calls it directly."""
    net, amp, x = _converted()
    out = amp.a(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, net.a(x), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_handing(how):
    """A deep copy and a loaded copy hand on as the converted module does, on every path."""
    net, amp, x = _converted()
    if how == "deepcopy":
        other = copy.deepcopy(amp)
    else:
        buf = io.BytesIO()
        torch.save(amp, buf)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    for k in (0, 1, 4):
        torch.testing.assert_close(other(x, torch.tensor(k)), amp(x, torch.tensor(k)), rtol=0, atol=0)


def test_a_moving_parent_costs_no_more_than_autocast():
    """Pattern: children of a module that keeps its Python, glued by transposes. Casts and saved bytes no
    more than autocast's."""
    torch.manual_seed(0)
    net, x = Branchy(), torch.randn(8, 16)
    cost = against_autocast(net, (x, torch.tensor(0)), loss=lambda out: out.float().square().mean())
    assert cost.casts <= cost.casts_autocast, cost
    assert cost.saved <= cost.saved_autocast, cost

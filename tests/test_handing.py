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
from torch.utils._python_dispatch import TorchDispatchMode

import ampfx
from ampfx.runtime import handing
from ampfx.tools.measure import measure_step, saved_bytes
from tests.support.lean import _fresh, against_autocast
from tests.support.models import Stage


@pytest.fixture(autouse=True)
def _hand_low(monkeypatch):
    """Handing is off by default (AMPFX_HAND_LOW): these tests are about it."""
    monkeypatch.setenv("AMPFX_HAND_LOW", "1")


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


class LossAndLogits(nn.Module):
    """The parent computes a loss on one child's output and returns that output too (a language model's
    head: ``loss, logits``), through views."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Stage(), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if float(x.detach().abs().amax()) > 1e6:
            x = x / 2
        logits = self.head(self.body(x).transpose(0, 1))
        loss = nn.functional.cross_entropy(logits.reshape(-1, 10).float(), y.reshape(-1))
        return loss, logits


@pytest.mark.parametrize("k", range(8))
def test_no_path_makes_more_casts_than_without_the_handing(k):
    """On every path of ``Branchy``, a training step casts no more (and saves no more for backward) than the
    same converted module whose children all return their original dtypes: a value the Python computes with
    costs the one cast the child made before."""
    net, amp, x = _converted()

    def step(run) -> None:
        _fresh(net)  # weights an optimizer step just wrote: each step casts them again
        run(x.clone().requires_grad_(), k).square().mean().backward()
    with_handing = measure_step(lambda: step(lambda v, j: amp(v, torch.tensor(j)))).count
    without = measure_step(lambda: step(lambda v, j: _before(amp, v, j))).count
    assert with_handing <= without, (with_handing, without)
    saved = [saved_bytes(lambda: step(lambda v, j: amp(v, torch.tensor(j)))),
             saved_bytes(lambda: step(lambda v, j: _before(amp, v, j)))]
    assert saved[0] <= saved[1], saved
    if k == 0:  # the path conversion saw: strictly cheaper
        assert with_handing < without, (with_handing, without)


class _Upcasts(TorchDispatchMode):
    """Counts the casts from bfloat16 to float32 of tensors of ``numel`` elements."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func.overloadpacket is torch.ops.aten._to_copy and args[0].dtype == torch.bfloat16 and \
                kwargs.get("dtype") == torch.float32 and args[0].numel() == self.numel:
            self.count += 1
        return func(*args, **kwargs)


def test_a_value_read_through_a_view_and_returned_is_cast_once():
    """Pattern: a loss computed on a view of the head's output, which is returned too: one cast of the
    logits (the one the head's graph made before), not one per use; the same values as before."""
    torch.manual_seed(0)
    net, x, y = LossAndLogits(), torch.randn(4, 8, 16), torch.randint(0, 10, (8, 4))
    amp = ampfx.convert(net, "bf16", example_inputs=(x, y))
    assert amp._ampfx_hand == torch.bfloat16
    with torch.no_grad(), _Upcasts(8 * 4 * 10) as upcasts:
        got = amp(x, y)
    assert upcasts.count == 1
    torch.testing.assert_close(got, type(amp).forward(amp, x, y), rtol=0, atol=0)


def test_torch_compile_of_the_handing_parent_computes_what_it_did():
    """``torch.compile`` of the converted module (its parent's Python breaks the graph; the mode's bookkeeping
    is traced): the same values as the module run eagerly without the handing, on three paths."""
    net, amp, x = _converted()
    compiled = torch.compile(amp)
    for k in (0, 1, 4):
        torch.testing.assert_close(compiled(x, torch.tensor(k)), _before(amp, x, k), rtol=0, atol=0)


def test_edits_to_the_model_after_convert_show_through_the_handing():
    """After convert, a checkpoint load, a hook on a part's leaf and a mode switch made on the model show
    through: on every path the values are exactly those of the converted module without the handing, and the
    hook's effect is there."""
    net, amp, x = _converted()
    torch.manual_seed(1)
    net.load_state_dict(Branchy().state_dict())
    hook = net.a.fc2.register_forward_hook(lambda m, args, out: out * 2)
    for training in (True, False):
        net.train(training)
        for k in (0, 1, 3, 6):
            with torch.no_grad():
                got, want = amp(x, torch.tensor(k)), _before(amp, x, k)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    with torch.no_grad():
        hooked = amp(x, torch.tensor(6))  # a's output (relu(2 * fc2(...)): the hook is there
        hook.remove()
        torch.testing.assert_close(hooked, 2 * amp(x, torch.tensor(6)), rtol=0, atol=0)

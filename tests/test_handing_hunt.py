"""Bad inputs for the handing (ampfx.runtime.handing): parent Python that does, with values its converted children
hand it low, what Python written for float32 may do. Each test names the pattern; the promise checked is the one
of tests/test_handing.py: the parent computes, forward and gradients, bitwise what the converted module's own
``forward`` computes without the handing (every child returning its original dtypes), and raises nothing new.
"""
from __future__ import annotations

import io
import weakref

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.runtime import handing
from tests.test_handing import Stage


@pytest.fixture(autouse=True)
def _hand_low(monkeypatch):
    """Handing is off by default (AMPFX_HAND_LOW): these tests are about it."""
    monkeypatch.setenv("AMPFX_HAND_LOW", "1")


def _untraceable(x: torch.Tensor) -> bool:
    """Python steered by a value: the parent keeps its Python, its children are converted one by one."""
    return float(x.detach().abs().amax()) > 1e6


class Paths(nn.Module):
    """On the example input (``k == 0``) the parent only moves ``a``'s output into ``b``; ``k == 1`` runs
    ``body(self, h, x)`` instead, a path conversion never saw."""

    def __init__(self, body) -> None:
        super().__init__()
        self.a, self.b = Stage(), Stage()
        self.body = body

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = h.transpose(0, 1).contiguous().transpose(0, 1) if int(k) == 0 else self.body(self, h, x)
        return self.b(g)


def _run(module: nn.Module, call, x: torch.Tensor, *rest) -> tuple[torch.Tensor, list]:
    """Output and gradients (input, parameters) of ``call(module, x, *rest)`` under a fixed float32 loss."""
    x = x.detach().clone().requires_grad_()
    for p in module.parameters():
        p.grad = None
    out = call(module, x, *rest)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out.float() * weights).sum().backward()
    return out, [x.grad, *(p.grad for p in module.parameters())]


def _same_as_before(amp: nn.Module, x: torch.Tensor, *rest) -> None:
    got, got_grads = _run(amp, lambda m, *a: m(*a), x, *rest)
    want, want_grads = _run(amp, lambda m, *a: type(m).forward(m, *a), x, *rest)
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for g, w in zip(got_grads, want_grads):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def _paths(body) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    amp = ampfx.convert(Paths(body), "bf16", example_inputs=(x, torch.tensor(0)))
    assert amp._ampfx_hand == torch.bfloat16
    return amp, x


def _detached_write(s, h, x):
    h.detach().add_(0.1)
    return h


def _data_write(s, h, x):
    h.data.mul_(3)
    return h


def _write_through_a_part(s, h, x):
    h.view(2, 4, 16)[0].zero_()
    return h


def _read_detached_then_attached(s, h, x):
    return (h * 2) * h.detach()


def _read_under_no_grad_first(s, h, x):
    with torch.no_grad():
        m = h.sum()
    return h * m


def _write_under_no_grad(s, h, x):
    with torch.no_grad():
        h.mul_(2)
    return h


@pytest.mark.parametrize("body", [_detached_write, _data_write, _write_through_a_part, _read_detached_then_attached,
                                  _read_under_no_grad_first, _write_under_no_grad], ids=lambda f: f.__name__[1:])
def test_a_float32_copy_carries_the_gradient_its_reader_had(body):
    """Pattern: the parent reads or writes a handed value through a detached alias (``h.detach()``, ``h.data``),
    under ``torch.no_grad()``, or through a part of its storage, then uses ``h``. The float32 copy the read gets
    records autograd as ``h`` would: gradients reach ``a`` (they were dropped: ``None`` or zero), and a detached
    alias's copy carries none (``h * h.detach()`` got the gradient of ``h * h``)."""
    amp, x = _paths(body)
    _same_as_before(amp, x, torch.tensor(1))


class Halves(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x).chunk(2, dim=-1)


class WritesOneHalf(nn.Module):
    """Pattern: a child returns two views of one storage (``chunk``: a query and a key); the parent writes into
    one (``q *= scale``, on a path conversion never saw) and moves both on."""

    def __init__(self) -> None:
        super().__init__()
        self.qk, self.b = Halves(), Stage()

    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q, key = self.qk(x)
        if int(k) == 1:
            q.mul_(0.5)
        return self.b(q.reshape(8, 16)) + self.b(key.reshape(8, 16))


def test_a_write_into_one_part_keeps_the_other_parts_gradient():
    """Settling a storage whose handed values are all parts of it (no one spans it) copies each part: the key's
    gradient reached ``qk`` through the query's copy before, and was dropped."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    amp = ampfx.convert(WritesOneHalf(), "bf16", example_inputs=(x, torch.tensor(0)))
    _same_as_before(amp, x, torch.tensor(1))


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h.relu_()  # as nn.ReLU(inplace=True) first would
        return self.fc(h) + x


class ReadsAfterAChildWrote(nn.Module):
    """Pattern: a child writes into an input the parent moved into it from another child, and the parent reads
    that value afterwards (the model's own semantics: the write is seen)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)), WritesItsInput()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if _untraceable(x):
            x = x / 2
        h = self.a(x)
        return self.b(h, x), h * 1.0


def test_a_child_writing_its_handed_input_is_seen_as_before():
    """The child took float32 ``h`` and its graph wrote into it, so the parent read the written values; handed the
    low value it wrote into a float32 copy its boundary cast made, and the parent read ``h`` unwritten (0.49 off,
    on the path conversion saw)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    net = ReadsAfterAChildWrote()
    amp = ampfx.convert(net, "bf16", example_inputs=(x,))
    with torch.no_grad():
        got, want = amp(x), type(amp).forward(amp, x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class FansOut(nn.Module):
    """Pattern: one child's output moved into three children (an encoder's output read by three heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = Stage(), Stage(), Stage(), Stage()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _untraceable(x):
            x = x / 2
        h = self.a(x)
        return self.b(h[:, :16]) + self.c(h.view(8, 16)) + self.d(h.flip(0))


def test_a_value_moved_into_several_children_has_the_gradient_it_had():
    """On the path conversion saw, ``a``'s gradients are those it had: handed low, its output's gradient would be
    summed in bfloat16 by autograd, each contribution rounded (``a.fc2.bias`` off by up to 0.06), so the
    observation sees the output read by three children and ``a`` returns it float32 (Links.fanned)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    amp = ampfx.convert(FansOut(), "bf16", example_inputs=(x,))
    _same_as_before(amp, x)


class Remembers(nn.Module):
    """Pattern: the parent keeps a child's output on ``self`` (detached, a recurrent memory) and reads it on its
    next call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Stage(), Stage()
        self.memory = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _untraceable(x):
            x = x / 2
        h = self.a(x)
        before = self.memory if self.memory is not None else torch.zeros(8, 16)
        self.memory = h.detach()
        return self.b(h.view(8, 16)) + before * 0.3


def test_a_value_kept_on_self_is_float32_on_the_next_call():
    """``self.memory`` was float32, and stays so: handed low, it left the call in bfloat16 and the next call
    computed ``memory * 0.3`` in bfloat16; the observation sees a child's output outlive the call and the parent
    hands nothing (Links.stored)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    amp = ampfx.convert(Remembers(), "bf16", example_inputs=(x,))
    amp.memory = None
    with torch.no_grad():
        amp(x)
        assert amp.memory.dtype == torch.float32


class Loop(nn.Module):
    """Pattern: a decoding loop in the parent's Python, moving each child's output into the next child."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Stage(), Stage()

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        for _ in range(int(n)):
            x = self.b(self.a(x).view(x.shape))
        return x


@pytest.mark.xfail(strict=True, reason="Handing.made holds every handed value (and every move of one) until the "
                   "parent returns, to keep ids unique: inference memory grows with the loop's length (weak "
                   "references would do, but torch.compile stores the tensor itself where one is made)")
def test_a_loop_frees_what_it_no_longer_holds():
    """Under ``torch.no_grad()`` each step's outputs are freed once the loop moves on, as without the handing."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    amp = ampfx.convert(Loop(), "bf16", example_inputs=(x, torch.tensor(2)))
    outputs, alive = [], []
    amp.a.register_forward_hook(lambda m, args, out: outputs.append(weakref.ref(out)))
    amp.b.register_forward_pre_hook(lambda m, args: alive.append(sum(o() is not None for o in outputs)))
    with torch.no_grad():
        amp(x, torch.tensor(6))
    assert max(alive) <= 2, alive


class Raises(Paths):
    def forward(self, x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if int(k) == 2:
            raise ValueError("the parent's own error")
        return self.b(h.view(8, 16))


def test_no_mode_is_left_behind_when_the_parent_raises():
    """Pattern: the parent's Python raises after a child handed it a value (the mirror and a loaded copy)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    amp = ampfx.convert(Raises(None), "bf16", example_inputs=(x, torch.tensor(0)))
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    for module in (amp, torch.load(buf, weights_only=False)):
        with pytest.raises(ValueError):
            module(x, torch.tensor(2))
        assert handing.current() is None and not torch.overrides._get_current_function_mode_stack()

"""Never worse than autocast where a module's Python would otherwise keep it out of the graph: size
arithmetic on small integer buffers (read as their values while exporting, checked before every call),
and the other training mode's conversion, made when the converted module is first called in it."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from support.lean import against_autocast


class SamePadConv(nn.Module):
    """A "same"-padding convolution whose stride, kernel size and dilation are integer buffers: the padding
    is computed in Python from them (``max(..., 0)`` asks for their values), then ``F.pad`` and the conv."""

    def __init__(self, cin: int, cout: int, k: int = 3, s: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, s)
        self.register_buffer("stride", torch.tensor([s, s]))
        self.register_buffer("kernel_size", torch.tensor([k, k]))
        self.register_buffer("dilation", torch.tensor([1, 1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = []
        for i, size in enumerate(x.shape[-2:]):
            s, k, d = self.stride[i], self.kernel_size[i], self.dilation[i]
            pads.append(int(max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)))
        ph, pw = pads
        return self.conv(F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2]))


class SamePadNet(nn.Module):
    """ELUs and residual adds around the same-padding conv: its neighbours."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.down = SamePadConv(8, 8)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.proj = nn.Conv2d(8, 8, 1)
        self.act = nn.ELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.stem(x))
        y = self.act(self.down(x))
        y = y + self.act(self.c2(y))
        return self.proj(y) + y


def test_same_padding_from_integer_buffers_costs_no_more_than_autocast():
    """Pattern: padding computed from integer buffers (``register_buffer(..., torch.tensor([2, 2]))``). The
    model is one exported graph, the buffers read as their values, so the ELUs and adds around the padded conv
    stay low: casts and bytes saved for backward no more than autocast's, every GEMM reported."""
    torch.manual_seed(0)
    cost = against_autocast(SamePadNet(), (torch.randn(2, 3, 16, 16),))
    assert cost.casts <= cost.casts_autocast, cost
    assert cost.saved <= cost.saved_autocast, cost
    assert cost.gemms_reported == cost.gemms_run == cost.gemms_low == 4, cost
    (region,) = cost.report.parts
    assert region.method == "export"
    assert any("down.stride" in step and "read as their values" in step for step in region.steps), region.steps


class CodecConv(nn.Module):
    """An audio codec's padded convolution (EnCodec's, as transformers writes it): the padding is tensor
    arithmetic on integer buffers (``torch.ceil`` of the frame count), compared with the length and given to
    ``F.pad`` as tensors (reflect padding)."""

    def __init__(self, cin: int, cout: int, k: int = 4, s: int = 2) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, k, s)
        self.register_buffer("stride", torch.tensor(s), persistent=False)
        self.register_buffer("kernel_size", torch.tensor(k), persistent=False)
        self.register_buffer("padding_total", torch.tensor(k - s), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[-1]
        frames = torch.ceil((length - self.kernel_size + self.padding_total) / self.stride + 1).to(torch.int64) - 1
        extra = frames * self.stride + self.kernel_size - self.padding_total - length
        right = self.padding_total // 2
        return self.conv(self._pad(x, (self.padding_total - right, right + extra)))

    @staticmethod
    def _pad(x: torch.Tensor, pads: tuple) -> torch.Tensor:
        """Reflect padding, zero-padded first where the input is shorter than the padding."""
        extra = max(pads[0], pads[1]) - x.shape[-1] + 1 if x.shape[-1] <= max(pads[0], pads[1]) else 0
        padded = F.pad(F.pad(x, (0, extra)) if extra else x, pads, "reflect")
        return padded[..., :padded.shape[-1] - extra]


class Codec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(CodecConv(1, 8), nn.ELU(), CodecConv(8, 8), nn.ELU(), CodecConv(8, 8, 3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_padding_computed_as_tensors_from_integer_buffers_costs_no_more_than_autocast():
    """Pattern: EnCodec's padding. torch.export with a dynamic length gets a ``SymFloat`` for ``torch.ceil``; with
    the example's length the buffers' arithmetic is computed for real. Each padded conv is one exported graph (it
    kept its Python before, taking and returning float32), so the convolutions pass the low dtype to each other
    as under autocast."""
    torch.manual_seed(0)
    cost = against_autocast(Codec(), (torch.randn(2, 1, 64),))
    assert cost.casts <= cost.casts_autocast, cost
    assert cost.saved <= cost.saved_autocast, cost
    assert cost.gemms_reported == cost.gemms_run == cost.gemms_low == 3, cost
    methods = {r.path: r.method for r in cost.report.parts}
    assert not any(m.startswith("eager") for m in methods.values()), methods


@pytest.mark.parametrize("change", ["in place", "reassigned"])
def test_an_integer_buffer_the_graph_holds_changed_after_convert_converts_again(change):
    """The graph holds the buffers' values: a change after convert (written in place, or a new tensor) converts
    again at the next call, which computes the padding the model's Python now computes; the earlier values
    back, the first conversion runs again."""
    torch.manual_seed(0)
    model, x = SamePadNet(), torch.randn(2, 3, 16, 16)
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    with torch.no_grad():
        first = model(x)
        assert (amp(x).float() - first).abs().max() < 0.05
        if change == "in place":
            model.down.stride.fill_(1)  # padding 2 instead of 1 on 16 x 16
        else:
            model.down.stride = torch.tensor([1, 1])
        now = model(x)
        assert (now - first).abs().max() > 0.5  # the stale graph would be this far off
        assert (amp(x).float() - now).abs().max() < 0.05
        model.down.stride = torch.tensor([2, 2])
        assert (amp(x).float() - first).abs().max() < 0.05
    assert len(amp.variants()) == 1  # the conversion made again; the first ran again for the first values


def test_a_buffer_the_forward_writes_is_not_read_as_its_values():
    """A small integer buffer the forward updates (a step counter) is the module's state: with it read as its
    values the export stops, so the module keeps what it had without (no graph that repeats one step)."""

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("steps", torch.tensor(0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps += 1
            return self.lin(x) * max(int(self.steps), 1)

    model = Counting()
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(torch.randn(2, 4),))
    assert all(r.method != "export" for r in amp.ampfx_report.parts)
    before = int(model.steps)
    amp(torch.randn(2, 4))
    assert int(model.steps) == before + 1


class Doubles(nn.Module):
    """Reads ``self.training`` (an exported graph holds one mode), with a batch norm whose running statistics
    the train graph updates and the eval one reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.fc(x))
        return h * 2 if self.training else h


@pytest.fixture
def captures(monkeypatch):
    """The training modes the capture ladder ran in, in order (one entry per module captured)."""
    from ampfx.capture import ladder

    seen, capture = [], ladder.capture

    def counting(module, *args, **kwargs):
        seen.append(module.training)
        return capture(module, *args, **kwargs)

    monkeypatch.setattr(ladder, "capture", counting)
    return seen


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_the_other_training_mode_is_converted_at_its_first_use_not_at_convert(captures, tracer):
    """Conversion time: a model reading self.training is captured once at convert (its mode); its eval-mode
    conversion is made at the first call in eval mode (here under inference_mode, as validation loops call
    it), once, and is right: eval output, running statistics read and left alone; train mode unchanged."""
    torch.manual_seed(0)
    m, x = Doubles().train(), torch.randn(6, 8)
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(x,), tracer=tracer)
    assert captures == [True]
    assert any("when first needed" in n for n in amp.ampfx_report.notes)
    amp(x)  # a training step's forward: running statistics move
    assert captures == [True]
    stats = m.bn.running_mean.clone()
    with torch.inference_mode():
        out = amp.eval()(x)
    assert captures == [True, False]
    assert torch.equal(m.bn.running_mean, stats)
    assert (out.float() - m.eval()(x)).abs().max() < 0.05
    amp(x), amp.train(), m.train()
    assert (amp(x).float() - m(x)).abs().max() < 0.1
    assert captures == [True, False]
    assert [r.method for r in amp.mode_module(False).ampfx_report.parts] == [tracer]


def test_a_pickle_made_before_the_other_mode_was_used_keeps_both_modes(captures):
    """A loaded copy cannot convert: pickling makes the other mode's conversion first (and the converted
    module keeps it), so the copy runs both modes."""
    import pickle

    torch.manual_seed(0)
    m, x = Doubles().train(), torch.randn(6, 8)
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(x,), tracer="export")
    copy = pickle.loads(pickle.dumps(amp))
    assert captures == [True, False]
    amp.eval()(x)
    assert captures == [True, False]
    m.eval()
    assert (copy.eval()(x).float() - m(x)).abs().max() < 0.05
    m.train()
    assert (copy.train()(x).float() - m(x)).abs().max() < 0.1

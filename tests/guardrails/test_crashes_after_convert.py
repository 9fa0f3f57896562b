"""Models that converted into a crash, or into an error that named the wrong cause: each now gives the
model's result, or an ampfx error naming the real cause and a fix that works."""
import inspect

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx import ops
from ampfx.errors import GuardError
from conftest import DTYPES, rel


# -- optional non-tensor arguments fixed while tracing -------------------------------------------------------------

class Flag(nn.Module):
    """Python control flow on a bool argument, and a tuple argument read by index."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(s, x, flag=False, mix=(0.5, 0.5)):  # noqa: N805 - not called self: torch.fx's pytree code broke on it
        y = s.l(x)
        if flag:
            y = y * mix[0]
        return y * mix[1]


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_fixed_container_and_bool_defaults_convert_and_are_guarded(tracer):
    """Arguments torch.fx fixed at their defaults, a tuple among them, keep forward's signature (one
    argument each, with its default, in forward's order): calls at those values, by position or
    keyword, give the model's result; any other value raises GuardError naming the argument and the fix,
    never a graph built for the defaults."""
    model, x = Flag(), torch.randn(3, 4)
    amp = ampfx.convert(model, example_inputs=(x,), tracer=tracer)
    assert amp.ampfx_report.regions[0].method == "fx, optional arguments fixed"
    params = inspect.signature(amp.forward).parameters
    assert [(p.name, p.default) for p in params.values()][1:] == [("flag", False), ("mix", (0.5, 0.5))]
    want = model(x)
    for args, kwargs in [((x,), {}), ((x, False), {}), ((x, False, (0.5, 0.5)), {}),
                         ((x,), {"mix": (0.5, 0.5)}), ((), {"x": x, "flag": False, "mix": (0.5, 0.5)})]:
        assert rel(amp(*args, **kwargs), want) < 0.03, (args, kwargs)
    for args, kwargs, name in [((x,), {"flag": True}, "flag"), ((x, True), {}, "flag"),
                               ((x,), {"mix": (0.1, 0.9)}, "mix"), ((x, False, (0.1, 0.9)), {}, "mix")]:
        with pytest.raises(GuardError, match=rf"input {name} .*fixed it while tracing.*example_inputs that give {name}"):
            amp(*args, **kwargs)


# -- Fourier transforms after a low-precision op -------------------------------------------------------------------

class Spectral(nn.Module):
    """A linear layer, then a real FFT, a complex product, and back (an FNet / FNO-style spectral mix)."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        z = torch.fft.rfft(self.l(x))
        y = torch.fft.irfft(z * 0.5, n=16) + torch.fft.fft2(self.l(x)).real
        return self.out(y)


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fft_after_a_low_precision_op_runs_in_float32(dtype, tracer):
    """The torch.fft functions (and the ATen ops torch.export records for them) are on the deny list: an FFT
    of a low-precision linear's output reads it in float32 (no bfloat16/float16 FFT kernel on CPU), the
    converted module gives the float32 model's result, and the FFT's record says float32 with the deny
    list's reason."""
    torch.manual_seed(0)
    model, x = Spectral(), torch.randn(4, 16)
    amp = ampfx.convert(model, dtype, example_inputs=(x,), tracer=tracer)
    assert rel(amp(x), model(x)) < 0.03
    for op in ("rfft", "fft2"):
        rec = next(r for r in amp.ampfx_report.records if r.op == op)
        assert (rec.dtype, rec.category, rec.reason) == (torch.float32, ops.Category.DENY, ops.ENTRIES[op].reason)
    assert amp.ampfx_report.by_node("linear").dtype == dtype
    assert ops.lookup_name(torch.ops.aten._fft_r2c.default) == "rfft"
    assert ops.lookup_name(torch.ops.aten._fft_c2r.default) == "irfft"


class MakesComplex(nn.Module):
    """Complex numbers built from a low-precision linear's output, by ops on no list or on the clear list."""

    def __init__(self, how):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.how = how

    def forward(self, x):
        y = self.l(x)
        if self.how == "complex":
            z = torch.complex(y, y.flip(-1))
        else:
            z = torch.view_as_complex(y.reshape(4, 4, 2))
        return z.abs()


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("how", ["complex", "view_as_complex"])
def test_an_op_making_complex_from_real_data_reads_float32(how, tracer):
    """An op that makes complex numbers from real float data reads it in float32 (bfloat16 has no complex
    dtype), where it used to run as written on bfloat16 data and fail: torch.complex is on no list (rule
    unlisted), view_as_complex is a clear op under torch.export (rule complex). The converted module gives
    the model's result."""
    model, x = MakesComplex(how), torch.randn(4, 8)
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,), tracer=tracer)
    assert amp.ampfx_report.regions[0].method == tracer
    assert rel(amp(x), model(x)) < 0.03
    made = next(r for r in amp.ampfx_report.records if r.node.startswith(("complex", "view_as_complex")))
    rule = "complex" if (how, tracer) == ("view_as_complex", "export") else "unlisted"
    assert (made.dtype, made.rule) == (torch.float32, rule)

"""Functions a library ``torch.fx.wrap``-s (attention helpers kept from fx's sight) hold GEMMs: under
``tracer="auto"`` they are traced into, so they cost no more than under autocast, and the report counts
every GEMM the model runs, those inside opaque nodes included (``Report.gemms``)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from support.clock import ExportClock
from support.lean import GemmCounter, against_autocast

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.fx.wrap
def attend(q, k, v):
    """Attention by hand: two matmuls around a softmax, wrapped as libraries wrap such helpers."""
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    return scores.softmax(-1) @ v


@torch.fx.wrap
def attend_fused(q, k, v):
    """Attention through the fused kernel, wrapped."""
    return F.scaled_dot_product_attention(q, k, v)


@torch.fx.wrap
def attend_clipped(q, k, v):
    """Attention with data-dependent control flow: torch.fx cannot trace it, nor can torch.export."""
    scores = q @ k.transpose(-2, -1)
    if scores.abs().amax() > 1e4:
        scores = scores / scores.abs().amax()
    return scores.softmax(-1) @ v


class Attention(nn.Module):
    def __init__(self, core, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.heads = heads
        self.core = core.__name__

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        if self.core == "attend":  # each called by its global name, as library code calls a wrapped helper
            y = attend(q, k, v)
        elif self.core == "attend_fused":
            y = attend_fused(q, k, v)
        else:
            y = attend_clipped(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def _autocast_low(model, inputs, dtype=torch.bfloat16):
    """The GEMMs autocast runs in the low dtype on ``inputs``."""
    with torch.autocast("cpu", dtype=dtype), torch.no_grad(), GemmCounter() as gemms:
        model(*inputs)
    return gemms.by_dtype.get(dtype, 0)


@pytest.mark.parametrize("core", [attend, attend_fused], ids=["matmul-softmax-matmul", "sdpa"])
def test_a_wrapped_attention_helper_costs_no_more_than_autocast(core):
    """A torch.fx.wrap-ped attention core (matmuls or scaled_dot_product_attention inside) is traced into
    under tracer='auto': its GEMMs run low as autocast runs them, no more casts or saved bytes than
    autocast, and the report counts the GEMMs that run."""
    model, x = Attention(core), torch.randn(2, 8, 16)
    cost = against_autocast(model, (x,))
    assert cost.casts <= cost.casts_autocast and cost.saved <= cost.saved_autocast, cost
    assert cost.gemms_reported == cost.gemms_run, cost
    assert cost.gemms_low == _autocast_low(model, (x,)) == cost.gemms_run, cost
    assert cost.report.parts[0].functions == ()
    assert any(core.__name__ in step for step in cost.report.parts[0].steps)


def test_an_untraceable_wrapped_function_runs_as_written_and_the_report_names_it(monkeypatch):
    """A wrapped function with data-dependent control flow cannot be traced (torch.export fails on it too):
    it stays one float32 node as torch.fx keeps it, the model still computes what it computes, and the report
    names the function, counts the two GEMMs inside it and says they are not low. export's budgets run on a fake
    clock that no step advances: export fails on the branch itself, however slow or loaded the machine (on the
    real clock a loaded machine ran the every-dimension try past its share of export_timeout)."""
    clock = ExportClock().install(monkeypatch)
    model, x = Attention(attend_clipped), torch.randn(2, 8, 16)
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(x,))
    steps = amp.ampfx_report.parts[0].steps
    assert clock.elapsed == 0 and not any("stopped after" in s for s in steps), steps
    assert any(s.startswith("torch.export") and "data-dependent" in s for s in steps), steps
    torch.testing.assert_close(amp(x), model(x), atol=0.05, rtol=0.05)
    cost = against_autocast(model, (x,), amp=amp)
    rep = cost.report
    name = f"{__name__}.attend_clipped"
    assert [f for f, _ in rep.parts[0].functions] == [name]
    assert "control flow" in dict(rep.parts[0].functions)[name]
    assert cost.gemms_reported == cost.gemms_run == 4 and cost.gemms_low == rep.gemms_low == 2, cost
    summary = rep.summary()
    assert f"GEMMs: 2/4 in bfloat16; the others in {name} 2" in summary
    assert f"functions kept whole (torch.fx.wrap): {name}" in summary


def test_tracer_fx_keeps_a_wrapped_function_whole_and_says_so():
    """tracer='fx' follows torch.fx: a wrapped function stays one node (its graph is not checked against the
    model, so nothing is traced that fx would not trace); the report names it and counts its GEMMs."""
    model, x = Attention(attend), torch.randn(2, 8, 16)
    cost = against_autocast(model, (x,), tracer="fx")
    assert cost.gemms_reported == cost.gemms_run == 4 and cost.gemms_low == 2, cost
    assert [f for f, _ in cost.report.parts[0].functions] == [f"{__name__}.attend"]


@pytest.mark.parametrize("leaf", ["mha", "lstm-gru", "eager-region"])
def test_the_report_counts_the_gemms_leaves_and_eager_modules_run(leaf):
    """Report.gemms counts what runs at ATen level: nn.MultiheadAttention's several GEMMs (their number
    depends on the dtype it runs in), recurrent modules' (none where oneDNN's fused kernel runs them), and
    those in the Python of a module that could not be traced."""
    class Gate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16) / 4)
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: the module keeps its Python, its child is converted
                x = x @ self.w
            return self.fc(x)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = {"mha": lambda: nn.MultiheadAttention(16, 2, batch_first=True),
                         "lstm-gru": lambda: nn.Sequential(nn.LSTM(16, 16, batch_first=True)),
                         "eager-region": Gate}[leaf]()
            self.gru = nn.GRU(16, 16, batch_first=True)
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            if leaf == "mha":
                x = self.body(x, x, x)[0]
            elif leaf == "lstm-gru":
                x = self.gru(self.body[0](x)[0])[0]
            else:
                x = self.body(x)
            return self.head(x)

    cost = against_autocast(Net(), (torch.randn(2, 5, 16).abs(),), autocast=False)  # what ampfx runs, alone
    assert cost.gemms_reported == cost.gemms_run, cost
    assert cost.report.gemms_low == cost.gemms_low, cost


def test_without_example_inputs_the_gemms_are_not_counted():
    """No example inputs, nothing run: Report.gemms is None (unknown), not a guess from the op tables."""
    rep = ampfx.convert(nn.Sequential(nn.Linear(4, 4)), torch.bfloat16).ampfx_report
    assert rep.gemms is None and rep.gemms_low is None

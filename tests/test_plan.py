"""ampfx.plan: the compiler half alone (graph in, plan out): the same decisions as convert, a plain torch.fx graph
over the model's own parameters, no runtime; the compile backend uses it."""
from __future__ import annotations

import ast
from pathlib import Path

import torch
import torch.nn as nn

import ampfx
from ampfx.runtime.graph_module import AmpGraphModule

ROOT = Path(__file__).resolve().parents[1]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 4)

    def forward(self, x):
        return torch.softmax(self.fc2(torch.relu(self.norm(self.fc1(x)))), -1)


X = torch.randn(8, 16)


def test_a_plan_makes_convert_s_decisions_as_a_plain_graph_over_the_model_s_parameters():
    torch.manual_seed(0)
    model = Net()
    p = ampfx.plan(model, "bf16", example_inputs=(X,), gemm_min_flops=0)
    amp = ampfx.convert(model, "bf16", example_inputs=(X,), gemm_min_flops=0)
    assert [(d.node, d.dtype, d.rule) for d in p.report.records] == \
        [(d.node, d.dtype, d.rule) for d in amp.ampfx_report.records]
    assert type(p.graph).__mro__[1] is torch.fx.GraphModule and not isinstance(p.graph, AmpGraphModule)
    assert not any(k.startswith("_ampfx") for k in vars(p.graph))  # no runtime: no checks, no view, no cache
    assert {n: t for n, t in p.graph.named_parameters()}.keys() == {n for n, _ in model.named_parameters()}
    assert all(p.graph.get_parameter(n) is t for n, t in model.named_parameters())
    torch.testing.assert_close(p.graph(X), amp(X), rtol=0, atol=0)
    p.graph(X).sum().backward()  # gradients reach the model's own parameters
    assert all(t.grad is not None for t in model.parameters())


def test_the_reads_table_says_the_dtype_each_parameter_is_read_in():
    """The table is FSDP2's gather dtype of the converted model (ampfx.integrations.fsdp.decide: the same scan): the
    GEMM weights low, the norm's parameters float32 (LayerNorm is on the deny list), each bias as its GEMM reads it."""
    from ampfx.integrations import fsdp

    torch.manual_seed(0)
    model = Net()
    p = ampfx.plan(model, "bf16", example_inputs=(X,), gemm_min_flops=0)
    gathered = {d.name: d.dtype for d in fsdp.decide(ampfx.convert(model, "bf16", example_inputs=(X,),
                                                                   gemm_min_flops=0))}
    assert dict(p.reads) == gathered
    assert (p.reads["fc1.weight"], p.reads["norm.weight"]) == (torch.bfloat16, torch.float32)


def test_a_model_that_does_not_convert_as_one_graph_has_no_graph_and_says_why():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: the model keeps its Python, its child converts alone
                return self.fc(x)
            return -self.fc(x)

    p = ampfx.plan(Branchy(), "bf16", example_inputs=(X,), gemm_min_flops=0, tracer="fx")
    assert p.graph is None and p.reads == {} and len(p.report.parts) > 1


def test_the_compile_backend_plans_and_does_not_convert():
    """Rule: the backend takes the compiler half (ampfx.plan) and arms no runtime it would discard."""
    tree = ast.parse((ROOT / "ampfx" / "integrations" / "dynamo.py").read_text())
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "plan" in called and "convert" not in called | imported


def test_a_module_the_graph_calls_is_the_model_s_own_and_a_tied_weight_is_read_under_each_name():
    """A leaf the graph calls as it is (here a Dropout) is the model's module, so the model's eval() reaches it;
    a tied weight is in the reads table under both of its names."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.drop, self.b = nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 16)
            self.b.weight = self.a.weight

        def forward(self, x):
            return self.b(self.drop(self.a(x)))

    model = Tied()
    p = ampfx.plan(model, "bf16", example_inputs=(X,), gemm_min_flops=0, leaf_modules=[nn.Dropout])
    assert p.graph.get_submodule("drop") is model.drop
    model.eval()
    assert torch.equal(p.graph(X), p.graph(X))  # dropout off: the model's flag reached the graph
    assert p.reads["a.weight"] == p.reads["b.weight"] == torch.bfloat16


def test_disabled_plans_nothing_and_the_report_says_so():
    """AMPFX_DISABLE=1 (or disable=True) turns ampfx off for plan as for convert: no graph (the compile backend then
    compiles the graph as captured), a report that says the conversion was disabled."""
    p = ampfx.plan(Net(), "bf16", example_inputs=(X,), environ={"AMPFX_DISABLE": "1"})
    assert p.graph is None and p.reads == {} and p.report.disabled


def test_plan_says_when_fp8_was_asked_and_no_gemm_got_it():
    """As convert: fp8= with no GEMM in FP8 is a note and a warning, never silent."""
    import warnings

    from ampfx.policy.fp8 import HAS_FP8
    if not HAS_FP8:
        return
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        p = ampfx.plan(Net(), "bf16", example_inputs=(X,), gemm_min_flops=0, fp8="tensorwise")
    assert any("fp8" in n.lower() and "no gemm" in n.lower() for n in p.report.notes), p.report.notes
    assert any("fp8" in str(w.message).lower() for w in said)

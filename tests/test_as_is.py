"""A graph whose plan lowers nothing runs the model's own module: float32's step, without the graph's overhead."""
from __future__ import annotations

import torch
import torch.nn as nn

import ampfx
from ampfx.runtime.graph_module import AmpGraphModule

BREAK_EVEN = 2 * 64 * 64 * 64  # a 64 -> 64 linear pays from 64 rows


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).softmax(-1)


def _graphs(amp):
    return [m for m in amp.modules() if isinstance(m, AmpGraphModule)]


def _convert(model, rows=4, **options):
    return ampfx.convert(model, "bf16", example_inputs=(torch.randn(rows, 64),), gemm_min_flops=BREAK_EVEN,
                         gemm_min_rows=0, **options)


def test_a_plan_with_nothing_low_runs_the_model_module_itself():
    """Rule: every GEMM under the break-even, nothing low: the call runs the model module's own forward (its
    graph's code does not run), bitwise the model's output and gradients, no cast, and the report says so."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 64)
    amp = _convert(model)
    assert all(g._rt.plan.as_is for g in _graphs(amp))
    assert any("runs the module as it is" in n for n in amp.ampfx_report.notes)
    ran = []
    for g in _graphs(amp):
        type(g)._ampfx_graph_forward = lambda *a, **k: ran.append(1)  # the graph's code (the class is the graph's own)
    ref = Net()
    ref.load_state_dict(model.state_dict())
    out, want = amp(x), ref(x)
    assert not ran and torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))
    assert ampfx.count_casts(lambda: amp(x)) == 0


def test_a_plan_with_something_low_runs_its_graph():
    """Rule: one GEMM low (every GEMM pays at gemm_min_flops=0): the graph runs, as converted."""
    amp = ampfx.convert(Net(), "bf16", example_inputs=(torch.randn(4, 64),), gemm_min_flops=0)
    assert not any(g._rt.plan.as_is for g in _graphs(amp))
    assert ampfx.count_casts(lambda: amp(torch.randn(4, 64))) > 0


def test_sizes_that_cross_a_break_even_still_plan_again():
    """Rule: run as it is at the example's size, the first call at 64x the rows crosses the break-even: the graph is
    planned again with its GEMMs low, and that plan runs its graph; the small size still runs the module itself."""
    torch.manual_seed(0)
    model = Net()
    amp = _convert(model)
    big = torch.randn(256, 64)
    out = amp(big)
    made = amp.variants()
    assert len(made) == 1 and not made[0]._rt.plan.as_is
    assert any(d.dtype == torch.bfloat16 for d in made[0].ampfx_report.compute if d.op == "linear")
    torch.testing.assert_close(out, model(big), rtol=2e-2, atol=2e-3)
    assert ampfx.count_casts(lambda: amp(big)) > 0 and ampfx.count_casts(lambda: amp(torch.randn(4, 64))) == 0


def test_edits_and_hooks_show_through_once():
    """Rule: a hook registered on the model after convert fires once a call (not once for the converted module and
    again for the model module it runs; the call that sees a new hook on a submodule converts again, running the
    module while it converts, as for any plan), a weight written in place and a submodule swapped show through."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 64)
    amp = _convert(model)
    seen = []
    model.register_forward_hook(lambda m, a, out: seen.append(out.shape))
    model.a.register_forward_hook(lambda m, a, out: seen.append("a"))
    amp(x)
    seen.clear()
    amp(x)
    assert seen == ["a", torch.Size([4, 64])]
    with torch.no_grad():
        model.a.weight.mul_(2)
    model.b = nn.Linear(64, 64)
    assert torch.equal(amp(x), model(x))


def test_a_graph_whose_values_arrive_or_leave_low_is_not_run_as_it_is():
    """Rule: nothing low in its graph, but its float inputs arrive low or its outputs leave low (a kept module converted
    on its own inside a low graph, a child an eager parent hands low values to), or it runs hooks torch.export traced
    in: it runs its graph (the module as it is would compute in the dtype handed it)."""
    import dataclasses

    from ampfx.passes.context import Place
    from ampfx.rewrite import runs_as_is

    amp = _convert(Net())
    plan, report = amp._rt.plan, amp.ampfx_report
    assert runs_as_is(report, Place(), plan) and runs_as_is(report, Place(arrive=torch.float32), plan)
    for place in (Place(arrive=torch.bfloat16), Place(enter=torch.float16), Place(hands_on=True)):
        assert not runs_as_is(report, place, plan), place
    assert not runs_as_is(report, Place(), dataclasses.replace(plan, own_hooks=True))
    low = ampfx.convert(Net(), "bf16", example_inputs=(torch.randn(4, 64),), gemm_min_flops=0)
    assert not runs_as_is(low.ampfx_report, Place(), plan)


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l, self.l2 = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x):
        y = self.l(x)
        if y.sum().item() > -1e9:  # Python control flow on a value: converted on its own
            y = y * 2
        return self.l2(y)


class _Around(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Untraceable()

    def forward(self, x):
        return torch.softmax(self.inner(x).float(), -1) + 1


def test_a_graph_calling_a_converted_child_runs_its_graph():
    """Rule: a graph with nothing low of its own that calls a child converted separately (which runs low) runs its
    graph, so the child runs as converted: the model module itself would call the model's own child, float32."""
    x = torch.randn(256, 64)
    amp = ampfx.convert(_Around(), "bf16", example_inputs=(x,), gemm_min_flops=0)
    assert any(d.dtype == torch.bfloat16 for d in amp.ampfx_report.records if d.op == "linear")
    assert ampfx.count_casts(lambda: amp(x)) > 0


def test_a_module_set_on_the_converted_module_runs():
    """Rule: a wrapper set on the converted module after convert (the converted tree's structure is its own) is
    called, as the graph calls it, though the plan lowers nothing."""
    class Wrap(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x) * 2

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 64)
    amp = _convert(model, keep_modules=["a"])
    before = amp(x)
    amp.a = Wrap(amp.a)
    assert not torch.equal(amp(x), before)
    assert torch.equal(amp(x), model.b(torch.relu(model.a(x) * 2)).softmax(-1))


def test_a_loaded_copy_without_its_model_runs_its_graph():
    """Rule: a pickled converted module whose model could not go along (an attribute that does not pickle) runs its
    graph: there is no model module to run."""
    import io

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 64)
    model.f = lambda t: t
    amp = _convert(model)
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_low_inputs_run_the_graph_which_casts_them_per_op():
    """Rule: a float input handed in a low dtype runs the graph, which casts it where an op needs float32 (as it did
    before nothing-low plans ran the module): an elementwise-only graph keeps the dtype it was handed."""
    class Ew(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    amp = ampfx.convert(Ew(), "bf16", example_inputs=(torch.randn(4, 64),))
    assert amp._rt.plan.as_is
    x = torch.randn(4, 64).bfloat16()
    assert amp(x).dtype == torch.bfloat16 and amp((x.float())).dtype == torch.float32

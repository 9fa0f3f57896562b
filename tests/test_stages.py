"""The stages of convert on their own: example inputs, the capture ladder's verdicts, the one
observation run, and the module-tree loop."""
import torch
import torch.nn as nn

import ampfx
from ampfx.capture import ladder
from ampfx.capture.base import Capture, Uncaptured
from ampfx.inputs import ExampleInputs
from ampfx.capture.observe import observe

RUNS: list[str] = []


class Block(nn.Module):
    """Untraceable (a Python branch on a value), with two children that trace."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        if not isinstance(x, torch.fx.Proxy):  # real runs only, not tracing
            RUNS.append("block")
        self.count += 1
        h = self.a(x)
        return self.b(h) if h.sum() > -1e9 else h


class ShapeBranch(nn.Module):
    """torch.fx cannot branch on a traced size; torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x) * 2 if x.shape[-1] == 4 else x


class Root(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.head = Block(), nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        if not isinstance(x, torch.fx.Proxy):
            RUNS.append("root")
        h = self.block(x)
        return self.head(h) if h.mean() < 1e9 else h


def test_example_inputs_take_every_convention():
    """A tuple or list is positional, a dict is keywords, one value is the only positional."""
    x = torch.ones(2)
    assert ExampleInputs.of((x, 3)).args == (x, 3) and ExampleInputs.of([x]).args == (x,)
    assert ExampleInputs.of({"x": x}).kwargs == {"x": x} and ExampleInputs.of({"x": x}).args == ()
    assert ExampleInputs.of(x).args == (x,) and ExampleInputs.of(None) is None

    def forward(x, mask=None, scale=1.0):
        return x

    ex = ExampleInputs.of({"scale": 2.0, "x": x})
    assert list(ex.ordered(forward)[1]) == ["x", "scale"]
    assert ex.tensor_names(forward) == {"x"}
    assert ExampleInputs.of((x,)).bind(forward).arguments == {"x": x, "mask": None, "scale": 1.0}
    lin = nn.Linear(2, 2)
    assert ExampleInputs.from_call(lin, (x,), {}).args == (x,)
    assert ExampleInputs.from_call(lin, (), {"input": x}).kwargs == {"input": x}


def test_a_snapshot_is_not_reached_by_later_changes():
    """snapshot() deep-copies: an in-place change to the original leaves the copy as it was."""
    x = torch.zeros(2)
    copy = ExampleInputs.of((x, [x])).snapshot()
    x += 1
    assert copy.args[0].sum() == 0 and copy.args[1][0].sum() == 0


def test_the_ladder_says_why_it_accepted_a_capture():
    """fx that reproduces the model is accepted with that reason; tracer='fx' without checking says so;
    a forward fx cannot trace is exported (auto), or uncaptured (fx)."""
    policy = ampfx.Policy()
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = ExampleInputs.of((torch.randn(2, 4),))
    got = ladder.capture(net, policy, x, "auto")
    assert isinstance(got, Capture) and got.method == "fx" and "reproduces" in got.why
    assert "not checked" in ladder.capture(net, policy, x, "fx").why
    exported = ladder.capture(ShapeBranch(), policy, x, "auto")
    assert isinstance(exported, Capture) and exported.method == "export" and exported.why
    assert any(s.startswith("auto: torch.fx could not trace") for s in exported.steps)
    refused = ladder.capture(ShapeBranch(), policy, x, "fx")
    assert isinstance(refused, Uncaptured) and refused.steps and not any("export" in s for s in refused.steps)


def test_observe_runs_the_model_once_and_leaves_it_as_found():
    """One run records the first call of every submodule; buffers and the random state are put back."""
    root, x = Root(), ExampleInputs.of((torch.randn(3, 4),))
    RUNS.clear()
    before = torch.random.get_rng_state()
    seen = observe(root, x, calls=True)
    assert RUNS == ["root", "block"]
    assert {"block", "block.a", "block.b", "head", "head.0", "head.2"} <= set(seen.calls)
    assert seen.calls["head.2"].args[0].shape == (3, 8)
    assert int(root.block.count) == 0 and torch.equal(torch.random.get_rng_state(), before)


def test_a_tree_converted_region_by_region_runs_each_module_once_for_real():
    """Nested modules that keep their Python (root and block) are converted from one observation run:
    each forward runs once for real (recording the children's inputs), not once per level."""
    model = Root()
    RUNS.clear()
    amp = ampfx.convert(model, torch.bfloat16, example_inputs=(torch.randn(3, 4),), tracer="fx")
    assert RUNS == ["root", "block"]
    regions = {r.path: r for r in amp.ampfx_report.parts}
    assert regions[""].method.startswith("eager") and regions["block"].method.startswith("eager")
    assert regions["head"].method == "fx" and regions["head"].why
    assert [r.path for r in amp.ampfx_report.parts] == ["block.a", "block.b", "block", "head", ""]
    assert isinstance(amp.block.a, torch.fx.GraphModule) and isinstance(amp.head, torch.fx.GraphModule)
    assert int(model.block.count) == 0  # the observation run put the counter back
    x = torch.randn(5, 4)
    torch.testing.assert_close(amp(x), model(x), atol=0.05, rtol=0.05)


class SumChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 12)

    def forward(self, x):
        h = self.lin(x)
        return h + h.sum()  # a full reduction: batch * 12 elements


class ValueBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = SumChild()

    def forward(self, x):
        return self.child(x * 2 if x.sum() > -1e9 else x)  # a branch on a value: the root keeps its Python


def test_dynamic_dims_name_the_models_inputs_not_a_regions():
    """dynamic_dims describe the dimensions of the model's own inputs: a region converted on its own
    (its parent keeps its Python) gets static sizes, so its small sum is decided by its size."""
    for tracer in ("fx", "auto"):
        amp = ampfx.convert(ValueBranch(), torch.bfloat16, example_inputs=(torch.randn(8, 12),),
                            dynamic_dims={0: "batch"}, tracer=tracer, probe=False)
        (total,) = [r for r in amp.ampfx_report.records if r.op == "sum"]
        assert total.dtype == torch.bfloat16 and total.rule != "shape:size-unknown", tracer
        assert not any("batch" in s for r in amp.ampfx_report.records for s in r.shapes)


def test_the_observation_records_what_its_askers_expect():
    """The one run snapshots the inputs of the modules a job said it will ask about (and those below
    them), not every module; a later ask outside that scope runs once more (still before any change)."""
    from ampfx.tree import _Observed

    RUNS.clear()
    seen = _Observed(Root(), ExampleInputs.of((torch.randn(3, 4),)), torch.bfloat16)
    seen.expect(["block"])
    assert seen.get("block.a") is not None and seen.get("block") is not None
    assert seen.get("head.0") is None and RUNS == ["root", "block"]
    seen.expect([""])
    assert seen.get("head.0").args[0].shape == (3, 4) and RUNS == ["root", "block"] * 2


class FullyMasked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x, mask):
        scores = (self.q(x) @ x.transpose(-1, -2)).masked_fill(mask, float("-inf"))
        return torch.softmax(scores, -1)  # a fully masked row is NaN


def test_outputs_with_nan_or_on_meta_are_compared_where_they_can_be():
    """The reproduction check compares finite values and asks NaN/inf to sit in the same places (a fully
    masked attention row); a model on the meta device has no values, so its graph is checked by shapes
    and dtypes. Both used to make convert() fail (atol NaN; .item() on a meta tensor)."""
    x, mask = torch.randn(2, 3, 4), torch.zeros(2, 3, 3, dtype=torch.bool)
    mask[0, 1] = True
    got = ladder.capture(FullyMasked(), ampfx.Policy(), ExampleInputs.of((x, mask)), "auto")
    assert isinstance(got, Capture) and got.method == "fx" and "reproduces" in got.why
    amp = ampfx.convert(FullyMasked(), torch.bfloat16, example_inputs=(x, mask))
    assert torch.isnan(amp(x, mask)[0, 1]).all() and torch.isfinite(amp(x, mask)[1]).all()
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    amp = ampfx.convert(net, torch.bfloat16, example_inputs=(torch.randn(2, 4, device="meta"),))
    assert [r.method for r in amp.ampfx_report.parts] == ["fx"]
    assert amp.ampfx_report.by_node("linear").dtype == torch.bfloat16


def test_the_reproduction_check_still_sees_a_graph_that_computes_something_else():
    """NaN tolerance does not hide a wrong graph: NaN in other places, or different finite values, are reported."""
    from ampfx.capture.verify import _differs

    nan = float("nan")
    assert _differs(torch.tensor([1.0, nan]), torch.tensor([nan, 1.0]), 1e-4) is not None
    assert "max abs difference" in _differs(torch.tensor([1.0, nan]), torch.tensor([1.5, nan]), 1e-4)
    assert _differs(torch.tensor([1, 2]), torch.tensor([1, 3]), 1e-4) is not None

"""fp32_modules by name, glob, class and predicate (ampfx.policy.module_match), from code and AMPFX_FP32_MODULES."""
import json

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.report.records import Rule


class MyNorm(nn.LayerNorm):
    """A subclass: a class entry for nn.LayerNorm covers it."""


class Layer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.attn, self.norm, self.ff = nn.Linear(d, d), MyNorm(d), nn.Linear(d, d)

    def forward(self, x):
        return self.ff(self.norm(self.attn(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Layer(), Layer()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


X = torch.randn(4, 8)


def kept(amp):
    """module -> reason of each record fp32_modules decided."""
    return {r.module: r.reason for r in amp.ampfx_report.compute if r.rule == Rule.FP32_MODULES}


@pytest.mark.parametrize("entry, modules", [
    ("head", {"head"}),
    ("layers.*.attn", {"layers.0.attn", "layers.1.attn"}),
    ("layers.1.*", {"layers.1.attn", "layers.1.norm", "layers.1.ff"}),
    ("layers.**", {f"layers.{i}.{m}" for i in (0, 1) for m in ("attn", "norm", "ff")}),
    ("layers.?.ff", {"layers.0.ff", "layers.1.ff"}),
    (nn.LayerNorm, {"layers.0.norm", "layers.1.norm"}),
    ("LayerNorm", {"layers.0.norm", "layers.1.norm"}),
    ("torch.nn.LayerNorm", {"layers.0.norm", "layers.1.norm"}),
    (f"{__name__}.MyNorm", {"layers.0.norm", "layers.1.norm"}),
    (lambda m, fqn: fqn.endswith("ff"), {"layers.0.ff", "layers.1.ff"}),
])
def test_each_form_keeps_exactly_its_modules_float32(entry, modules):
    torch.manual_seed(0)
    net = Net()
    amp = ampfx.convert(net, "bf16", example_inputs=(X,), fp32_modules=(entry,))
    assert set(kept(amp)) == modules
    low = {r.module for r in amp.ampfx_report.low()}
    assert low and not low & modules
    out, want = amp(X), net(X)
    assert out.dtype == torch.float32 and (out - want).norm() / want.norm() < 0.05


def test_a_star_stays_within_one_segment():
    with pytest.raises(ampfx.PolicyError, match=r"'layers\.\*\.norm\.x' matches no module.*'\*\*' crosses dots"):
        ampfx.convert(Net(), "bf16", fp32_modules=("layers.*.norm.x",))


def test_the_reason_names_the_entry_that_matched_first():
    amp = ampfx.convert(Net(), "bf16", example_inputs=(X,), fp32_modules=("layers.*.norm", nn.LayerNorm, "head"))
    reasons = kept(amp)
    assert reasons["layers.0.norm"] == "inside module 'layers.0.norm', matched by 'layers.*.norm' in fp32_modules: kept float32"
    assert reasons["head"] == "inside module 'head', named in fp32_modules: kept float32"
    by_class = kept(ampfx.convert(Net(), "bf16", fp32_modules=(nn.LayerNorm,)))
    assert by_class["layers.1.norm"].endswith("an instance of torch.nn.LayerNorm named in fp32_modules: kept float32")


def test_the_environment_takes_names_globs_and_classes():
    env = {"AMPFX_FP32_MODULES": f"LayerNorm, head*, {__name__}.Layer"}
    amp = ampfx.convert(Net(), "bf16", example_inputs=(X,), environ=env)
    reasons = kept(amp)
    assert "an instance of torch.nn.LayerNorm" in reasons["layers.0.norm"]
    assert "matched by 'head*'" in reasons["head"]
    assert f"an instance of {__name__}.Layer" in reasons["layers.1.attn"]


def test_a_module_path_wins_over_a_class_of_the_same_name():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.LayerNorm = nn.Linear(8, 8)  # an attribute named like the class
            self.norm = nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.LayerNorm(x))

    reasons = kept(ampfx.convert(Odd(), "bf16", fp32_modules=("LayerNorm",)))
    assert set(reasons) == {"LayerNorm"}  # the submodule, not the nn.LayerNorm instance 'norm'
    assert set(kept(ampfx.convert(Odd(), "bf16", fp32_modules=(nn.LayerNorm,)))) == {"norm"}


def test_a_kept_module_computes_in_float32():
    torch.manual_seed(0)
    net = Net()
    amp = ampfx.convert(net, "bf16", example_inputs=(X,), fp32_modules=(lambda m, fqn: True,))
    assert not amp.ampfx_report.low()
    assert torch.allclose(amp(X), net(X), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bad, match", [
    ("LayerNrom", "neither a module of Net nor a module class.*Did you mean 'LayerNorm'"),
    ("layers.*.atn", "matches no module of Net.*Did you mean 'layers.1.attn'"),
    ("Conv2d", "no module of Net is an instance of it"),
    ("layers.[0", r"opens '\['"),
    (int, "not an nn.Module"),
    (3, "neither a module name"),
    ("", "empty name"),
    (lambda m, fqn: 1 / 0, "raised ZeroDivisionError.*on module 'layers'"),
    (lambda m, fqn: None, "returned None for module 'layers'"),
    (lambda m, fqn: False, "returned False for every module"),
])
def test_entries_that_keep_nothing_or_cannot_be_read_are_errors(bad, match):
    with pytest.raises(ampfx.PolicyError, match=match):
        ampfx.convert(Net(), "bf16", fp32_modules=(bad,))


def test_module_filter_fn_and_fp32_modules_each_keep_modules():
    amp = ampfx.convert(Net(), "bf16", fp32_modules=("head",), module_filter_fn=lambda m, fqn: fqn != "layers.0.ff")
    rules = {r.module: r.rule for r in amp.ampfx_report.compute}
    assert rules["head"] == Rule.FP32_MODULES and rules["layers.0.ff"] == Rule.MODULE_FILTER_FN
    assert rules["layers.1.ff"] == Rule.TABLE


def test_a_class_reaches_into_a_region_converted_on_its_own():
    class Branchy(nn.Module):  # data-dependent: runs eagerly, its children are converted one by one
        def __init__(self):
            super().__init__()
            self.inner = Layer()

        def forward(self, x):
            return self.inner(x) if x.sum() > 0 else -x

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.b, self.head = Branchy(), nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.b(x))

    x = torch.ones(4, 8)
    amp = ampfx.convert(Outer(), "bf16", example_inputs=(x,), fp32_modules=(Branchy,))
    reasons = kept(amp)
    assert {"b.inner.attn", "b.inner.ff"} <= set(reasons)
    assert "inside module 'b', an instance of" in reasons["b.inner.attn"]
    assert {r.module for r in amp.ampfx_report.low()} == {"head"}


def test_classes_and_predicates_are_logged_and_saved_by_name(tmp_path):
    amp = ampfx.convert(Net(), "bf16", fp32_modules=(nn.LayerNorm, "head", lambda m, fqn: fqn == "layers.0.ff"))
    logged = amp.ampfx_report.policy["fp32_modules"]
    assert logged[:2] == ["torch.nn.LayerNorm", "head"] and "lambda" in logged[2]
    json.dumps(amp.ampfx_report.policy)
    amp.ampfx_report.save(tmp_path / "report")
    path = ampfx.Policy(fp32_modules=(nn.LayerNorm, "head")).save(tmp_path / "p.json")
    back = ampfx.Policy.from_file(path)
    assert set(kept(ampfx.convert(Net(), policy=back))) == {"layers.0.norm", "layers.1.norm", "head"}
    with pytest.raises(ampfx.PolicyError, match="predicate or module_filter_fn is not saved"):
        ampfx.Policy(fp32_modules=(lambda m, fqn: True,)).save(tmp_path / "q.json")


class Aliased(nn.Module):
    """One module under two names, called by the second: the converted tree copies each name's module
    apart, so the graph records 'alias'."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.alias = self.fc
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.alias(x))


@pytest.mark.parametrize("entry", ["fc", "alias", "f?", "fc.0", nn.Sequential, lambda m, fqn: fqn == "fc"])
def test_a_module_with_two_names_is_kept_whichever_name_matched(entry):
    """Every form keeps the module under all its names (by its first name 'fc' it was silently left bfloat16)."""
    amp = ampfx.convert(Aliased(), "bf16", example_inputs=(X,), fp32_modules=(entry,))
    rec = next(r for r in amp.ampfx_report.compute if r.op == "linear" and r.module.startswith("alias"))
    assert (rec.dtype, rec.rule) == (torch.float32, Rule.FP32_MODULES)
    assert "out" in {r.module for r in amp.ampfx_report.low()}


def test_a_leaf_module_named_by_its_first_name_is_a_leaf_under_its_second():
    amp = ampfx.convert(Aliased(), "bf16", example_inputs=(X,), leaf_modules=("fc",))
    assert [r.kind for r in amp.ampfx_report.compute if r.module == "alias"] == ["call_module"]


def test_module_filter_fn_reaches_into_a_region_converted_on_its_own():
    """A filter rejecting a module that runs eagerly keeps its children float32, though they are converted
    as graphs of their own below it (they were converted to bfloat16, with no record naming the filter)."""
    amp = ampfx.convert(_outer(), "bf16", example_inputs=(torch.ones(4, 8),), module_filter_fn=lambda m, fqn: fqn != "b")
    rules = {r.module: (r.rule, r.reason) for r in amp.ampfx_report.compute}
    assert rules["b.inner.attn"] == (Rule.MODULE_FILTER_FN, "module_filter_fn rejected module 'b': kept float32")
    assert {r.module for r in amp.ampfx_report.low()} == {"head"}


def test_a_filter_that_raises_is_named_with_the_module():
    def picky(m, fqn):
        return {"": True, "head": True}[fqn]  # KeyError on 'layers'

    with pytest.raises(ampfx.PolicyError, match=r"module_filter_fn .*picky raised KeyError.*on module 'layers'"):
        ampfx.convert(Net(), "bf16", module_filter_fn=picky)


def test_the_model_class_itself_is_named_as_the_whole_model():
    with pytest.raises(ampfx.PolicyError, match="only Net itself \\(the whole model\\) is an instance"):
        ampfx.convert(Net(), "bf16", fp32_modules=(Net,))


def _outer() -> nn.Module:
    class Branchy(nn.Module):  # data-dependent: runs eagerly, its children are converted one by one
        def __init__(self):
            super().__init__()
            self.inner = Layer()

        def forward(self, x):
            return self.inner(x) if x.sum() > 0 else -x

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.b, self.head = Branchy(), nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.b(x))

    return Outer()


def test_a_policy_not_resolved_against_a_model_refuses_what_only_a_model_resolves():
    """Called without convert() (pass-level use), a class, glob or predicate was silently ignored."""
    from ampfx.policy.decide import decide_module
    net = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert decide_module(ampfx.Policy(fp32_modules=("1",)), net, "1")[0] == Rule.FP32_MODULES
    for entry in (nn.LayerNorm, "1*", lambda m, fqn: True):
        with pytest.raises(ampfx.PolicyError, match="resolved against the model by ampfx.convert"):
            decide_module(ampfx.Policy(fp32_modules=(entry,)), net, "1")

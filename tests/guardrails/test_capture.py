"""Issue #17, cases 1, 2 and 15: a capture is checked for what it means, not only for what it returns.

Each construct a ``torch.fx`` graph drops (buffer updates, grad-mode and autocast regions, a custom
``autograd.Function``, Python attribute updates) is seen while tracing, with or without example
inputs, and the module goes down the ladder (export) or keeps its Python; the user's float32
requests stay float32 with rule ``user-float32``. The original model is never changed.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import ampfx
from ampfx.capture import verify
from ampfx.capture.semantics import Watch
from ampfx.inputs import ExampleInputs


class Scaled(torch.autograd.Function):
    """Forward doubles; its own backward is deliberately not the derivative (x100)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 100


class Fp32Fn(torch.autograd.Function):
    """A custom op that asks for float32 inputs under autocast."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x):
        return x * 3

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        return g * 3


class Net(nn.Module):
    """Two linears around one construct chosen by ``kind``; ``count`` / ``avg`` buffers, ``calls`` int."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.calls = kind, 0
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.zeros(4))

    def forward(self, x):
        k = self.kind
        if k == "count":
            self.count += 1
        elif k == "ema":
            self.avg.mul_(0.9).add_(x.mean(0).detach())
        elif k == "rebind":
            self.count = self.count + 1
        elif k == "calls":
            self.calls += 1
        if k == "no_grad":
            with torch.no_grad():
                h = self.a(x)
        elif k == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                h = self.a(x)
        elif k == "inference_mode":
            with torch.inference_mode():
                h = self.a(x)
            h = h.clone()
        elif k == "enable_grad":
            with torch.enable_grad():
                h = self.a(x)
        elif k == "autocast_on":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.a(x).float()
        elif k == "autocast_off":
            with torch.autocast("cpu", enabled=False):
                h = self.a(x.float())
        elif k == "function":
            h = Scaled.apply(self.a(x))
        elif k == "custom_fwd":
            h = Fp32Fn.apply(self.a(x))
        else:
            h = self.a(x)
        return self.b(h)


class OffForward(nn.Module):
    """A submodule whose whole forward is decorated ``@torch.autocast(..., enabled=False)``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @torch.autocast("cpu", enabled=False)
    def forward(self, x):
        return self.lin(x)


class Outer(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.head = inner, nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.inner(x))


def state(m):
    return {k: v.clone() for k, v in m.state_dict().items()}, getattr(m, "calls", None)


def convert(m, x, tracer="auto", examples=True):
    before = state(m)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,) if examples else None, tracer=tracer)
    after = state(m)
    assert before[1] == after[1] and all(torch.equal(before[0][k], after[0][k]) for k in before[0]), \
        "convert() changed the model it was given"
    return amp


def steps(amp):
    return " | ".join(" ".join(r.steps) + " " + r.why for r in amp.ampfx_report.parts)


GRAD_KINDS = ["no_grad", "set_grad_enabled", "inference_mode"]
BUFFER_KINDS = ["count", "ema", "rebind"]


# ------------------------------------------------------------------ case 1: buffer updates
@pytest.mark.parametrize("kind", BUFFER_KINDS)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_buffer_updates_are_kept_with_example_inputs(kind, mode):
    """A forward that updates a buffer (``+=``, ``mul_().add_()``, reassignment) is not accepted as an fx
    graph; the converted module updates the model's buffers as eager does, call after call."""
    torch.manual_seed(0)
    m, x = Net(kind), torch.randn(3, 4)
    m.train(mode == "train")
    ref = copy.deepcopy(m)
    amp = convert(m, x)
    why = steps(amp)
    assert "torch.fx would drop" in why and ("changed in place" in why or "reassigned" in why), why
    for _ in range(3):
        amp(x), ref(x)
    assert int(m.count) == int(ref.count) and torch.allclose(m.avg, ref.avg, atol=1e-6)
    assert int(m.count) == (3 if kind in ("count", "rebind") else 0)


@pytest.mark.parametrize("kind", ["count", "ema"])
@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_buffer_updates_without_example_inputs_keep_the_python(kind, tracer):
    """Without example inputs nothing can run: the update is seen while tracing, the root keeps its
    Python (its linears are still converted) and the buffers follow eager."""
    m, x = Net(kind), torch.randn(3, 4)
    ref = copy.deepcopy(m)
    amp = convert(m, x, tracer=tracer, examples=False)
    assert amp.ampfx_report.parts[-1].method.startswith("eager")
    assert "buffer" in steps(amp) and "changed in place" in steps(amp)
    assert any(r.dtype == torch.bfloat16 for r in amp.ampfx_report.compute)  # the children were converted
    for _ in range(2):
        amp(x), ref(x)
    assert int(m.count) == int(ref.count) and torch.allclose(m.avg, ref.avg, atol=1e-6)


def test_buffer_update_in_a_submodule_makes_it_a_leaf():
    """Only the submodule that updates its buffer keeps its Python; the rest is one fx graph."""
    m, x = Outer(Net("count")), torch.randn(3, 4)
    amp = convert(m, x, tracer="fx", examples=False)
    assert "module 'inner' made a leaf" in steps(amp)
    amp(x), amp(x)
    assert int(m.inner.count) == 2


def test_python_attribute_counter_keeps_the_python():
    """``self.calls += 1`` (a Python int) is neither in an fx nor in an exported graph: eager keeps it,
    conversion leaves the attribute as it was, and each call counts on the model's own module."""
    m, x = Net("calls"), torch.randn(3, 4)
    amp = convert(m, x)
    assert "attribute 'calls' changed" in steps(amp)
    assert amp.ampfx_report.parts[-1].method.startswith("eager")
    assert m.calls == 0
    amp(x), amp(x)
    assert amp.calls == m.calls == 2


# ------------------------------------------------------------------ case 2: grad-mode regions
@pytest.mark.parametrize("kind", GRAD_KINDS)
@pytest.mark.parametrize("examples", [True, False])
def test_no_grad_region_trains_nothing(kind, examples):
    """Parameters used only inside ``no_grad`` / ``set_grad_enabled(False)`` / ``inference_mode`` get no
    gradient from the converted module, as in eager; the region is named in the steps."""
    torch.manual_seed(0)
    m, x = Net(kind).train(), torch.randn(3, 4)
    amp = convert(m, x, examples=examples)
    assert f"torch.{kind}" in steps(amp)
    amp(x).sum().backward()
    assert m.a.weight.grad is None and m.a.bias.grad is None
    assert m.b.weight.grad is not None


@pytest.mark.parametrize("kind", ["enable_grad", "autocast_on"])
def test_enable_grad_and_autocast_regions_are_not_dropped(kind):
    """``enable_grad`` and an enabled ``autocast`` region are seen by fx tracing; export keeps them
    (with example inputs), and the converted module computes what eager does."""
    torch.manual_seed(0)
    m, x = Net(kind), torch.randn(3, 4)
    ref = copy.deepcopy(m)
    amp = convert(m, x)
    assert "torch.fx would drop" in steps(amp)
    assert amp.ampfx_report.parts[-1].method == "export"
    with torch.no_grad():
        out, want = amp(x), ref(x)
    assert (out.float() - want).abs().max() < 0.05
    if kind == "enable_grad":  # under the caller's no_grad the region still records a graph
        assert out.requires_grad == want.requires_grad


# ------------------------------------------------------------------ case 15: custom Functions, float32 requests
@pytest.mark.parametrize("examples", [True, False])
def test_custom_backward_is_kept(examples):
    """fx (and export) trace through an ``autograd.Function``'s forward and lose its backward: the
    module keeps its Python, and the gradient is the Function's own (x100), not the derivative."""
    torch.manual_seed(0)
    m, x = Net("function"), torch.randn(3, 4)
    ref = copy.deepcopy(m)
    amp = convert(m, x, examples=examples)
    assert "torch.autograd.Function Scaled" in steps(amp)
    amp(x).sum().backward()
    ref(x).sum().backward()
    assert torch.allclose(m.a.weight.grad, ref.a.weight.grad, rtol=0.05, atol=1e-2)


def test_custom_fwd_cast_inputs_float32_runs_float32():
    """``@custom_fwd(cast_inputs=torch.float32)``: the Function runs on float32 inputs in the converted module."""
    seen = []
    m, x = Net("custom_fwd"), torch.randn(3, 4)
    amp = convert(m, x)
    original = Fp32Fn.forward

    def spy(ctx, t):
        seen.append(t.dtype)
        return original(ctx, t)

    Fp32Fn.forward = staticmethod(spy)
    try:
        amp(x)
    finally:
        Fp32Fn.forward = original
    assert seen == [torch.float32]


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
def test_autocast_disabled_region_stays_float32_with_its_rule(tracer):
    """``with torch.autocast('cpu', enabled=False)``: the ops inside stay float32 with rule
    ``user-float32`` and a reason naming the region; the ops outside still convert."""
    m, x = Net("autocast_off"), torch.randn(3, 4)
    amp = convert(m, x, tracer=tracer)
    rows = [r for r in amp.ampfx_report.compute if r.rule == "user-float32"]
    assert rows and all(r.dtype == torch.float32 for r in rows)
    assert "enabled=False" in rows[0].reason
    assert any(r.dtype == torch.bfloat16 for r in amp.ampfx_report.compute)


def test_autocast_disabled_forward_decorator_without_example_inputs():
    """``@torch.autocast(..., enabled=False)`` on a forward: its linear stays float32, the head converts."""
    m, x = Outer(OffForward()), torch.randn(3, 4)
    amp = convert(m, x, examples=False)
    by_module = {r.module: r for r in amp.ampfx_report.compute if r.op == "linear"}
    assert by_module["inner.lin"].dtype == torch.float32 and by_module["inner.lin"].rule == "user-float32"
    assert by_module["head"].dtype == torch.bfloat16
    assert amp(x).dtype == torch.float32


# ------------------------------------------------------------------ the checks themselves
def test_verification_catches_a_graph_that_trains_a_no_grad_parameter():
    """``reproduces`` compares which parameters get a gradient: plain fx's graph of a no_grad region fails it."""
    m = Net("no_grad").train()
    graph = fx.symbolic_trace(m).graph
    why = verify.reproduces(m, graph, ExampleInputs.of((torch.randn(3, 4),)))
    assert why is not None and "'a.weight'" in why and "gradient" in why
    assert all(p.grad is None for p in m.parameters())


def test_verification_catches_a_lost_buffer_update():
    """``reproduces`` compares buffers after the call, and leaves them as found."""
    m = Net("count")
    graph = fx.symbolic_trace(m).graph
    m.count.zero_()  # symbolic_trace ran the += once
    why = verify.reproduces(m, graph, ExampleInputs.of((torch.randn(3, 4),)))
    assert why is not None and "'count'" in why
    assert int(m.count) == 0


def test_verification_accepts_a_faithful_graph():
    m = Net("plain")
    assert verify.reproduces(m, fx.symbolic_trace(m).graph, ExampleInputs.of((torch.randn(3, 4),))) is None


def test_watch_undoes_its_patches_and_the_module_state():
    """Outside a capture, ``no_grad`` and ``Function.apply`` are torch's own, and attributes set while
    tracing are put back."""
    enter, apply = torch.no_grad.__enter__, torch.autograd.Function.__dict__["apply"]
    m = Net("calls")
    with Watch(m) as w:
        fx.symbolic_trace(m)
    assert torch.no_grad.__enter__ is enter and torch.autograd.Function.__dict__["apply"] is apply
    assert m.calls == 0 and "attribute 'calls' changed" in w.dropped[""]


def test_watch_that_fails_to_start_undoes_the_patches_it_made(monkeypatch):
    """If wrapping ``Function.apply`` fails (a torch that defines it otherwise), the context managers
    wrapped before it are torch's own again at once, not when the Watch is garbage-collected."""
    from ampfx.capture import semantics

    enter = torch.no_grad.__enter__

    def fails():
        raise RuntimeError("no apply here")

    monkeypatch.setattr(semantics, "_wrapped_apply", fails)
    with pytest.raises(RuntimeError, match="no apply here") as caught:
        with Watch(nn.Linear(2, 2)):
            pass
    assert caught.value.__traceback__ is not None  # the failed Watch is still reachable from here
    assert torch.no_grad.__enter__ is enter and not semantics._ACTIVE


def test_plain_model_is_still_one_fx_graph():
    """A model with none of these constructs is captured by fx, and the report says what was checked."""
    amp = convert(Net("plain"), torch.randn(3, 4))
    region = amp.ampfx_report.parts[0]
    assert region.method == "fx" and "gradients and buffer updates" in region.why


class TrainCounter(nn.Module):
    """Counts training calls only: the eval graph is clean, the train graph would drop the update."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.count += 1
        return self.lin(x)


def test_other_mode_that_drops_an_update_is_not_silent():
    """Converted in eval mode, switched to train: the train graph would lose ``count += 1``, so the
    module either keeps the update or raises saying to convert in train mode: never a silent loss."""
    m, x = TrainCounter().eval(), torch.randn(3, 4)
    amp = convert(m, x)
    amp.train()
    try:
        amp(x)
    except RuntimeError as e:
        assert "train" in str(e) and "drop" in str(e)
    else:
        assert int(m.count) == 1



class Checkpointed(nn.Module):
    """Reentrant checkpointing: a Function torch defines, whose forward runs without gradients and
    whose backward recomputes it. A graph of its forward's ops would give ``a`` no gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=True))


@pytest.mark.parametrize("tracer", ["auto", "export"])
def test_reentrant_checkpointing_keeps_its_gradients(tracer):
    """Only Functions whose backward is their forward's derivative (``ModIndex``) are traced
    through; reentrant checkpointing keeps its module's Python, and ``a`` gets its gradient."""
    torch.manual_seed(0)
    m, x = Checkpointed(), torch.randn(3, 4, requires_grad=True)
    ref = copy.deepcopy(m)
    amp = convert(m, x, tracer=tracer)
    assert "CheckpointFunction" in steps(amp)
    amp(x).sum().backward()
    ref(x).sum().backward()
    assert torch.allclose(m.a.weight.grad, ref.a.weight.grad, rtol=0.05, atol=2e-2)


def test_a_function_whose_backward_is_its_derivative_is_traced_through():
    """``ModIndex`` (``torch.vmap``'s indexing in HF attention masks): the module is still one graph."""
    from torch._dynamo._trace_wrapped_higher_order_op import mod_index

    class Indexed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return mod_index(self.a(x), [torch.tensor([0, 2])])

    torch.manual_seed(0)
    m, x = Indexed(), torch.randn(3, 4)
    amp = convert(m, x, tracer="export")
    assert [r.method for r in amp.ampfx_report.parts] == ["export"]
    assert torch.allclose(amp(x), m(x), rtol=0.05, atol=2e-2)


class _BiasCache(nn.Module):
    """timm's attention-bias cache: in eval mode the first call stores a tensor made from a parameter
    in a dict, later calls read it; ``train()`` empties it (the parameter may change while training)."""

    def __init__(self, d=16):
        super().__init__()
        self.lin, self.bias = nn.Linear(d, d), nn.Parameter(torch.randn(d))
        self.cache = {}

    def train(self, mode=True):
        super().train(mode)
        if mode:
            self.cache = {}
        return self

    def forward(self, x):
        if self.training:
            return self.lin(x) + self.bias * 2
        if "b" not in self.cache:
            self.cache["b"] = self.bias * 2
        return self.lin(x) + self.cache["b"]


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_a_cache_filled_in_place_while_tracing_keeps_the_python(tracer):
    """Tracing filled the dict with a Proxy, which stayed there: the conversion's own check of the
    graph then ran the model on it and failed, and a graph would read the first call's tensor for
    good. The module keeps its Python (a leaf), the cache holds real tensors, and after training
    changes the parameter the converted module in eval mode follows the model."""
    torch.manual_seed(0)
    m, x = nn.Sequential(_BiasCache(), nn.ReLU(), _BiasCache()).eval(), torch.randn(2, 16)
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(x,), tracer=tracer)
    steps = " ".join(s for r in amp.ampfx_report.parts for s in r.steps)
    assert "attribute 'cache' changed in place" in steps
    assert (amp(x).float() - m(x)).abs().max() < 0.05 * m(x).abs().max()
    assert all(type(v) is torch.Tensor for mod in amp.modules() for v in getattr(mod, "cache", {}).values())
    amp.train(), m.train()
    with torch.no_grad():
        m[0].bias.mul_(-1)
    amp.eval(), m.eval()
    assert (amp(x).float() - m(x)).abs().max() < 0.05 * m(x).abs().max()


class _FirstCallCache(nn.Module):
    """Keeps what its first call saw: a dict filled in place (``dict``) or an attribute set once (``tensor``)."""

    def __init__(self, kind):
        super().__init__()
        self.lin, self.kind = nn.Linear(4, 4), kind
        self.cache = {} if kind == "dict" else None

    def forward(self, x):
        if self.kind == "dict":
            if "k" not in self.cache:
                self.cache["k"] = x.detach().mean(0)
            return self.lin(x) + self.cache["k"]
        if self.cache is None:
            self.cache = x.detach().mean(0)
        return self.lin(x) + self.cache


class _LoopRoot(nn.Module):
    """torch.fx cannot trace the root (a loop over a size): its children are captured on their own."""

    def __init__(self, kind):
        super().__init__()
        self.pre, self.c = nn.Linear(4, 4), _FirstCallCache(kind)

    def forward(self, x):
        y = self.c(self.pre(x))
        for _ in range(x.shape[0]):
            y = y + 0.0
        return y


@pytest.mark.parametrize("tracer", ["auto", "export"])
@pytest.mark.parametrize("kind", ["dict", "tensor"])
def test_a_cache_a_conversion_run_filled_is_not_taken_for_a_constant(kind, tracer):
    """The conversion's own runs (observing the regions' inputs, checking a capture) filled the cache
    with the example's values, and the capture after them read it as a constant: every later call
    added the example's mean (error ~5). The runs put the model's attributes back, and a forward that
    fills the cache keeps its Python, as in eager."""
    torch.manual_seed(0)
    m, ref = _LoopRoot(kind), None
    ref = copy.deepcopy(m)
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(torch.randn(2, 4),), tracer=tracer)
    x = torch.randn(2, 4) * 5
    assert (amp(x).float() - ref(x)).abs().max() < 0.1
    x2 = torch.randn(2, 4)
    assert (amp(x2).float() - ref(x2)).abs().max() < 0.1


@pytest.mark.parametrize("tracer", ["auto", "fx", "export"])
def test_a_pruned_module_converted_alone_follows_its_weight(tracer):
    """A pruned ``nn.Linear`` as the whole model: its pruning pre-hook sets ``weight`` on every call. The
    graph module kept a copy of the conversion-time ``weight`` that shadowed the one the hook sets, so
    a changed ``weight_orig`` was never seen (fx); with a pre-hook registered after the pruning one,
    export is not tried (its graph computes the weight, which would reverse the hooks' order)."""
    from torch.nn.utils import prune
    torch.manual_seed(0)
    m, x = nn.Linear(4, 4), torch.randn(3, 4)
    prune.l1_unstructured(m, "weight", 0.5)
    m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    amp = ampfx.convert(m, torch.bfloat16, example_inputs=(x,), tracer=tracer)
    with torch.no_grad():
        m.weight_orig.mul_(3)
    assert (amp(x).float() - m(x)).abs().max() < 0.05 * m(x).abs().max()

"""Python work per call of a converted module, counted (never timed): what ampfx runs around the kernels is a
budget. A model captured whole runs no per-op interception; a module that keeps its Python runs ampfx's code per
converted child it calls, never per op of its own Python; a low-precision leaf swaps its parameters for low copies
without torch.func's machinery."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx import runtime

AMPFX = str(Path(ampfx.__file__).resolve().parent)
PASSES = str(Path(ampfx.passes.__file__).resolve().parent)


PER_NODE = {"cast", "cast_pad", "call_module_low", "call_module_float32", "__getattr__", "read_and_call"}
"""ampfx's Python the graph's own code calls per node: a cast, a leaf's call, a read of a child module (a nested
one: its reader, and for a call the reader's caller)."""


class Calls:
    """Counts the Python functions of ampfx (those the graph's code calls per node apart: :data:`PER_NODE`) and of
    torch.func, and ``__torch_function__`` calls, that run while it is on."""

    def __init__(self) -> None:
        self.ampfx = 0
        self.per_node = 0
        self.func = 0
        self.modes = 0

    def _profile(self, frame, event, arg):  # noqa: ANN001
        if event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith("<ampfx read"):  # a nested read of the graph's code (ampfx.runtime.lowered)
            self.per_node += 1
        elif path.startswith((AMPFX, PASSES)):
            if frame.f_code.co_name in PER_NODE:
                self.per_node += 1
            else:
                self.ampfx += 1
        elif "torch/_functorch" in path or "torch/nn/utils/stateless" in path:
            self.func += 1
        if frame.f_code.co_name == "__torch_function__":
            self.modes += 1

    def __enter__(self) -> "Calls":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


class MLP(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


def step(module: nn.Module, x: torch.Tensor) -> None:
    module(x).float().square().mean().backward()


def test_a_model_captured_whole_runs_no_per_op_python():
    """Rule: captured whole (one graph), a training step runs no __torch_function__ of ampfx's, and ampfx's Python
    around the graph (its checks) is the same at any depth; inside it, one helper call per cast node, per float32
    leaf and per read of a child module, none per other op."""
    torch.manual_seed(0)
    counts = []
    for depth in (2, 8):
        model = nn.Sequential(*(MLP() for _ in range(depth)))
        x = torch.randn(4, 16)
        amp = ampfx.convert(model, "bf16", example_inputs=(x,), keep_modules="none")
        assert [p.method for p in amp.ampfx_report.parts] == ["fx"]
        step(amp, x)
        nodes = [n for n in amp.graph.nodes if n.target in (runtime.cast, runtime.call_module_float32)]
        reads = [n for n in amp.graph.nodes if n.op == "get_attr"]  # one read of its owner module each
        with Calls() as c:
            step(amp, x)
        assert c.modes == 0 and c.func == 0
        assert c.per_node == len(nodes) + len(reads), (c.per_node, len(nodes), len(reads))
        counts.append(c.ampfx)
    assert counts[0] == counts[1] <= 10, counts


class Gate(nn.Module):
    """Keeps its Python (a branch on a value); its children are converted one by one. ``extra`` ops of its own
    Python run between them."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.a, self.b = MLP(), MLP()
        self.extra = extra

    def forward(self, x):
        h = self.a(x)
        for _ in range(self.extra):
            h = h * 1.0
        if h.abs().amax() > 1e6:
            h = h / 2
        return self.b(h)


def test_an_eager_parent_costs_ampfx_python_per_child_not_per_op():
    """Rule: a module that keeps its Python runs ampfx's code for each converted child it calls (their checks and
    casts), never for each op of its own Python: 10 or 200 extra ops cost the same ampfx calls."""
    torch.manual_seed(0)
    counts = []
    for extra in (10, 200):
        model, x = Gate(extra), torch.randn(4, 16)
        amp = ampfx.convert(model, "bf16", example_inputs=(x,))
        assert any(p.method.startswith("eager") for p in amp.ampfx_report.parts)
        step(amp, x)
        with Calls() as c:
            step(amp, x)
        assert c.modes == 0
        counts.append(c.ampfx)
    assert counts[0] == counts[1], counts


class Mover(nn.Module):
    """Keeps its Python (a branch on a value) and only moves its children's outputs between them."""

    def __init__(self, moves: int) -> None:
        super().__init__()
        self.a, self.b = MLP(), MLP()
        self.moves = moves

    def forward(self, x):
        h = self.a(x)
        for _ in range(self.moves):
            h = h.transpose(0, 1).contiguous().transpose(0, 1)
        if x.abs().amax() > 1e6:
            x = x / 2
        return self.b(h)


def test_hand_low_intercepts_the_parents_ops_and_is_off_by_default():
    """Rule: handing (hand_low=True) intercepts every op of the parent's Python (a TorchFunctionMode), so its
    cost grows with that Python: that is why it is off by default, where the same parent costs no interception."""
    torch.manual_seed(0)
    model, x = Mover(10), torch.randn(4, 16)
    for hand_low, intercepted in ((True, True), (False, False)):
        amp = ampfx.convert(model, "bf16", example_inputs=(x,), hand_low=hand_low)
        step(amp, x)
        with Calls() as c:
            step(amp, x)
        assert (c.modes >= 30) is intercepted, c.modes


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_a_low_leaf_swaps_in_low_copies_and_puts_the_masters_back():
    """Rule: call_module_low runs the module itself with low copies in its parameter dicts (tied parameters cast
    once, no torch.func machinery), its hooks fire, gradients reach the float32 masters, and the masters are back
    after the call, also when it raises."""
    torch.manual_seed(0)
    m = Tied()
    masters = {n: p for n, p in m.named_parameters(remove_duplicate=False)}
    seen = []
    m.a.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with Calls() as c:
        out = runtime.call_module_low(m, torch.bfloat16, x)
    assert c.func == 0 and out.dtype == torch.bfloat16 and seen == [torch.bfloat16]
    assert ampfx.count_casts(lambda: runtime.call_module_low(m, torch.bfloat16, x)) == 3  # a.weight once, 2 biases
    out.float().sum().backward()
    assert {n: p for n, p in m.named_parameters(remove_duplicate=False)} == masters
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 and p.grad is not None for p in m.parameters())
    with pytest.raises(RuntimeError):
        runtime.call_module_low(m, torch.bfloat16, torch.randn(2, 5, dtype=torch.bfloat16))
    assert {n: p for n, p in m.named_parameters(remove_duplicate=False)} == masters


def test_a_converted_graph_module_holds_one_runtime_attribute():
    """Besides the view of its model module (the module it stands for, the hook dicts it shares), a converted graph
    module holds one runtime state, and so do its deep copy and a pickled copy."""
    import copy
    import io

    from ampfx.runtime.entries import Runtime

    view = {"_ampfx_model", "_ampfx_shared_hooks"}
    amp = ampfx.convert(MLP(), "bf16", example_inputs=(torch.randn(2, 16),))
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    for m in (amp, copy.deepcopy(amp), torch.load(buf, weights_only=False)):
        own = {k for k in m.__dict__ if k.startswith("_ampfx") and not k.startswith(runtime_made())}
        assert own - view == {"_ampfx_runtime"}, own
        assert isinstance(m.__dict__["_ampfx_runtime"], Runtime)


def runtime_made() -> tuple[str, ...]:
    """Attribute names a capture gives the constants it made (a graph's own tensors, not runtime state)."""
    from ampfx.runtime.graph_module import MADE
    return tuple(p for p in MADE if p != "_ampfx") + ("_ampfx_const", "_ampfx_low", "_ampfx_lifted")


def test_a_call_runs_the_declared_steps_in_their_order():
    """The steps a call runs are those of entries.CALL_STEPS, in that order: each one's object, stubbed here to
    note its turn, is asked once per call."""
    import contextlib

    from ampfx.runtime.arming import arm
    from ampfx.runtime.entries import CALL_STEPS

    amp = ampfx.convert(MLP(), "bf16", example_inputs=(torch.randn(2, 16),))
    turns = []

    class Stub:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, *args) -> None:  # check(gm), guard(args, kwargs)
            turns.append(self.name)

        def run(self, fn, args, kwargs):  # linked
            turns.append(self.name)
            return fn(args, kwargs)

        def holds(self) -> bool:  # fixed
            turns.append(self.name)
            return True

        def refresh(self, gm) -> None:  # low
            turns.append(self.name)

        @contextlib.contextmanager
        def used(self, gm):  # weights
            turns.append(self.name)
            yield

    arm(amp, **{step.field: Stub(step.field) for step in CALL_STEPS})
    amp(torch.randn(2, 16))
    assert turns == [step.field for step in CALL_STEPS]
    arm(amp, **{step.field: None for step in CALL_STEPS})
    assert not amp._rt.dispatched()


def test_a_module_pickled_with_runtime_keys_of_its_own_loads_them_as_its_runtime():
    """Converted modules pickled before the runtime state was one attribute held it as ``_ampfx_<field>`` keys:
    loading gathers them into the one runtime (where they would be ignored, a loaded copy ran its training graph in
    evaluation mode)."""
    from ampfx.runtime.entries import Runtime

    body = {"_ampfx_alt": (False, "other"), "_ampfx_where": "blocks.0", "_ampfx_rebind": ("b", None),
            "_ampfx_stale": None, "training": True}
    rt = Runtime.from_keys(body)
    assert (rt.alt, rt.where, rt.rebind) == ((False, "other"), "blocks.0", ("b", None))
    assert body == {"training": True} and Runtime.from_keys({"training": True}) is None
    assert rt.dispatched()


def test_an_exported_graph_calls_its_ops_through_their_handles_and_compile_reads_the_plain_code():
    """Rule: an exported graph's ops run through their C++ handles (``OpOverload.__call__``, a Python frame per op,
    never runs); the graph's nodes, its ``code`` and its outputs are those of fx's code; ``torch.compile`` traces
    fx's code (no graph break)."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 16)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,), tracer="export")
    ops = [n for n in amp.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    assert ops and "torch.ops.aten" in amp.code
    forward = type(amp).__dict__.get("_ampfx_graph_forward", type(amp).forward)
    plain = forward._ampfx_plain
    assert plain is forward.__wrapped__

    overload_calls = []

    def profile(frame, event, arg):  # noqa: ANN001
        if event == "call" and frame.f_code is torch._ops.OpOverload.__call__.__code__:
            overload_calls.append(frame.f_code.co_name)

    def overloads_called(fn):  # noqa: ANN001
        overload_calls.clear()
        sys.setprofile(profile)
        try:
            with torch.no_grad():
                out = fn(x)
        finally:
            sys.setprofile(None)
        return len(overload_calls), out

    seen, expected = overloads_called(lambda x: plain(amp, x))
    assert seen >= len(ops)  # the check sees fx's calls
    seen, got = overloads_called(amp)
    assert seen == 0
    assert torch.equal(got, expected)
    step(amp, x)  # and trains: gradients through the handles
    assert all(p.grad is not None for p in model.parameters())

    explained = torch._dynamo.explain(amp)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_binding_ops_to_handles_keeps_each_op_apart_and_leaves_the_graph_and_its_code_as_they_were():
    """Rule: ops whose names would join to the same word run as themselves (fx's code generation names each
    one's global); a string argument naming an op call is a string; the graph's nodes and ``code`` still name the
    ops."""
    import torch.fx as fx

    from ampfx.runtime import lowered

    lib_a, lib_b = torch.library.Library("ampfxlw_b", "DEF"), torch.library.Library("ampfxlw", "DEF")
    lib_a.define("c(Tensor x) -> Tensor")
    lib_a.impl("c", lambda x: x + 1, "CompositeExplicitAutograd")
    lib_b.define("b_c(Tensor x) -> Tensor")
    lib_b.impl("b_c", lambda x: x * 100, "CompositeExplicitAutograd")
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.ampfxlw_b.c.default, (x,))
    b = g.call_function(torch.ops.ampfxlw.b_c.default, (x,))
    text = g.call_function(str, ("torch.ops.aten.relu.default(x)",))
    g.output((g.call_function(torch.ops.ampfxlw_b.c.default, (a,)), b, text))
    gm = fx.GraphModule(torch.nn.Module(), g)
    code, targets = gm.code, [n.target for n in g.nodes]
    fast = lowered.forward(gm)
    a, b, said = fast(gm, torch.ones(1))
    assert (a.item(), b.item(), said) == (3.0, 100.0, "torch.ops.aten.relu.default(x)")
    assert "torch.ops" not in fast.__ampfx_source__.replace("'torch.ops.aten.relu.default(x)'", "")
    assert gm.code == code and [n.target for n in g.nodes] == targets
    assert lowered.forward(fx.symbolic_trace(torch.nn.ReLU())) is None  # no op overload: nothing to bind


def test_binding_ops_to_handles_never_writes_the_graph(monkeypatch):
    """Rule: the code with ops bound to their handles is generated from a copy of the graph: no node of the graph
    is written meanwhile (another thread may be pickling or copying it)."""
    import torch.fx as fx

    from ampfx.runtime import lowered

    amp = ampfx.convert(MLP(), "bf16", example_inputs=(torch.randn(4, 16),), tracer="export", gemm_min_flops=0)
    mine = set(amp.graph.nodes)
    written = []
    setattr_ = fx.Node.__setattr__

    def watch(node, name, value):  # noqa: ANN001
        if node in mine and name == "target":
            written.append(node.name)
        setattr_(node, name, value)

    monkeypatch.setattr(fx.Node, "__setattr__", watch)
    fast = lowered.forward(amp)
    assert fast is not None and "ampfx_op_aten_" in fast.__ampfx_source__
    assert written == []


class _Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))
        self.head = nn.Linear(4, 2)
        self.register_buffer("shift", torch.ones(2))

    def forward(self, x):
        return self.head(self.body(x)) + self.shift


def test_a_graph_reads_nested_parameters_through_the_module_dicts_and_every_change_shows_as_through_getattr():
    """Rule: the generated code reads each nested parameter, buffer and module of its graph through the module
    dicts (``_modules`` at each level, then the dict that holds it), what ``getattr`` reaches there, without a
    failed attribute lookup a level; the reads are made at every call, so whatever replaces a parameter, a buffer
    or a module shows through as it did; a name the dicts no longer hold (a parameter deleted and set as a plain
    attribute, as ``weight_norm`` does) is read by ``getattr``. The graph's own code still reads by ``getattr``."""
    from ampfx.runtime import lowered

    def close(a, b):  # bfloat16's rounding apart; a parameter not seen moves the outputs by far more
        return torch.allclose(a.float(), b, atol=3e-2, rtol=3e-2)

    net = _Nested()
    amp = ampfx.convert(net, example_inputs=(torch.ones(2, 4),))
    x = torch.randn(3, 4)
    fast = lowered.forward(amp)
    assert fast is not None and "ampfx_op_read_" in fast.__ampfx_source__
    assert "getattr(" not in fast.__ampfx_source__.split("def forward")[1] and "getattr(" in amp.code
    assert close(amp(x), net(x))
    net.body[0][0].weight = nn.Parameter(torch.randn(4, 4))  # replaced
    with torch.no_grad():
        net.head.bias.add_(1.0)  # in place
    net.shift = torch.full((2,), 3.0)  # a buffer replaced
    assert close(amp(x), net(x))
    net.body[0] = nn.Sequential(nn.Linear(4, 4), nn.Tanh())  # a module replaced: converted again
    assert close(amp(x), net(x)) and len(amp.variants()) == 1
    params = {k: torch.randn_like(v) for k, v in net.named_parameters()}
    assert close(torch.func.functional_call(amp, params, (x,)), torch.func.functional_call(net, params, (x,)))
    # a plain fx graph module (nothing converts it again) reading a parameter itself: a name the dicts no longer
    # hold is read by getattr
    reads = _Reads()
    gm = torch.fx.symbolic_trace(reads)
    fast = lowered.forward(gm)
    assert "ampfx_op_read_" in fast.__ampfx_source__ and torch.equal(fast(gm, x), reads(x))
    holder = gm.get_submodule("body.1")  # fx's own holder of the parameters the graph reads
    weight = holder.weight.detach() * 2
    del holder._parameters["weight"]
    holder.weight = weight  # a plain attribute now, as weight_norm leaves it
    assert torch.equal(fast(gm, x), F.linear(x, weight * 2, holder.bias))
    # traced by fx itself (inside a model being traced), the module reads through getattr: its reads are the
    # tracer's nodes, not tensors it would fold into constants
    gm = torch.fx.symbolic_trace(_Reads())
    type(gm).forward = lowered.either(type(gm).forward, lowered.forward(gm))

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = gm

        def forward(self, x):
            return self.inner(x)

    traced = torch.fx.symbolic_trace(Outer())
    assert not [n.target for n in traced.graph.nodes if n.op == "get_attr" and "constant" in n.target]
    other = torch.fx.symbolic_trace(_Reads())  # called on another module, the code reads that module's own
    assert torch.equal(type(gm).forward(other, x), other(x)) and not torch.equal(gm(x), other(x))


class _Reads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def forward(self, x):
        return F.linear(x, self.body[1].weight * 2, self.body[1].bias)


class _Scaled(nn.Module):
    """Reads a parameter and a plain attribute of its own (``self.eps``) in its forward."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.eps = 1e-5

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def test_a_graph_reads_its_own_parameters_and_the_models_attributes_through_the_dicts_at_every_call():
    """Rule: a converted graph's reads of its module's own parameters and of the model module's plain attributes
    (``self.eps``, which the converted module finds only after ``nn.Module``'s lookup fails: an exception a read)
    go through the dicts that hold them, read at each call: a new value shows through without converting again."""
    from ampfx.runtime import lowered

    net = _Scaled()
    amp = ampfx.convert(net, example_inputs=(torch.randn(2, 4),))
    fast = lowered.forward(amp)
    assert fast is not None and "ampfx_op_read_0_eps()" in fast.__ampfx_source__
    assert "ampfx_op_read_1_weight()" in fast.__ampfx_source__
    x = torch.randn(3, 4)
    assert torch.equal(amp(x), net(x))
    net.eps = 4.0
    with torch.no_grad():
        net.weight.mul_(3)
    assert torch.equal(amp(x), net(x)) and amp.variants() == []
    net.weight = nn.Parameter(torch.full((4,), 2.0))  # replaced
    assert torch.equal(amp(x), net(x))


class _Region(nn.Module):
    """A region under ``torch.no_grad()`` holding one under ``torch.autocast(enabled=False)``, as a rotary embedding
    writes its tables: torch.export keeps each as a higher-order op around a graph of its own."""

    def __init__(self):
        super().__init__()
        self.register_buffer("freq", torch.arange(4.0))

    def forward(self, x):
        with torch.no_grad():
            t = self.freq[None, :].float()
            with torch.autocast("cpu", enabled=False):
                table = (t * x.float()).cos()
        return x * table


def test_an_exported_region_runs_as_its_python_runs_it_with_its_body_lowered():
    """Rule: export's ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` regions run in the fast code as their
    ``__call__`` runs them (grad mode or autocast set around the body, restored after, on an error too), without
    the dynamo wrapper each call makes; the body's own ops are bound to their handles too, and export's dtype
    assertions are dropped from it as from the graph around it."""
    from ampfx.runtime import lowered

    net = _Region()
    amp = ampfx.convert(net, example_inputs=(torch.randn(2, 4),), tracer="export")
    source = lowered.forward(amp).__ampfx_source__
    assert "ampfx_op_plain_wrap_with_set_grad_enabled(" in source
    bodies = [m for name, m in amp.named_modules(remove_duplicate=False) if name] + \
        [v for k, v in amp.__dict__.items() if isinstance(v, torch.fx.GraphModule)]
    nodes = [n for b in bodies for sub in b.modules() if isinstance(sub, torch.fx.GraphModule) for n in sub.graph.nodes]
    assert nodes and not [n for n in nodes if "assert_tensor_metadata" in str(n.target)]
    x = torch.randn(3, 4, requires_grad=True)
    out = amp(x)
    assert torch.equal(out, net(x)) and torch.is_grad_enabled()
    out.sum().backward()
    expected = torch.autograd.grad(net(x).sum(), x)[0]
    assert torch.equal(x.grad, expected)
    lowered_bodies = [sub for b in bodies for sub in b.modules() if "_ampfx_lowered" in type(sub).__dict__]
    assert lowered_bodies and all(getattr(type(b).forward, "_ampfx_plain", None) for b in lowered_bodies)

    def failing(y):
        raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        lowered._grad_enabled(False, failing, x)
    assert torch.is_grad_enabled()


def _depth() -> int:
    frame, n = sys._getframe(1), 0
    while frame is not None:
        frame, n = frame.f_back, n + 1
    return n


class _Deep(nn.Module):
    """Python no capture keeps (``.item()``), two levels of it, recording how deep in the stack it runs."""

    def __init__(self, inner: nn.Module | None = None):
        super().__init__()
        self.lin, self.inner, self.depths = nn.Linear(4, 4), inner, []

    def forward(self, x):
        self.depths.append(_depth())
        if x.sum().item() > 1e9:
            return x
        return self.lin(x) if self.inner is None else self.inner(self.lin(x))


def test_the_models_own_python_runs_as_deep_in_the_stack_as_in_the_model():
    """Rule: a module that keeps its Python (its children converted) runs it at the same stack depth, relative to
    the caller, as the model does: CPython allocates frames in chunks, and a recursive function called over and over
    across a chunk's end (torch's pytree, in a Hugging Face mask) frees and allocates one at each call, so a frame
    more or less moves its cost (Mixtral's mask: 5.3 ms two frames deeper, 4.6 ms at the model's depth)."""
    net = _Deep(_Deep())
    amp = ampfx.convert(net, example_inputs=(torch.randn(2, 4),))
    assert "eager" in amp.ampfx_report.parts[-1].method
    x = torch.randn(2, 4)
    net.depths.clear(), net.inner.depths.clear()
    here = _depth()
    net(x)
    model_depths = [d - here for d in (net.depths[-1], net.inner.depths[-1])]
    amp(x)
    assert [d - here for d in (net.depths[-1], net.inner.depths[-1])] == model_depths


class _OwnCall(_Deep):
    """A module whose class has a ``__call__`` of its own (as a Hugging Face checkpointing layer checkpoints in it)."""

    calls = 0

    def __call__(self, *args, **kwargs):
        _OwnCall.calls += 1
        return super().__call__(*args, **kwargs)


def test_a_module_class_with_its_own_call_runs_it_in_the_converted_model():
    """Rule: a module that keeps its Python runs its class's own ``__call__`` where it has one (Hugging Face's
    ``GradientCheckpointingLayer`` checkpoints there: skipping it trains without recomputing, with the memory
    that takes)."""
    net = _Deep(_OwnCall())
    amp = ampfx.convert(net, example_inputs=(torch.randn(2, 4),))
    before = _OwnCall.calls
    amp(torch.randn(2, 4))
    assert _OwnCall.calls == before + 1


class _SliceUnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            ref = h[:, :]  # a constant for the loss: a view that takes no gradient
        return h * ref


def test_a_whole_slice_made_under_no_grad_in_an_exported_region_stays_a_view_without_gradient():
    """Rule: in a region's body only export's dtype assertions are dropped; a whole-dimension slice there is the
    view that takes no gradient (dropping it returned the sliced tensor, and the weight's gradient doubled)."""
    net = _SliceUnderNoGrad()
    x = torch.randn(4, 8)
    amp = ampfx.convert(net, example_inputs=(x,), tracer="export", gemm_min_flops=0)
    amp(x).float().sum().backward()
    got = net.lin.weight.grad.clone()
    net.zero_grad()
    net(x).sum().backward()
    torch.testing.assert_close(got, net.lin.weight.grad, atol=0.05, rtol=0.05)


def test_a_mirror_is_called_through_nn_module_call_while_a_tracer_or_the_profiler_watches_it():
    """Rule: a mirror calls ``_call_impl`` itself only while ``nn.Module.__call__`` is torch's own and the profiler
    is off: fx's tracers patch ``__call__`` to keep leaves (a leaf mirror is recorded, not traced into) and the
    profiler names modules by its frame."""
    import torch.fx as fx

    class Leaf(fx.Tracer):
        def is_leaf_module(self, m, name):
            return isinstance(m, _Deep) or super().is_leaf_module(m, name)

    class Wrap(nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k

        def forward(self, x):
            return self.k(x) * 2

    amp = ampfx.convert(_Deep(_Deep()), example_inputs=(torch.randn(2, 4),))
    assert isinstance(amp.inner, runtime.view.Mirror)
    graph = Leaf().trace(Wrap(amp.inner))
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["k"]
    amp(torch.randn(2, 4))
    with torch.profiler.profile(with_modules=True, with_stack=True) as prof:
        amp(torch.randn(2, 4))
    names = {e.name for e in prof.profiler.function_events if e.name.startswith("nn.Module")}
    assert {"nn.Module: _Deep_0", "nn.Module: _Deep_1"} <= names, sorted(names)

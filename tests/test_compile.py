"""torch.compile and ampfx: ampfx as the compile backend (ampfx.integrations.dynamo), each graph dynamo captures
converted, graph breaks included, with a log of every graph; and a converted model compiled (convert, then compile)."""
import contextlib
import copy
import itertools
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import ampfx
from ampfx.errors import ArgumentError

pytestmark = pytest.mark.usefixtures("one_thread")


class Block(nn.Module):
    """A transformer block whose forward breaks dynamo's graph (a branch on a value, as T5 clamps large ones)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        if x.abs().max() > 1e4:
            x = x.clamp(-1e4, 1e4)
        x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return self.head(x.mean(1))


class Cnn(nn.Module):
    """A CNN with batch norm and a graph break between its two stages (a branch on a value)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        x = self.a(x)
        if x.sum() > 1e9:
            x = x / 2
        return self.fc(self.b(x).mean((2, 3)))


CASES = {"transformer": (Block, lambda: torch.randn(4, 8, 32)), "cnn": (Cnn, lambda: torch.randn(4, 3, 12, 12))}


def train(model, run, x, y, steps, region=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with region() if region is not None else contextlib.nullcontext():
            loss = F.cross_entropy(run(x).float(), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case", CASES)
def test_the_backend_trains_a_model_with_a_graph_break_as_autocast_does_and_lists_every_graph(case):
    """Compiled with ampfx as the backend, a model whose forward breaks dynamo's graph trains with losses as close to
    float32's as autocast + compile's, and the backend's log lists both graphs, the first ended by the break."""
    make, data = CASES[case]
    base, x, y = make(), data(), torch.randint(0, 10, (4,))
    fp32 = copy.deepcopy(base)
    want = train(fp32, fp32, x, y, 4)
    ac = copy.deepcopy(base)
    got_ac = train(ac, torch.compile(ac, backend="aot_eager"), x, y, 4, lambda: torch.autocast("cpu", torch.bfloat16))
    torch._dynamo.reset()
    amp = ampfx.backend("bf16", inner="aot_eager")
    model = copy.deepcopy(base)
    got = train(model, torch.compile(model, backend=amp), x, y, 4)
    gap_ac = max(abs(a - b) for a, b in zip(got_ac, want))
    gap = max(abs(a - b) for a, b in zip(got, want))
    assert gap <= 2 * gap_ac + 1e-3, (got, got_ac, want)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert len(amp.graphs) == 2 and all(g.converted for g in amp.graphs)
    assert amp.graphs[0].reason.startswith("graph break")
    lines = amp.summary().splitlines()
    assert lines[0] == "ampfx backend (bfloat16, inner aot_eager): 2 graphs"
    heads = [ln for ln in lines[1:] if not ln.startswith("    ")]  # each graph's details are indented under it
    assert [ln.split(":")[0].strip() for ln in heads] == [f"graph {g.compile_id}" for g in amp.graphs]
    assert sum(len(g.report.records) for g in amp.graphs) == len(amp.report.records) > 0
    low = [r for r in amp.report.records if r.dtype == torch.bfloat16]
    assert any(r.gemms for r in low), "the GEMMs run in bfloat16"


@pytest.mark.parametrize("small", [False, True], ids=["default", "every-gemm-small"])
def test_the_backends_summary_gives_each_graphs_reasons(small):
    """Rule: ``Backend.summary()`` is the one summary of a compiled model: under each graph's line it holds the rest
    of that graph's ``Report.summary()`` (what stayed float32 and why; the GEMMs kept float32 as small, with the
    switch that lowers them; the line saying that no GEMM runs low), without a capture line per graph; a graph
    whose GEMMs all stay float32 also warns so when it is converted."""
    amp = ampfx.backend("bf16", inner="eager", **({"gemm_min_flops": 10 ** 9} if small else {}))
    run = torch.compile(Block(), backend=amp)
    with pytest.warns(UserWarning, match="no GEMM runs in bfloat16") if small else contextlib.nullcontext():
        run(torch.randn(4, 8, 32))
    text = amp.summary()
    lines = text.splitlines()
    assert len(amp.graphs) == 2
    for g in amp.graphs:
        at = next(i for i, ln in enumerate(lines) if ln.startswith(f"  graph {g.compile_id}: converted"))
        details = [ln[2:] for ln in itertools.takewhile(lambda ln: ln.startswith("    "), lines[at + 1:])]
        shown = [ln for ln in g.report.summary().splitlines()[1:] if not ln.startswith("  capture")]
        assert shown and details == shown, (shown, text)
        assert any(re.match(r"  float32: \w+ \d+ \([\w ]+\)", ln) for ln in shown)  # op, count, reason
    assert "capture" not in text
    if small:
        assert text.count("small GEMMs: ") == 2 and text.count("no GEMM runs in bfloat16: ") == 2
        assert "(small GEMM)" in text and "AMPFX_GEMM_MIN_FLOPS=0" in text
    else:
        assert "small GEMM" not in text and "no GEMM runs" not in text


def _casts_per_step(run, model, x, y):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train(model, run, x, y, 1)
    return sum(1 for e in prof.events() if e.name == "aten::_to_copy")


@pytest.mark.parametrize("case", CASES)
def test_the_backend_casts_no_more_per_step_than_convert_then_compile(case):
    """A training step compiled with the backend runs no more casts (ATen ``_to_copy``, forward and backward) than
    the same model converted by ampfx.convert and then compiled."""
    make, data = CASES[case]
    base, x, y = make(), data(), torch.randint(0, 10, (4,))
    conv = copy.deepcopy(base)
    run = torch.compile(ampfx.convert(conv, "bf16", example_inputs=(x,)), backend="aot_eager")
    train(conv, run, x, y, 2)
    converted_then_compiled = _casts_per_step(run, conv, x, y)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    run = torch.compile(model, backend=ampfx.backend("bf16", inner="aot_eager"))
    train(model, run, x, y, 2)
    assert 0 < _casts_per_step(run, model, x, y) <= converted_then_compiled


def test_backend_ampfx_by_name_compiles_with_inductor():
    """``backend="ampfx"`` (the package's torch_dynamo_backends entry point) converts with the defaults and compiles
    with inductor; the default backend's log has the graph."""
    from ampfx.integrations import dynamo

    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), nn.Softmax(-1))
    before = len(dynamo.default().graphs)
    x = torch.randn(8, 16)
    out = torch.compile(net, backend="ampfx")(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, net(x), atol=2e-2, rtol=0)
    got = dynamo.default().graphs[before:]
    assert len(got) == 1 and got[0].converted
    softmax = [r for r in got[0].report.records if "softmax" in r.target]
    assert softmax and all(r.dtype == torch.float32 for r in softmax)


def test_a_recompile_converts_the_graph_again_and_is_listed():
    """Dynamo captures a graph again when its guards fail (eval mode here): the backend converts the new graph
    and lists it with its compile id."""
    amp = ampfx.backend("bf16", inner="eager")
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2))
    run = torch.compile(net, backend=amp)
    x = torch.randn(4, 8)
    run(x)
    net.eval()
    torch.testing.assert_close(run(x), net(x), atol=2e-2, rtol=0)
    assert [g.compile_id for g in amp.graphs] == ["0/0", "0/1"]


def test_convert_takes_a_graph_module_dynamo_made():
    """ampfx.convert of the graph module dynamo hands a backend (its class made per instance, its code compiled
    at its first call) converts it whole, as for any graph module."""
    got = []

    def keep(gm, example_inputs):
        got.append((gm, example_inputs))
        return gm

    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 2))
    torch.compile(net, backend=keep)(torch.randn(4, 8))
    gm, example = got[0]
    amp = ampfx.convert(gm, "bf16", example_inputs=tuple(example))
    assert [(p.path, p.method) for p in amp.ampfx_report.parts] == [("", "fx (the graph module's own graph)")]
    with torch.no_grad():
        torch.testing.assert_close(amp(*example)[0], gm(*example)[0], atol=3e-2, rtol=0)


@pytest.mark.parametrize("kwargs, words", [
    ({"fp32_op": ["softmax"]}, "unknown option fp32_op"),
    ({"inner": 3}, "inner=3"),
    ({"mode": "eval"}, "mode is 'train' or 'inference'"),
    ({"dtype": "fp8"}, "fp8"),
    ({"fp32_modules": ["head"]}, "names modules"),
    ({"leaf_modules": ["nn.MultiheadAttention"]}, "names modules"),
    ({"environ": {"AMPFX_FP32_MODULES": "head"}}, "AMPFX_FP32_MODULES"),
])
def test_a_bad_backend_argument_is_refused_when_the_backend_is_made(kwargs, words):
    """The backend's arguments are checked when it is made, not at the first graph inside torch.compile."""
    with pytest.raises((ArgumentError, ValueError, TypeError), match=words):
        ampfx.backend(**kwargs)


def test_convert_then_compile_does_not_recompile_when_a_hook_is_registered_elsewhere():
    """A converted model whose root keeps its Python (a branch on a value), compiled: registering a hook on some
    other module between steps (as libraries and profilers do) makes dynamo compile nothing again; it recompiled
    at every step when the call-time check read the process-wide hook counter."""
    frames = []

    def counting(gm, example_inputs):
        frames.append(gm)
        return gm

    model = Block()
    x, y = torch.randn(4, 8, 32), torch.randint(0, 10, (4,))
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    assert amp.ampfx_report.parts[0].method.startswith("eager") or any(
        p.path == "" and p.method.startswith("eager") for p in amp.ampfx_report.parts)
    run = torch.compile(amp, backend=counting)
    train(model, run, x, y, 2)
    compiled = len(frames)
    elsewhere = nn.Linear(2, 2)
    for _ in range(3):
        elsewhere.register_forward_hook(lambda *a: None)
        train(model, run, x, y, 1)
    assert len(frames) == compiled > 0


def test_op_lists_apply_to_every_graph_the_backend_converts():
    """An op moved to the deny list (by option or AMPFX_DENYLIST_ADD, read when the backend is made) is float32 in
    every graph, with the reason naming where it came from."""
    net = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    for amp, origin in ((ampfx.backend("bf16", inner="eager", denylist_add=["gelu"], inferlist_remove=["gelu"]), "denylist_add"),
                        (ampfx.backend("bf16", inner="eager", environ={"AMPFX_DENYLIST_ADD": "gelu", "AMPFX_INFERLIST_REMOVE": "gelu"}),
                         "AMPFX_DENYLIST_ADD")):
        torch._dynamo.reset()
        torch.compile(net, backend=amp)(torch.randn(4, 8))
        gelu = [r for r in amp.report.records if "gelu" in r.target]
        assert gelu and all(r.dtype == torch.float32 and origin in r.reason + str(r.rule) for r in gelu), gelu


@pytest.mark.parametrize("how", ["option", "environment"])
def test_the_saved_log_holds_every_graph(tmp_path, how):
    """``log_path`` (or AMPFX_LOG_PATH) saves every graph's report in one place, each graph's code under its
    compile id, rather than each graph's save replacing the one before."""
    given = {"log_path": str(tmp_path)} if how == "option" else {"environ": {"AMPFX_LOG_PATH": str(tmp_path)}}
    amp = ampfx.backend("bf16", inner="eager", **given)
    model = Block()
    torch.compile(model, backend=amp)(torch.randn(4, 8, 32))
    assert len(amp.graphs) == 2
    saved = sorted(p.name for p in tmp_path.glob("graph_after*.py"))
    assert saved == ["graph_after.graph_0_0.py", "graph_after.graph_1_0.py"]
    lines = (tmp_path / "decisions.jsonl").read_text().splitlines()
    assert len(lines) == sum(len(g.report.records) for g in amp.graphs)


class Vmapped(nn.Module):
    """A linear layer whose mask is built with torch.vmap, as Hugging Face's decoders build attention masks: dynamo's
    graph holds the vmap's level calls (_vmap_increment_nesting, _add_batch_dim) themselves."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        mask = torch.vmap(lambda row: (row > 0).float())(x)
        return self.b(torch.relu(self.a(x)) * mask)


def test_a_graph_holding_vmap_levels_converts_whole_and_leaves_no_level_open():
    """Dynamo's graph of a model that calls torch.vmap converts whole (its own graph, not traced again on proxies,
    which failed half-way inside the vmap level and left it open: every later op ran inside it)."""
    from torch._C._functorch import peek_interpreter_stack

    amp = ampfx.backend("bf16", inner="aot_eager")
    net, x = Vmapped(), torch.randn(4, 8)
    out = torch.compile(net, backend=amp)(x)
    assert peek_interpreter_stack() is None
    assert amp.graphs and all(g.converted for g in amp.graphs)
    assert any(r.dtype == torch.bfloat16 and r.gemms for g in amp.graphs for r in g.report.records)
    torch.testing.assert_close(out, net(x), atol=3e-2, rtol=0)


class Sliced(nn.Module):
    """Repeated blocks run through a slice of their ModuleList (``self.layers[:n]``, as Hugging Face's decoders do),
    in a forward that branches on a value (so it keeps its Python around the converted blocks)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        for layer in self.layers[:2]:
            x = layer(x)
        if x.sum() > 1e9:
            x = x / 2
        return self.head(x)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_slice_of_a_converted_module_list_is_a_module_list_of_its_converted_blocks(compiled):
    """Slicing the converted tree's ModuleList gives a ModuleList of its converted blocks, eager and under
    torch.compile (torch built the slice as a new object of the mirror's class, which dynamo could not make)."""
    net, x = Sliced(), torch.randn(4, 16)
    amp = ampfx.convert(net, "bf16", example_inputs=(x,))
    part = amp.layers[:2]
    assert type(part) is nn.ModuleList and list(part) == list(amp.layers)[:2]
    run = torch.compile(amp, backend="aot_eager") if compiled else amp
    torch.testing.assert_close(run(x), net(x), atol=3e-2, rtol=0)


def test_a_structure_edit_made_inside_compiled_code_shows_through():
    """A submodule replaced by code torch.compile runs is noted when dynamo replays the assignment (the notes are
    not read while it traces), so the converted module converts again, as for the same edit made eagerly."""
    net, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(2, 4)
    amp = ampfx.convert(net, "bf16", example_inputs=(x,))

    @torch.compile(backend="eager")
    def edit(model, x):
        model[0] = nn.Identity()
        return x * 2

    edit(net, x)
    assert isinstance(net[0], nn.Identity)
    torch.testing.assert_close(amp(x), net(x), atol=3e-2, rtol=0)
    assert len(amp.variants()) == 1


class Logged(nn.Module):
    """A forward that logs a value with ``.item()`` (a graph break): after a recompile, dynamo hands the backend
    the code after the break as a graph that reads no tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        print("loss", y.sum().item())
        return y.relu()


def test_a_graph_reading_no_tensor_is_handed_on_as_it_is_and_listed(capsys):
    """Rule: a graph dynamo hands the backend with nothing to convert (here, no tensor input: a forward logging a
    value with ``.item()``) goes to the inner backend as captured, not refused with advice about example_inputs
    the user never gave; the summary and the merged report list it, and the graphs that hold work are converted."""
    amp = ampfx.backend("bf16", inner="eager")
    net = Logged()
    run = torch.compile(net, backend=amp)
    for _ in range(3):  # a new logged value each call: dynamo captures the code after the break again
        x = torch.randn(4, 8)
        torch.testing.assert_close(run(x), net(x), atol=3e-2, rtol=0)
    assert capsys.readouterr().out.count("loss") == 6
    idle = [g for g in amp.graphs if g.nothing_to_convert]
    assert idle and all(g.why == "no tensor input" and not g.converted for g in idle)
    assert any(g.converted and any(r.dtype == torch.bfloat16 for r in g.report.records) for g in amp.graphs)
    lines = amp.summary().splitlines()[1:]
    assert any(f"graph {g.compile_id}: nothing to convert (no tensor input), handed to eager as it is" in ln
               for g in idle for ln in lines), lines
    left = [p for p in amp.report.parts if p.method.startswith("left as is: nothing to convert")]
    assert len(left) == len(idle)


def _ints(x):
    y = x * 2 + 1
    torch._dynamo.graph_break()
    return (y > 3).sum()


def _constants(x):
    torch._dynamo.graph_break()
    a = torch.ones(4, 4)
    return a @ a + 1


def _floats(x):
    y = x * 2
    torch._dynamo.graph_break()
    return y.sum()


@pytest.mark.parametrize("fn, x, why", [
    (_ints, torch.arange(6), "no floating-point value"),          # integer and boolean tensors only
    (_constants, torch.randn(3), "no tensor input"),              # tensors made from constants inside the graph
    (_floats, torch.randn(3), None),                              # float work: converted
], ids=["integers", "constants", "floats"])
def test_graph_breaks_leave_small_graphs_with_nothing_to_convert_as_captured(fn, x, why):
    """Rule: the tiny graphs around graph breaks are handed on as captured where they hold nothing to convert (no
    tensor input, or no floating-point value), each listed with why; a graph with float work is converted."""
    amp = ampfx.backend("bf16", inner="eager")
    torch.testing.assert_close(torch.compile(fn, backend=amp)(x), fn(x), atol=3e-2, rtol=0)
    assert amp.graphs
    if why is None:
        assert all(g.converted and not g.nothing_to_convert for g in amp.graphs)
    else:
        assert any(g.nothing_to_convert and g.why == why for g in amp.graphs)
        assert all(g.converted or g.nothing_to_convert for g in amp.graphs)
        assert f"nothing to convert ({why}), handed to eager as it is" in amp.summary()

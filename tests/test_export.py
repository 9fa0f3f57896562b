"""The torch.export front-end: ATen op names, capture, training contracts, tracer="auto" and the ladder."""
import copy
import io
import pickle

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx import Category, ops
from ampfx.capture.export import unavailable
from ampfx.runtime import cast as runtime_cast
from conftest import rel_err
from support.clock import ExportClock
from support.models import Outer

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
aten = torch.ops.aten


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.fc, self.norm, self.drop = nn.Linear(d, d), nn.LayerNorm(d), nn.Dropout(0.25)

    def forward(self, x):
        return self.norm(x + self.drop(F.gelu(self.fc(x))))


class Net(nn.Module):
    """Linear blocks with layer norm and dropout, attention-style softmax, a loss-like reduction."""

    def __init__(self, d=16):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        att = torch.softmax(x @ x.transpose(-1, -2), dim=-1)
        return self.head(att @ x).sum(dim=1)


class Masked(nn.Module):
    """HF-style: torch.finfo of a traced dtype (torch.fx cannot trace it) and a float32-minimum mask."""

    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 4)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores = scores.masked_fill(mask[:, None, :] == 0, torch.finfo(scores.dtype).min)
        return self.out(torch.softmax(scores, dim=-1) @ x)


class IsInstance(nn.Module):
    """torch.fx traces the wrong branch (a Proxy is not a Tensor): the graph runs but computes something else."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if isinstance(x, torch.Tensor):
            return self.fc(x)
        return self.fc(x) * 0


class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn0 = nn.BatchNorm1d(8)  # sees float32 graph inputs: statistics exactly eager's
        self.fc, self.bn1, self.drop = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.drop(self.bn1(self.fc(self.bn0(x)))))


class Out(dict):
    """A dict subclass with its own pytree node, like HF's ``ModelOutput``."""


torch.utils._pytree.register_pytree_node(Out, lambda o: (list(o.values()), list(o.keys())),
                                         lambda values, keys: Out(zip(keys, values)),
                                         serialized_type_name="tests.test_export.Out")


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        return Out(hidden=h, logits=h.softmax(-1))


def low_records(rep):
    return [r for r in rep.compute if r.dtype in (torch.bfloat16, torch.float16)]


# ------------------------------------------------------------------ op tables
@pytest.mark.parametrize("aten_op, torch_level", [
    (aten.linear.default, F.linear), (aten.conv2d.default, nn.Conv2d), (aten.softmax.int, F.softmax),
    (aten._softmax.default, F.softmax), (aten.log_softmax.int, F.log_softmax), (aten.layer_norm.default, F.layer_norm),
    (aten.batch_norm.default, nn.BatchNorm2d), (aten._native_batch_norm_legit.default, F.batch_norm),
    (aten._native_batch_norm_legit_functional.default, F.batch_norm),
    (aten._native_batch_norm_legit_no_training.default, F.batch_norm),
    (aten.sum.dim_IntList, torch.sum), (aten.mean.dim, torch.mean), (aten.matmul.default, torch.matmul),
    (aten.addmm.default, torch.addmm), (aten.mm.default, torch.mm), (aten.bmm.default, torch.bmm),
    (aten.embedding.default, nn.Embedding), (aten.gelu.default, F.gelu), (aten.dropout.default, F.dropout),
    (aten.cross_entropy_loss.default, F.cross_entropy), (aten.nll_loss.default, F.nll_loss),
    (aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention),
    (aten.view.default, "view"), (aten.reshape.default, "reshape"), (aten.permute.default, "permute"),
    (aten.transpose.int, "transpose"), (aten.expand.default, "expand"), (aten.slice.Tensor, "narrow"),
    (aten.add.Tensor, "add"), (aten.add_.Tensor, "add"), (aten.mul.Tensor, "mul"), (aten.rsub.Scalar, "sub"),
    (aten._to_copy.default, "to"), (aten.to.dtype, "to"), (aten.sym_size.int, "size"), (aten.index.Tensor, "getitem"),
])
def test_aten_ops_share_the_torch_level_name(aten_op, torch_level):
    """One policy for both front-ends: an ATen op has the canonical name of its torch-level spelling."""
    name = ops.lookup_name(aten_op)
    assert name is not None and name == ops.lookup_name(torch_level)


def test_accumulation_dtype_only_where_the_aten_schema_takes_it():
    """``aten.softmax.int`` gets ``dtype=float32``; ``aten._softmax`` (no such argument) gets a cast instead."""
    from ampfx.passes.cast_model import _takes

    assert _takes(aten.softmax.int, "dtype") and _takes(aten.sum.dim_IntList, "dtype")
    assert not _takes(aten._softmax.default, "dtype") and _takes(F.softmax, "dtype")


# ------------------------------------------------------------------ capture, decisions, numerics
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_export_converts_with_module_paths_and_fp32_accuracy(dtype):
    """tracer='export': one ATen graph; GEMMs low, softmax/layer_norm decided as on the fx path; records carry
    the module path from nn_module_stack; outputs close to float32."""
    torch.manual_seed(0)
    m, x = Net().eval(), torch.randn(2, 6, 16)
    amp = ampfx.convert(m, dtype, example_inputs=(x,), tracer="export")
    rep = amp.ampfx_report
    assert [(r.path, r.method) for r in rep.parts] == [("", "export")]
    assert all(str(n.target).startswith(("aten.", "<built-in", "ampfx")) or n.target is runtime_cast
               for n in amp.graph.nodes if n.op == "call_function")
    by_module = {(r.op, r.module) for r in rep.compute}
    assert ("linear", "blocks.0.fc") in by_module and ("layer_norm", "blocks.1.norm") in by_module
    assert all(r.dtype == dtype for r in rep.compute if r.op == "linear")
    assert [r.dtype for r in rep.compute if r.op == "softmax"] == [torch.float32]
    amp.eval()
    with torch.no_grad():
        assert rel_err(amp(x), m(x)) < (0.03 if dtype is torch.bfloat16 else 0.005)


def test_fx_and_export_make_the_same_decisions():
    """The same model through both front-ends: the same ops in the same dtypes (one policy)."""
    torch.manual_seed(0)
    m, x = Net().eval(), torch.randn(2, 6, 16)
    fx_rep = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="fx").ampfx_report
    ex_rep = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export").ampfx_report
    keep = ("linear", "layer_norm", "softmax", "gelu", "matmul", "sum", "add")

    def decided(rep):
        return sorted((r.op, str(r.dtype)) for r in rep.compute if r.op in keep)

    assert decided(fx_rep) == decided(ex_rep)


def test_fp32_modules_env_applies_to_exported_graphs():
    """AMPFX_FP32_MODULES names modules by path; exported nodes know theirs."""
    m, x = Net(), torch.randn(2, 6, 16)
    rep = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export",
                        environ={"AMPFX_FP32_MODULES": "blocks.0"}).ampfx_report
    inside = [r for r in rep.compute if r.module.startswith("blocks.0")]
    assert inside and all(r.dtype == torch.float32 and r.rule == "fp32_modules" for r in inside)
    assert [r.dtype for r in rep.compute if r.module == "blocks.1.fc"] == [torch.bfloat16]


# ------------------------------------------------------------------ training contracts
def test_parameters_are_the_models_and_an_optimizer_on_them_trains_the_converted_model():
    """Same parameter objects, same state_dict keys/shapes/dtypes; the model is not changed by convert."""
    torch.manual_seed(0)
    m, x = Net(), torch.randn(2, 6, 16)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    assert all(a is b for a, b in zip(amp.parameters(), m.parameters()))
    assert len(list(amp.parameters())) == len(list(m.parameters()))
    sd, sd_m = amp.state_dict(), m.state_dict()
    assert list(sd) == list(sd_m) and all(sd[k].dtype == sd_m[k].dtype and sd[k].shape == sd_m[k].shape for k in sd)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert m.training and type(m) is Net  # modes and class as given
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    target = torch.tensor([1, 3])
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = F.cross_entropy(amp(x).float(), target)
        loss.backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in m.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_batch_norm_running_statistics_update_as_in_eager():
    """One training step: running stats of a batch norm fed float32 equal eager's; one fed low precision
    is close; the counters match; the buffers stay float32."""
    torch.manual_seed(0)
    m, x = BNNet(), torch.randn(16, 8)
    twin = copy.deepcopy(m)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    amp(x)
    twin(x)
    assert torch.equal(m.bn0.running_mean, twin.bn0.running_mean)
    assert torch.equal(m.bn0.running_var, twin.bn0.running_var)
    assert torch.allclose(m.bn1.running_mean, twin.bn1.running_mean, atol=2e-2)
    assert int(m.bn1.num_batches_tracked) == int(twin.bn1.num_batches_tracked) == 1
    assert m.bn1.running_var.dtype == torch.float32


def test_train_and_eval_switch_graphs():
    """The exported graph has the mode baked in; the converted module keeps one per mode and .eval() /
    .train() switch: eval is deterministic, uses running statistics and leaves them alone."""
    torch.manual_seed(0)
    m, x = BNNet(), torch.randn(16, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    assert any("in eval mode the module runs a second conversion" in n for n in amp.ampfx_report.notes)
    amp.eval()
    m.eval()
    stats = m.bn1.running_mean.clone()
    with torch.no_grad():
        a, b = amp(x), amp(x)
        want = m(x)
    assert torch.equal(a, b) and torch.equal(m.bn1.running_mean, stats)
    assert rel_err(a, want) < 0.03
    amp.train()
    with torch.no_grad():
        assert not torch.equal(amp(x), amp(x))  # dropout is on again


def test_deepcopy_and_pickle_keep_the_exported_conversion():
    torch.manual_seed(0)
    m, x = Net().eval(), torch.randn(2, 6, 16)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    amp.eval()
    with torch.no_grad():
        want = amp(x)
        for other in (copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
            other.eval()
            assert torch.equal(other(x), want)
            assert list(other.state_dict()) == list(m.state_dict())


def test_pickling_keeps_the_output_structure():
    """Unpickling re-traces the code; the exported graph's output type (HF ModelOutput-like) comes back."""
    m, x = Structured(), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    again = pickle.loads(pickle.dumps(amp))
    for out in (amp(x), again(x)):
        assert type(out) is Out and list(out) == ["hidden", "logits"]
    assert torch.equal(again(x)["logits"], amp(x)["logits"])


def test_other_batch_and_sequence_sizes_run():
    """Sizes are dynamic where the model allows (Dim.AUTO), so a converted module is not tied to the
    example's batch size or sequence length."""
    m = Net().eval()
    amp = ampfx.convert(m, "bf16", example_inputs=(torch.randn(2, 6, 16),), tracer="export")
    amp.eval()
    with torch.no_grad():
        x = torch.randn(5, 9, 16)
        assert rel_err(amp(x), m(x)) < 0.03


# ------------------------------------------------------------------ tracer="auto"
def test_auto_exports_what_fx_cannot_trace():
    """torch.finfo of a traced dtype stops torch.fx; export captures it whole, and the float32-minimum
    constant of the mask keeps its masked_fill in float32 (bfloat16 cannot hold -3.4e38)."""
    torch.manual_seed(0)
    m = Masked().eval()
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.long)
    mask[1, -2:] = 0
    amp = ampfx.convert(m, "bf16", example_inputs={"x": x, "mask": mask})
    (region,) = amp.ampfx_report.parts
    assert region.method == "export"
    assert any("torch.fx could not trace" in s for s in region.steps)
    (fill,) = [r for r in amp.ampfx_report.compute if r.op == "masked_fill"]
    assert fill.dtype == torch.float32 and fill.rule == "range:constant"
    amp.eval()
    with torch.no_grad():
        assert rel_err(amp(x=x, mask=mask), m(x, mask)) < 0.03
        assert rel_err(amp(x, mask), m(x, mask)) < 0.03


def test_auto_exports_when_the_fx_graph_does_not_reproduce_the_model():
    """torch.fx traces a branch eager never takes (a Proxy is not a Tensor); the float32 comparison on the
    example inputs catches it and export is used instead."""
    m, x = IsInstance(), torch.randn(3, 8)
    assert not torch.equal(torch.fx.symbolic_trace(m)(x), m(x))
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    (region,) = amp.ampfx_report.parts
    assert region.method == "export"
    assert any("does not reproduce" in s or "differs from the model's" in s for s in region.steps)
    with torch.no_grad():
        assert rel_err(amp(x), m(x)) < 0.03


def test_auto_keeps_fx_where_it_works():
    m, x = Net(), torch.randn(2, 6, 16)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    assert {r.method for r in amp.ampfx_report.parts} == {"fx"}  # the root, and each kept block
    assert any(n.op == "call_module" for n in amp.graph.nodes)  # module structure kept (leaf modules)


# ------------------------------------------------------------------ the ladder when neither works
def test_neither_capture_works_falls_back_to_children_and_says_why():
    """A data-dependent branch (in child ``b``) stops torch.export: the root and ``b`` run eagerly with their
    children exported one by one, and each region says how it was captured and why."""
    torch.manual_seed(0)
    m, x = Outer(), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    regions = {r.path: r for r in amp.ampfx_report.parts}
    assert {p: r.method for p, r in regions.items()} == {
        "": "eager (children converted separately)", "b": "eager (children converted separately)",
        "a": "export", "b.lin": "export", "c": "export"}
    assert all(any(s.startswith("torch.export (train mode)") for s in regions[p].steps) for p in ("", "b"))
    assert [r.module for r in amp.ampfx_report.compute if r.op == "linear"] == ["a", "b.lin", "c"]
    with torch.no_grad():
        assert rel_err(amp(x), m(x)) < 0.03


def test_auto_keeps_fx_leaves_when_export_fails():
    """Under auto, an fx capture that needed leaves is kept when export fails too; the steps say so."""
    m, x = Outer(), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    regions = {r.path: r for r in amp.ampfx_report.parts}
    steps = regions[""].steps
    assert regions[""].method == "fx" and regions["b"].method.startswith("eager")
    assert any(s.startswith("auto: torch.fx needed leaves (b)") for s in steps)
    assert any(s.startswith("torch.export") for s in steps) and steps[-1] == "kept the torch.fx graph with leaves"


class _Clamp(nn.Linear):
    """torch.fx cannot trace it (torch.finfo of a traced dtype): a leaf; torch.export can."""

    def forward(self, x):
        return super().forward(x.clamp(min=torch.finfo(x.dtype).min))


def _clamped() -> nn.Module:
    """A model torch.fx traces with one leaf and torch.export captures whole."""
    return nn.Sequential(_Clamp(16, 16), nn.ReLU(), nn.Linear(16, 4))


def test_a_hook_on_the_converted_module_itself_does_not_stop_export():
    """The module's own hooks stay Python around its graph: what they set (a monitoring hook keeping the
    last output) is not the forward's, and export is still tried (found by review: the real run that
    checks the fx graph counted it, and the model kept its fx graph with leaves)."""
    m, x = _clamped(), torch.randn(2, 16)
    m.register_forward_hook(lambda mod, args, out: setattr(mod, "last_output", out.detach()))
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    assert amp.ampfx_report.parts[0].method == "export", amp.ampfx_report.parts[0].steps
    out = amp(x)
    assert torch.equal(amp.last_output, out.detach())  # the hook runs around the graph, given the converted module


def test_an_fx_graph_with_leaves_is_run_only_when_it_is_kept(monkeypatch):
    """The fx graph with leaves is only a fallback for export: its check against the model (its own run,
    forward and backward) waits until export fails, and is skipped where export captures the model."""
    from ampfx.capture import ladder
    runs = []
    real = ladder.compare
    monkeypatch.setattr(ladder, "compare", lambda model, *a, **k: runs.append(type(model)) or real(model, *a, **k))
    ampfx.convert(Outer(), "bf16", example_inputs=(torch.randn(3, 8),))  # export fails in child b: fx kept
    assert runs.count(Outer) == 1
    runs.clear()

    amp = ampfx.convert(_clamped(), "bf16", example_inputs=(torch.randn(2, 16),))
    assert amp.ampfx_report.parts[0].method == "export" and runs == []


# ------------------------------------------------------------------ errors
def test_export_needs_example_inputs():
    with pytest.raises(TypeError, match="tracer='export' runs the model on example_inputs"):
        ampfx.convert(Net(), "bf16", tracer="export")


def test_unknown_tracer_is_rejected():
    with pytest.raises(ValueError, match="tracer='dynamo'.*'auto'"):
        ampfx.convert(Net(), "bf16", tracer="dynamo")


def test_export_page_prints_what_it_shows():
    """docs/export.md's examples run and print their text blocks (refresh: python tests/support/doccheck.py --fill)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(root / "tests" / "support" / "doccheck.py"), str(root / "docs" / "export.md")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_export_says_it_traced_through_named_leaves():
    """leaf_modules keep a module whole under torch.fx only; an exported graph's report says so."""
    m, x = Net(), torch.randn(2, 6, 16)
    rep = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export", leaf_modules=["blocks.0"]).ampfx_report
    assert any("traces through leaf_modules" in n for n in rep.notes)
    assert any(r.module == "blocks.0.fc" for r in rep.compute)


class EvalOnlyBranch(nn.Module):
    """Exports in train mode; in eval mode a branch on values stops torch.export."""

    def __init__(self):
        super().__init__()
        self.fc, self.drop = nn.Linear(8, 8), nn.Dropout(0.1)

    def forward(self, x):
        h = self.drop(self.fc(x))
        if not self.training and h.sum() > 0:
            h = h * 2
        return h


def test_a_mode_that_does_not_export_is_converted_as_converting_in_that_mode_would():
    """The other training mode does not export: switching to it runs what ampfx.convert(model.eval(),
    tracer='export') makes (the root keeps its Python, its children are converted), also after pickling;
    the report says what each mode runs."""
    m, x = EvalOnlyBranch(), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    assert any("in eval mode the module runs a second conversion" in n for n in amp.ampfx_report.notes)
    assert any(r.path == "" and "eager" in r.method for r in amp.mode_module(False).ampfx_report.parts)
    assert amp(x).shape == (3, 8)
    want = m.eval()(x)
    for model in (amp, pickle.loads(pickle.dumps(amp))):
        model.eval()
        assert rel_err(model(x), want) < 0.03


def test_cli_explain_takes_a_tracer(capsys):
    """ampfx explain --tracer export: the table's records come from the exported graph."""
    import json

    from ampfx.ui.cli import main

    assert main(["explain", "tests/support/models.py:MLP", "--input", "4,12", "--tracer", "export", "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any(r["op"] == "linear" and r["target"] == "aten.linear.default" and r["module"] == "fc1" for r in rows)


class SlowToExport(Masked):
    """Masked (torch.fx cannot trace it), but its export takes seconds: it sleeps on fake tensors."""

    def forward(self, x, mask):
        if type(x) is not torch.Tensor and not isinstance(x, torch.fx.Proxy):  # export's fake tensors
            import time
            time.sleep(3)
        return super().forward(x, mask)


def test_an_export_over_its_time_limit_takes_the_next_rung_and_leaves_no_timer():
    """export_timeout: a slow export stops, the region's steps say how long it ran and how to lift the
    limit, the module keeps its Python with its children converted (still right), and the process's
    SIGALRM handler and timer are as they were."""
    import signal
    import time
    from ampfx.capture import export as export_mod
    torch.manual_seed(0)
    m, x, mask = Masked(), torch.randn(2, 5, 16), torch.ones(2, 5)
    m.register_forward_hook(lambda mod, args, out: out)  # the root's hooks are put back after export too
    handler = signal.getsignal(signal.SIGALRM)
    real = export_mod._export

    def slow(*args, **kwargs):  # an export that takes 3 s (in the full suite a fake-tensor check in forward
        time.sleep(3)           # did not always see fake tensors: the sleep is put in export itself)
        return real(*args, **kwargs)

    export_mod._export = slow
    try:
        amp = ampfx.convert(m, "bf16", example_inputs=(x, mask), export_timeout=0.5)
    finally:
        export_mod._export = real
    root = next(r for r in amp.ampfx_report.parts if r.path == "")
    assert root.method.startswith("eager") and "longer than export_timeout=0.5 s" in root.steps[-1]
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    assert len(m._forward_hooks) == 1
    assert rel_err(amp(x, mask), m(x, mask)) < 0.02
    for off in ({"export_timeout": None}, {"environ": {"AMPFX_EXPORT_TIMEOUT": "off"}}):
        amp = ampfx.convert(m, "bf16", example_inputs=(x, mask), **off)
        assert next(r for r in amp.ampfx_report.parts if r.path == "").method == "export"


def test_export_timeout_is_checked_and_read_from_the_environment():
    from ampfx.policy import from_env
    assert from_env(ampfx.Policy(), {"AMPFX_EXPORT_TIMEOUT": "12.5"}).export_timeout == 12.5
    for bad in (-1, "10", True, float("inf")):
        with pytest.raises(ampfx.PolicyError, match="export_timeout"):
            ampfx.Policy(export_timeout=bad)
    with pytest.raises(ampfx.PolicyError, match="AMPFX_EXPORT_TIMEOUT"):
        from_env(ampfx.Policy(), {"AMPFX_EXPORT_TIMEOUT": "soon"})


def test_off_the_main_thread_export_runs_without_a_limit_and_says_so():
    import threading
    from ampfx.capture.export import time_limit
    said = []
    t = threading.Thread(target=lambda: said.append(time_limit(5).__enter__()))
    t.start()
    t.join(timeout=30)
    assert said and "main thread" in said[0]


def test_root_hooks_fire_on_every_call_of_an_exported_module():
    """torch.export would inline the root's hooks (their side effects then ran once, at export): they are
    taken off while exporting and called around the graph, as on the torch.fx path."""
    calls = []
    m = Masked()
    m.register_forward_hook(lambda mod, args, out: calls.append(out.dtype) or out * 2)
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 5)
    amp = ampfx.convert(m, "bf16", example_inputs=(x, mask), tracer="export")
    calls.clear()
    amp(x, mask)
    amp(x, mask)
    assert len(calls) == 2
    assert rel_err(amp(x, mask), m(x, mask)) < 0.02


@pytest.fixture
def clock(monkeypatch):
    """export's budgets on a fake clock: only the steps a test calls slow take time (support/clock.py)."""
    return ExportClock().install(monkeypatch)


class SlowOnDynamicWidth(Masked):
    """Exports fast unless its second dimension is symbolic (as a model doing arithmetic on its spatial sizes):
    then its forward takes 3 s of ``sleep``'s clock."""

    def __init__(self, sleep) -> None:
        super().__init__()
        self.sleep = sleep

    def forward(self, x, mask):
        if isinstance(x.shape[1], torch.SymInt):
            self.sleep(3)
        return super().forward(x, mask)


def test_a_slow_dynamic_export_gives_way_to_a_dynamic_batch_only(clock):
    """Every dimension dynamic may take a quarter of export_timeout; then the batch alone is dynamic: the graph
    takes other batch sizes, and other sequence lengths raise GuardError (the notes say so). On a fake clock: how
    long export's real work takes on this machine, loaded or not, decides nothing."""
    from ampfx.capture.export import DYNAMIC_SHARE
    from ampfx.errors import GuardError
    torch.manual_seed(0)
    m, x, mask = SlowOnDynamicWidth(clock.sleep), torch.randn(2, 5, 16), torch.ones(2, 5)
    amp = ampfx.convert(m, "bf16", example_inputs=(x, mask), export_timeout=6)  # a quarter (1.5 s) is under the 3 s
    assert clock.elapsed == 6 * DYNAMIC_SHARE, "the every-dimension try stopped at its share, and nothing else waited"
    root = next(r for r in amp.ampfx_report.parts if r.path == "")
    assert root.method == "export" and any("Dim.AUTO) (train mode) stopped after" in s for s in root.steps)
    assert any("dynamic first (batch) dimension" in n for n in amp.ampfx_report.notes)
    x3, mask3 = torch.randn(3, 5, 16), torch.ones(3, 5)
    assert rel_err(amp(x3, mask3), m(x3, mask3)) < 0.02
    with pytest.raises(GuardError):
        amp(torch.randn(2, 6, 16), torch.ones(2, 6))


def test_the_other_training_mode_starts_from_the_sizes_the_first_export_ended_with(clock):
    """A model whose every-dimension export is too slow, with dropout (two modes, two exports): the
    second export starts with the dynamic batch, and does not wait for the same timeout again (on a fake clock:
    one share of export_timeout passes in all)."""
    from ampfx.capture.export import DYNAMIC_SHARE

    class SlowWithDropout(SlowOnDynamicWidth):
        def __init__(self):
            super().__init__(clock.sleep)
            self.drop = nn.Dropout(0.1)

        def forward(self, x, mask):
            return self.drop(super().forward(x, mask))

    m, x, mask = SlowWithDropout(), torch.randn(2, 5, 16), torch.ones(2, 5)
    amp = ampfx.convert(m, "bf16", example_inputs=(x, mask), export_timeout=4)
    assert clock.elapsed == 4 * DYNAMIC_SHARE
    other = next(r for r in amp.mode_module(False).ampfx_report.parts if r.path == "")
    assert other.method == "export" and any("as the other training mode's export did" in s for s in other.steps)
    m.eval()
    assert rel_err(amp.eval()(x, mask), m(x, mask)) < 0.02


def test_a_timeout_during_torchs_own_lazy_imports_leaves_export_working():
    """In a fresh process the first export imports parts of torch; a timeout must not cut an import short
    (a half-made module stays in sys.modules: every later export failed with "torch._dynamo has no
    attribute 'exc'"). The timer waits for the import to finish."""
    import subprocess
    import sys
    from pathlib import Path
    code = (
        "import sys; sys.path.insert(0, 'tests')\n"
        "import torch, ampfx\n"
        "from test_export import SlowToExport\n"
        "m, x, mask = SlowToExport(), torch.randn(2, 5, 16), torch.ones(2, 5)\n"
        "for t in (0.5, None):\n"
        "    amp = ampfx.convert(m, 'bf16', example_inputs=(x, mask), export_timeout=t)\n"
        "print(next(r for r in amp.ampfx_report.parts if r.path == '').method)\n")
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "export", run.stdout


class _Steps(nn.Module):
    """Four small layers, the third of which stalls export's size analysis when the width is symbolic (1.5 s of
    ``sleep``'s clock)."""

    def __init__(self, sleep, d=16):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 4)
        self.mask, self.stall = Masked(d), _Stall(sleep)

    def forward(self, x, mask):
        return self.out(self.stall(self.b(self.a(x))) + self.mask(x, mask)[..., :1])


class _Stall(nn.Module):
    def __init__(self, sleep) -> None:
        super().__init__()
        self.sleep = sleep

    def forward(self, x):
        if isinstance(x.shape[1], torch.SymInt):
            self.sleep(1.5)
        return x


def test_a_dynamic_export_that_stalls_on_one_module_gives_way_at_once(clock):
    """One module taking seconds where the others took milliseconds (export's symbolic size analysis
    stuck on arithmetic with sizes) ends the every-dimension try when its forward ends, long before
    export_timeout's share (15 s here: on a fake clock, the stalled module's 1.5 s is all that passes); the
    report names the module, and the batch-only graph is right."""
    m = _Steps(clock.sleep)
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 5)
    amp = ampfx.convert(m, "bf16", example_inputs=(x, mask), export_timeout=60)
    assert clock.elapsed == 1.5
    root = next(r for r in amp.ampfx_report.parts if r.path == "")
    stalled = [s for s in root.steps if "stalled" in s]
    assert root.method == "export" and len(stalled) == 1 and "'stall'" in stalled[0], root.steps
    assert any("dynamic first (batch) dimension" in n for n in amp.ampfx_report.notes)
    x3, mask3 = torch.randn(3, 5, 16), torch.ones(3, 5)
    assert rel_err(amp(x3, mask3), m(x3, mask3)) < 0.02


class _EvalCache(nn.Module):
    """timm's attention-bias cache: in eval mode the first call stores a tensor made from a parameter,
    later calls read it. torch.fx cannot trace it (torch.finfo of a traced dtype)."""

    def __init__(self, d=16):
        super().__init__()
        self.lin, self.bias = nn.Linear(d, d), nn.Parameter(torch.randn(d))
        self.cache = {}

    def forward(self, x):
        x = x.clamp(min=torch.finfo(x.dtype).min)
        if self.training:
            return self.lin(x) + self.bias * 2
        if "b" not in self.cache:
            self.cache["b"] = self.bias * 2
        return self.lin(x) + self.cache["b"]


class _LeafCaches(nn.Module):
    """torch.fx traces the root and keeps the two caching modules as leaves."""

    def __init__(self):
        super().__init__()
        self.first, self.second = _EvalCache(), _EvalCache()

    def forward(self, x):
        return self.second(self.first(x))


class _TwoCaches(_LeafCaches):
    """The same, with a root torch.fx cannot trace either."""

    def forward(self, x):
        return super().forward(x.clamp(min=torch.finfo(x.dtype).min))


def test_a_cache_a_forward_fills_under_export_stops_it_there_and_is_emptied_again():
    """Export would bake the cached tensor into the graph as a constant: the capture stops when the
    caching module's forward ends (not after tracing the rest), the cache holds no fake tensor after
    it, and the converted module computes what the model computes."""
    from ampfx.capture import export
    from ampfx.inputs import ExampleInputs
    m = _TwoCaches().eval()
    with pytest.raises(export.ExportFailed) as e:
        export.capture(m, ExampleInputs.of((torch.randn(2, 16),)), drops=(drops := set()))
    assert "'first': attribute 'cache' changed in place" in str(e.value.steps) and "'second'" not in str(e.value.steps)
    assert drops == {"first"} and m.first.cache == {} and m.second.cache == {}


class _Pyramid(nn.Module):
    """A module whose state its parent sets through a method (RAFT's ``corr_block.build_pyramid``); its forward
    is never called."""

    def __init__(self):
        super().__init__()
        self.levels = None

    def build(self, x):
        self.levels = [x, F.avg_pool1d(x[:, None], 2)[:, 0]]

    def read(self):
        return self.levels[1].sum(-1, keepdim=True)


AFTER_CALLS: list[int] = []


class _SetsThroughAMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.pyramid, self.before, self.after = _Pyramid(), nn.Linear(16, 16), nn.Linear(16, 16)
        self.after.register_forward_pre_hook(lambda m, a: AFTER_CALLS.append(1))

    def forward(self, x):
        h = self.before(x.clamp(min=torch.finfo(x.dtype).min))
        self.pyramid.build(h)
        for _ in range(3):
            h = self.after(h) + self.pyramid.read()
        return h


def test_state_a_parent_sets_through_a_child_method_stops_export_at_the_next_module_call():
    """The child's forward never runs, so its end cannot say it: the next module call does (export of a
    recurrent flow model went on tracing its whole loop, then again with static sizes, before it said so)."""
    from ampfx.capture import export
    from ampfx.inputs import ExampleInputs
    m = _SetsThroughAMethod()
    AFTER_CALLS.clear()
    with pytest.raises(export.ExportFailed) as e:
        export.capture(m, ExampleInputs.of((torch.randn(2, 16),)), drops=(drops := set()))
    assert "'pyramid': attribute 'levels' changed" in str(e.value.steps), e.value.steps
    assert drops == {"pyramid"} and len(AFTER_CALLS) <= 1 and m.pyramid.levels is None
    assert sum("torch.export" in s for s in e.value.steps) == 1, e.value.steps  # no second, static-size try
    amp = ampfx.convert(m, "bf16", example_inputs=(torch.randn(2, 16),))
    x = torch.randn(2, 16)
    torch.testing.assert_close(amp(x), m(x), atol=0.1, rtol=0.05)


def test_modules_of_a_class_export_found_unfaithful_are_not_exported_again_in_that_mode():
    """After the root's export stopped at ``first``'s cache, neither ``first`` nor ``second`` (the same
    class) is exported again in eval mode: their regions say why, and the model's caches work as in eager."""
    torch.manual_seed(0)
    m, x = _TwoCaches().eval(), torch.randn(2, 16)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    regions = {r.path: r for r in amp.ampfx_report.parts}
    for path in ("first", "second"):
        assert any("torch.export not tried: an earlier export in this training mode" in s
                   for s in regions[path].steps), regions[path].steps
    assert rel_err(amp(x), m(x)) < 0.02
    assert all(type(v) is torch.Tensor for v in m.first.cache.values())


@pytest.mark.skipif(not hasattr(torch.fx.config, "do_not_emit_stack_traces"), reason="this torch records them always")
@pytest.mark.parametrize("before", [False, True])
def test_export_records_no_stack_traces_and_leaves_torchs_setting_as_found(before, monkeypatch):
    """Each node's Python stack took a tenth of an export's time; no pass reads it. The switch is
    torch's global config: it is set for the export only."""
    from ampfx.capture import export
    from ampfx.inputs import ExampleInputs
    monkeypatch.setattr(torch.fx.config, "do_not_emit_stack_traces", before)
    cap = export.capture(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), ExampleInputs.of((torch.randn(2, 4),)))
    assert not [n for n in cap.graph.nodes if n.meta.get("stack_trace")]
    assert torch.fx.config.do_not_emit_stack_traces is before


def test_whole_dimension_slices_export_records_are_left_out():
    """``x[:, t]`` records ``aten.slice(x, 0, 0, <max>)`` under export, where eager indexing records
    nothing; its backward writes a zero tensor of ``x``'s size. The graph reads ``x`` instead (a note
    says how many); partial and strided slices stay, and values and gradients are the model's."""
    from ampfx.capture import export
    from ampfx.inputs import ExampleInputs

    class Index(nn.Module):
        def forward(self, x):
            return x[:, 1, :, None] * 2 + x[:, :2].sum() + x[1:, ::2].sum()

    x = torch.randn(3, 4, 5, requires_grad=True)
    cap = export.capture(Index(), ExampleInputs.of((x,)))
    slices = [n.args[1:] for n in cap.graph.nodes if n.target is torch.ops.aten.slice.Tensor]
    assert sorted(slices) == [(0, 1, sys.maxsize), (1, 0, 2), (1, 0, sys.maxsize, 2)]
    assert "dropped export's whole-dimension slices (3)" in cap.notes
    amp = ampfx.convert(Index(), "bf16", example_inputs=(x,), tracer="export")
    want = torch.autograd.grad(Index()(x).sum(), x)[0]
    assert torch.equal(torch.autograd.grad(amp(x).float().sum(), x)[0], want)


def test_export_is_not_tried_where_the_models_own_run_fills_a_cache(monkeypatch):
    """torch.fx needs leaves, so the ladder would try torch.export next; in eval mode the real run that
    checks the fx graph has already filled both caches, which export would stop at: it is not tried
    (it took 1.5 s to reach EfficientViT-M0's first cache). The train-mode conversion still exports
    (no cache there), and both modes compute what the model computes."""
    from ampfx.capture import export
    calls = []
    real = export._export
    monkeypatch.setattr(export, "_export", lambda model, *a: calls.append(model.training) or real(model, *a))
    torch.manual_seed(0)
    m, x = _LeafCaches().train(), torch.randn(2, 16)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,))
    assert calls == [True] and amp.ampfx_report.parts[0].method == "export"
    root = amp.mode_module(False).ampfx_report.parts[0]
    assert root.method == "fx" and any("torch.export not tried: the model's own run shows" in s and "'first'" in s
                                       and "attribute 'cache' changed in place" in s for s in root.steps), root.steps
    assert rel_err(amp(x), m(x)) < 0.02
    amp.eval(), m.eval()
    assert rel_err(amp(x), m(x)) < 0.02 and all(type(v) is torch.Tensor for v in m.first.cache.values())


class _Counts(nn.Module):
    """Sets a Python attribute on every call: no graph repeats it, so the module keeps its Python and
    its children are converted on their own."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x)


@pytest.mark.parametrize("kind", ["prune", "old_weight_norm"])
def test_a_pruned_or_weight_normed_module_exported_on_its_own_recomputes_its_weight(kind):
    """A pruning / weight_norm pre-hook sets ``weight`` from ``weight_orig`` (``weight_g``, ``weight_v``)
    on every call. Exported without it, the weight was a constant of the graph: no gradient reached the
    parameters, and after an optimizer step the converted module still used the old weight."""
    from torch.nn.utils import prune
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    if kind == "prune":
        prune.l1_unstructured(lin, "weight", 0.5)
    else:
        with pytest.warns(FutureWarning):
            nn.utils.weight_norm(lin)
    m, x = _Counts(lin), torch.randn(3, 8)
    amp = ampfx.convert(m, "bf16", example_inputs=(x,), tracer="export")
    assert {r.path: r.method for r in amp.ampfx_report.parts}["inner"] == "export"
    amp(x).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in lin.parameters())
    with torch.no_grad():
        for p in lin.parameters():
            p.mul_(-2)
    assert rel_err(amp(x), m(x)) < 0.02

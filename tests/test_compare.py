"""ampfx.tools.compare and `ampfx compare`: ampfx and torch.autocast measured against float32 on one batch."""
import importlib
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.tools.compare import NOISE, Comparison, ParamError, _autocast_on
from ampfx.errors import ArgumentError, ExampleInputsError
from ampfx.ui.cli import main
from support.models import MLP  # tests/support/models.py: 12 -> 32 -> 32 -> 5, gelu, a tanh residual




class Block(nn.Module):
    """A pre-norm transformer block: attention and an MLP on a residual stream."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Noisy(nn.Module):
    """Dropout and batch norm in training mode: each run draws masks and updates statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop, self.bn, self.out = nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(self.bn(self.drop(F.relu(self.fc(x)))))


def _ce(y):
    return F.cross_entropy(y, torch.arange(y.shape[0]) % y.shape[1])


def _norm_rel(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm())


def _grads(model, run, context=None):
    """Gradients of ``model``'s parameters after ``run()`` and the loss (under ``context``) and
    backward, by name."""
    model.zero_grad(set_to_none=True)
    with context or torch.autocast("cpu", enabled=False):
        out = run()
        loss = _ce(out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def test_errors_match_a_hand_computation():
    """Output and per-parameter gradient errors are ||x - x32|| / ||x32|| for ampfx and for
    autocast, as computed by hand; the ratio is ampfx / autocast."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 12)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    c = ampfx.compare(model, amp, (x,), _ce, top=100)
    y32, g32 = _grads(model, lambda: model(x))
    ya, ga = _grads(model, lambda: amp(x))
    yc, gc = _grads(model, lambda: model(x), torch.autocast("cpu", dtype=torch.bfloat16))  # loss inside autocast
    assert c.dtype == torch.bfloat16 and c.device == "cpu" and c.n_params == 6
    assert c.outputs[0].name == "output"
    assert c.outputs[0].ampfx == pytest.approx(_norm_rel(ya, y32), rel=1e-9)
    assert c.outputs[0].autocast == pytest.approx(_norm_rel(yc, y32), rel=1e-9)
    for p in c.params:
        assert p.ampfx == pytest.approx(_norm_rel(ga[p.name], g32[p.name]), rel=1e-9)
        assert p.autocast == pytest.approx(_norm_rel(gc[p.name], g32[p.name]), rel=1e-9)
        assert p.ratio == pytest.approx(p.ampfx / p.autocast)
        assert p.norm32 == pytest.approx(float(g32[p.name].double().norm()))
    flat = lambda g: torch.cat([t.flatten() for t in g.values()])  # noqa: E731
    assert c.gradient.ampfx == pytest.approx(_norm_rel(flat(ga), flat(g32)), rel=1e-9)
    assert 0 < c.gradient.ampfx < 0.05 and 0 < c.gradient.autocast < 0.05


def test_default_loss_is_the_mean_of_the_output():
    """Without loss_fn the loss is the output's mean (as calibration's default)."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 12)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    c = ampfx.compare(model, amp, x, autocast=False, sensitivity=False)
    model(x).mean().backward()
    g32 = model.fc1.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    amp(x).mean().backward()
    want = _norm_rel(model.fc1.weight.grad, g32)
    model.zero_grad(set_to_none=True)
    assert next(p for p in c.params if p.name == "fc1.weight").ampfx == pytest.approx(want, rel=1e-9)
    assert all(p.autocast is None for p in c.params) and "autocast=False" in c.autocast_error


def test_parameters_are_listed_worst_first_and_top_limits_them():
    """params is sorted by ampfx's gradient error, largest first, and holds the top N of all."""
    torch.manual_seed(1)
    model, x = Block(), torch.randn(2, 5, 16)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    full = ampfx.compare(model, amp, x, top=100)
    errors = [p.ampfx for p in full.params]
    assert errors == sorted(errors, reverse=True) and len(errors) == full.n_params > 3
    short = ampfx.compare(model, amp, x, top=3)
    assert [p.name for p in short.params] == [p.name for p in full.params[:3]] and short.n_params == full.n_params


def test_transformer_block_figures_render_and_serialise():
    """The table names the worst parameter and both columns; to_dict is JSON with the same figures."""
    torch.manual_seed(2)
    model, x = Block(), torch.randn(2, 5, 16)
    amp = ampfx.convert(model, "fp16", example_inputs=(x,))
    c = ampfx.compare(model, amp, x, top=4)
    text = c.table(width=140)
    assert str(c) == text and c.params[0].name in text and "autocast (cpu)" in text and "float16" in text
    data = json.loads(json.dumps(c.to_dict()))
    assert data["dtype"] == "float16" and len(data["params"]) == 4 and data["n_params"] == c.n_params
    assert data["params"][0] == {"name": c.params[0].name, "ampfx": c.params[0].ampfx,
                                 "autocast": c.params[0].autocast, "ratio": c.params[0].ratio,
                                 "norm32": c.params[0].norm32, "noise": False}
    with pytest.raises(Exception):
        c.params[0].ampfx = 0.0  # frozen records


def test_the_model_is_left_as_it_was():
    """Gradients (the same .grad objects, same values), buffers (batch-norm statistics and
    counter), parameters, training flags and the random state are as before the call."""
    torch.manual_seed(3)
    model, x = Noisy(), torch.randn(6, 8)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    model.fc.weight.grad = torch.full_like(model.fc.weight, 7.0)
    grad = model.fc.weight.grad
    model.bn.eval()  # a submodule in its own mode stays so
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    ampfx.compare(model, amp, x)
    assert model.fc.weight.grad is grad and bool((grad == 7).all())
    assert all(p.grad is None for n, p in model.named_parameters() if n != "fc.weight")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == flags and torch.equal(rng, torch.get_rng_state())


def test_dropout_runs_share_their_masks_and_two_calls_agree():
    """Every run starts from the same random state, so dropout masks match (the output error is
    a rounding error, not a different mask) and a second call gives the same figures."""
    torch.manual_seed(4)
    model, x = Noisy(), torch.randn(32, 8)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    first, second = ampfx.compare(model, amp, x), ampfx.compare(model, amp, x)
    assert first.to_dict() == second.to_dict()
    assert first.outputs[0].ampfx < 0.05 and first.outputs[0].autocast < 0.05  # another mask: about 1


class Counter(nn.Module):
    """A buffer updated in forward and read by it (as a step counter or running statistic)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x) * self.calls


def test_a_device_whose_dropout_masks_differ_by_dtype_gets_a_note(monkeypatch):
    """Where dropout would draw other masks in the low dtype (checked on the device), a model that
    draws random numbers gets a note saying its errors include different masks; one that draws
    none gets no such note."""
    compare_module = importlib.import_module("ampfx.tools.compare")  # ampfx.tools.compare is the function
    assert compare_module._dropout_masks_match("cpu", torch.bfloat16)  # CPU: same masks
    monkeypatch.setattr(compare_module, "_dropout_masks_match", lambda device, dtype: False)
    torch.manual_seed(4)
    model, x = Noisy(), torch.randn(8, 8)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    assert any("other masks" in n for n in ampfx.compare(model, amp, x).notes)
    model.eval()
    assert not any("other masks" in n for n in ampfx.compare(model, amp, x).notes)


def test_compare_measures_gradients_under_no_grad():
    """A caller's torch.no_grad() does not turn the gradients off: compare needs them."""
    torch.manual_seed(11)
    model, x = MLP(), torch.randn(4, 12)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    with torch.no_grad():
        c = ampfx.compare(model, amp, x)
    assert c.gradient is not None and c.gradient.ampfx > 0 and c.params[0].ampfx is not None


def test_buffers_do_not_leak_between_runs():
    """Each run starts from the model's buffers as they were: a buffer counting calls reads 1 in
    all three runs (2 or 3 would be an output error of 1 or more), and reads 0 afterwards."""
    torch.manual_seed(5)
    model, x = Counter(), torch.randn(3, 4)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    c = ampfx.compare(model, amp, x)
    assert float(model.calls) == 0 and c.outputs[0].ampfx < 0.05 and c.outputs[0].autocast < 0.05


def test_a_gradient_of_about_zero_is_marked_and_listed_last():
    """A parameter whose float32 gradient is rounding noise (the last layer after batch norm with a
    mean loss) is marked noise and listed after the meaningful ones, with a note."""
    torch.manual_seed(6)
    model, x = Noisy().eval(), torch.randn(16, 8)
    model.drop.p = 0.0
    model.train()
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    c = ampfx.compare(model, amp, x, top=100)
    biggest = max(p.norm32 for p in c.params)
    assert [p.noise for p in c.params] == [p.norm32 <= NOISE * biggest for p in c.params]
    assert any(p.noise for p in c.params) and not any(p.noise for p in c.params[:1])
    assert [p.noise for p in c.params] == sorted(p.noise for p in c.params)
    assert any("about 0" in n for n in c.notes) and "~0" in c.table()


class AutocastRefuser(nn.Module):
    """Fails under autocast, as nn.LSTM does on CPU (oneDNN has no primitive for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu"):  # read while tracing (autocast off): not in the graph
            raise RuntimeError("this layer has no autocast kernel")
        return self.fc(x)


def test_autocast_failing_is_reported_not_raised():
    """autocast's run failing gives n/a figures and the error, and ampfx's figures still stand."""
    torch.manual_seed(7)
    model, x = AutocastRefuser(), torch.randn(3, 4)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    c = ampfx.compare(model, amp, x)
    assert "no autocast kernel" in c.autocast_error and any("no autocast kernel" in n for n in c.notes)
    assert c.outputs[0].autocast is None and c.outputs[0].ampfx is not None and c.outputs[0].ratio is None
    assert all(p.autocast is None and p.ampfx is not None for p in c.params) and "n/a" in c.table()


def test_autocast_that_torch_turns_off_is_an_error_not_a_perfect_score():
    """torch disables autocast for a dtype the device lacks (with a warning, running float32):
    that is refused, or autocast's figures would read 0."""
    with pytest.raises(RuntimeError, match="turned autocast off"):
        with _autocast_on("cpu", torch.float64):
            pass


def test_inference_mode_gradients_are_not_available():
    """A mode='inference' conversion holds low copies without gradients: their figures are n/a."""
    torch.manual_seed(8)
    model, x = MLP(), torch.randn(4, 12)
    inf = ampfx.convert(model, "bf16", example_inputs=(x,), mode="inference")
    c = ampfx.compare(model, inf, x, top=100)
    assert c.params[-1].ampfx is None and any("mode='inference'" in n for n in c.notes)
    assert c.outputs[0].ampfx < 0.05


def test_nodes_are_ranked_by_ampfx_sensitivity():
    """The real ampfx.sensitivity ranks the converted module's low nodes: names from its report, worst
    first by gradient or output error, at most ``top``; the model keeps no gradients."""
    torch.manual_seed(9)
    model, x = MLP(), torch.randn(4, 12)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    c = ampfx.compare(model, amp, x, top=2)
    low = {r.node for r in amp.ampfx_report.low()}
    assert 1 <= len(c.nodes) <= 2 and {n.node for n in c.nodes} <= low, (c.nodes, c.notes)
    assert all(p.grad is None for p in model.parameters()) and "nodes most responsible" in c.table()


def test_nodes_come_from_ampfx_sensitivity_where_it_exists(monkeypatch):
    """With ampfx.sensitivity, its worst-first records fill nodes (top of them); the gradients it
    leaves on the parameters are cleaned up. Without it, a note says so."""
    torch.manual_seed(9)
    model, x = MLP(), torch.randn(4, 12)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    monkeypatch.setattr(ampfx, "sensitivity", None)  # an ampfx without it (a deleted name loads again on use)
    no_nodes = ampfx.compare(model, amp, x)
    assert no_nodes.nodes == () and any("sensitivity" in n for n in no_nodes.notes)

    def fake(amp_, batch, loss_fn=None, top=10, **options):
        amp_(batch).sum().backward()
        return [{"node": f"n{i}", "op": "linear", "module": f"fc{i}", "out_err": 0.1 / (i + 1), "grad_err": None}
                for i in range(5)]
    monkeypatch.setattr(ampfx, "sensitivity", fake, raising=False)
    c = ampfx.compare(model, amp, x, top=2)
    assert [n.node for n in c.nodes] == ["n0", "n1"] and c.nodes[1].out_err == pytest.approx(0.05)
    assert all(p.grad is None for p in model.parameters()) and "nodes most responsible" in c.table()
    assert ampfx.compare(model, amp, x, sensitivity=False).notes == ()


def _other_amp():
    return ampfx.convert(MLP(), "bf16")


@pytest.mark.parametrize("make,error,needle", [
    (lambda m, a, x: (m, m, x), ArgumentError, "not a module ampfx.convert returned"),
    (lambda m, a, x: (m, _other_amp(), x), ArgumentError, "not converted from this model"),
    (lambda m, a, x: (m.fc1, a, x), ArgumentError, "not converted from this model"),
    (lambda m, a, x: ("model", a, x), ArgumentError, "takes the float32 model first"),
    (lambda m, a, x: (m, a, torch.randn(4, 7)), ExampleInputsError, "does not run on batch"),
    (lambda m, a, x: (m, a, None), ArgumentError, "batch=None"),
    (lambda m, a, x: (m, a, x, lambda y: y), ArgumentError, "loss_fn returned"),
])
def test_bad_arguments_raise_clear_errors(make, error, needle):
    """Each bad argument raises an ampfx error naming it and the fix; the model keeps its gradients."""
    torch.manual_seed(10)
    model, x = MLP(), torch.randn(4, 12)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    with pytest.raises(error, match=needle):
        ampfx.compare(*make(model, amp, x))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("top", [0, -1, 2.5, True])
def test_top_must_be_a_positive_count(top):
    model = MLP()
    with pytest.raises(ArgumentError, match="top="):
        ampfx.compare(model, ampfx.convert(model, "bf16"), torch.randn(2, 12), top=top)


def test_amp_and_its_model_are_always_in_one_mode():
    """amp.eval() is the model's eval() (the converted module is a view of the model): the two runs are always
    made in the same mode, and the comparison says which."""
    model, x = Noisy(), torch.randn(4, 8)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    amp.eval()
    assert not model.training
    ampfx.compare(model, amp, x)


def test_comparison_records_are_public():
    assert ampfx.Comparison is Comparison and ampfx.ParamError is ParamError
    assert ParamError("w", 0.0, 0.0).ratio == 1.0 and math.isinf(ParamError("w", 1e-3, 0.0).ratio)
    assert ParamError("w", None, 0.1).ratio is None


def test_cli_prints_the_table_and_writes_json(capsys, tmp_path):
    """`ampfx compare` converts, prints both tables and writes the figures as JSON."""
    out = tmp_path / "cmp.json"
    assert main(["compare", "tests/support/models.py:MLP", "--input", "4,12", "--top", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gradient error vs float32" in printed and "autocast (cpu)" in printed and "fc" in printed
    data = json.loads(out.read_text())
    assert data["dtype"] == "bfloat16" and len(data["params"]) == 2 and data["n_params"] == 6
    assert main(["compare", "tests/support/models.py:MLP", "--input", "4,12", "--top", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == data  # seeded: the same model and inputs


@pytest.mark.parametrize("argv,needle", [
    (["compare", "tests/support/models.py:MLP"], "give at least one --input"),
    (["compare", "tests/support/models.py:MLP", "--input", "4,13"], "does not run"),
    (["compare", "tests/support/models.py:Missing", "--input", "4,12"], "has no attribute 'Missing'"),
])
def test_cli_errors_name_the_bad_argument(capsys, argv, needle):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_a_plan_with_no_gemm_low_is_said_beside_its_figures():
    """Rule: where ampfx kept every GEMM float32 (a break-even above the model's GEMMs), compare's notes say so, so
    that an error of about float32's is not read as bfloat16 done well."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 12)
    with pytest.warns(UserWarning, match="no GEMM runs in bfloat16"):
        amp = ampfx.convert(model, "bf16", example_inputs=(x,), gemm_min_flops=10 ** 9)
    c = ampfx.compare(model, amp, (x,), _ce, sensitivity=False)
    assert any("has no GEMM in the low dtype" in n and "cost:small-gemm" in n for n in c.notes)
    assert "no GEMM in the low dtype" in c.table()
    fine = ampfx.compare(model, ampfx.convert(model, "bf16", example_inputs=(x,)), (x,), _ce, sensitivity=False)
    assert not any("no GEMM" in n for n in fine.notes)

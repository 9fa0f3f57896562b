"""ampfx.ui.plots: the magnitudes it collects are right, its loss scale is safe, its figures show what they say."""
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("matplotlib")
from hypothesis import given, settings, strategies as st  # noqa: E402

from ampfx.ui import plots  # noqa: E402
from ampfx.ui.plots import collect_magnitudes, loss_scale_plot, range_plot, record_loss_scale, suggest_loss_scale  # noqa: E402

FP16_MAX = 65504.0


def identity_linear(n: int) -> nn.Linear:
    lin = nn.Linear(n, n)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(n))
        lin.bias.zero_()
    return lin


def tiny_loss_run(scale: float = 1e-9):
    """An MLP whose loss is multiplied by ``scale``; returns its magnitudes and every activation gradient."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    x, y = torch.randn(64, 16), torch.randn(64, 8)
    loss_fn = lambda out, target: F.mse_loss(out, target) * scale  # noqa: E731
    grads = []

    def keep_grad(module, args, out):
        out.register_hook(grads.append)

    hooks = [m.register_forward_hook(keep_grad) for m in net]
    loss_fn(net(x), y).backward()
    for h in hooks:
        h.remove()
    net.zero_grad(set_to_none=True)
    return collect_magnitudes(net, (x, y), loss_fn), torch.cat([g.abs().flatten() for g in grads])


# ----------------------------------------------------------------------------- collection

@pytest.mark.parametrize("c, below_sub, below_norm, above", [
    (1e-9, 1.0, 1.0, 0.0),          # under 2**-24: every gradient becomes zero in fp16
    (2.0**-20, 0.0, 1.0, 0.0),      # subnormal in fp16
    (1.0, 0.0, 0.0, 0.0),
    (1e5, 0.0, 0.0, 1.0),           # over 65504: inf
])
def test_fractions_of_known_constant_gradients(c, below_sub, below_norm, above):
    """loss = c * sum(relu(linear(x))): every nonzero activation gradient is exactly c."""
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    x = torch.randn(16, 8)
    mags = collect_magnitudes(net, x, lambda out: out.sum() * c)
    g = mags["summary"]["gradients"]
    assert (g["below_subnormal"], g["below_normal"], g["above_max"]) == (below_sub, below_norm, above)
    inactive = int((net[0](x) <= 0).sum())
    assert mags["gradients"]["0"]["zeros"] == inactive          # relu blocks these
    assert mags["gradients"]["1"]["zeros"] == 0
    assert g["nonzero"] == 2 * x.numel() - inactive
    assert g["max"] == pytest.approx(c)


def test_fractions_of_known_activations():
    """An identity Linear passes the input through: values on both sides of each limit (the limits are in range)."""
    x = torch.tensor([[7e4, 2.0**-30, 2.0**-20, 1.0, 0.0, 2.0**-24, 2.0**-14, FP16_MAX]])
    mags = collect_magnitudes(nn.Sequential(identity_linear(8)), x, lambda out: out.sum())
    a = mags["summary"]["activations"]
    assert (a["nonzero"], a["zeros"], a["count"]) == (7, 1, 8)
    assert (a["below_subnormal"], a["below_normal"], a["above_max"]) == (1 / 7, 3 / 7, 1 / 7)
    assert a["zero_fraction"] == 1 / 8
    assert a["max"] == 7e4
    bf16 = plots.summarize(mags["total"]["activations"], torch.bfloat16)
    assert (bf16["below_subnormal"], bf16["below_normal"], bf16["above_max"]) == (0.0, 0.0, 0.0)


def test_tiny_loss_fractions_match_an_independent_count():
    mags, grads = tiny_loss_run(1e-9)
    nonzero = grads[grads != 0]
    g = mags["summary"]["gradients"]
    assert g["nonzero"] == nonzero.numel()
    assert g["below_subnormal"] == pytest.approx(float((nonzero < 2.0**-24).float().mean()))
    assert g["below_normal"] == pytest.approx(float((nonzero < 2.0**-14).float().mean()))
    assert g["below_subnormal"] > 0.9                       # most would become zero in fp16
    assert g["max"] == pytest.approx(float(grads.max()))
    assert sum(int(s["hist"].sum()) for s in mags["gradients"].values()) == nonzero.numel()


def test_collecting_leaves_parameter_grads_and_buffers_alone():
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    collect_magnitudes(net, (torch.randn(3, 4), torch.randn(3, 1)), F.mse_loss)
    assert all(p.grad is None for p in net.parameters())
    assert net[1].running_mean.eq(0).all() and net[1].num_batches_tracked == 0
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    assert set(collect_magnitudes(net, (torch.randn(3, 4), torch.randn(3, 1)), F.mse_loss)["weight_gradients"]) == {
        "0.weight", "0.bias", "2.weight", "2.bias"}


def test_a_module_called_twice_accumulates():
    lin = identity_linear(4)

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(self.lin(x))

    mags = collect_magnitudes(Twice(), torch.randn(2, 4), lambda out: out.sum())
    assert mags["activations"]["lin"]["count"] == 2 * 8
    assert mags["gradients"]["lin"]["count"] == 2 * 8


def test_by_op_records_functions_too():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(x + self.lin(x))

    model, x = Residual(), torch.randn(3, 4)
    by_op = collect_magnitudes(model, x, lambda out: out.sum(), by="op")
    assert set(by_op["gradients"]) == {"lin", "add", "relu"}
    assert set(collect_magnitudes(model, x, lambda out: out.sum())["gradients"]) == {"lin"}


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="by="):
        collect_magnitudes(nn.Linear(2, 2), torch.randn(1, 2), lambda o: o.sum(), by="layer")
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="requires grad"):
        collect_magnitudes(frozen, torch.randn(1, 2), lambda o: o.sum())


# ----------------------------------------------------------------------------- loss scale

@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=1e-30, max_value=1e6))
def test_suggested_scale_is_the_largest_safe_power_of_two(g):
    s = suggest_loss_scale(g)
    assert s == 2.0 ** round(math.log2(s))
    assert g * s < FP16_MAX <= g * s * 2


@pytest.mark.parametrize("g, scale", [(1.0, 2.0**15), (2.0**-10, 2.0**25), (FP16_MAX, 0.5), (FP16_MAX / 2, 1.0)])
def test_suggested_scale_at_powers_of_two(g, scale):
    assert suggest_loss_scale(g) == scale


def test_suggested_scale_for_bf16_and_for_zero_gradients():
    top = torch.finfo(torch.bfloat16).max
    s = suggest_loss_scale(1.0, torch.bfloat16)
    assert s < top <= 2 * s
    assert suggest_loss_scale(0.0) is None


def test_suggested_scale_from_magnitudes_covers_weight_gradients_and_rescues_tiny_gradients():
    mags, _ = tiny_loss_run(1e-9)
    biggest = max(mags["total"]["gradients"]["max"], mags["total"]["weight_gradients"]["max"])
    s = suggest_loss_scale(mags)
    assert biggest * s < FP16_MAX <= biggest * s * 2
    assert plots.flushed_after_scale(mags, 1.0) == mags["summary"]["gradients"]["below_subnormal"]
    assert plots.flushed_after_scale(mags, s) < 0.01                 # scaled, almost none flush


def test_record_loss_scale_marks_skipped_steps():
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    log = None
    for g in (1.0, float("inf"), 1.0, 1.0, float("nan"), 1.0):
        opt.zero_grad()
        scaler.scale((w * g).sum()).backward()
        scaler.step(opt)
        log = record_loss_scale(scaler, log)
    assert log["scales"] == [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**10, 2.0**9]
    assert log["skipped"] == [1, 4]


# ----------------------------------------------------------------------------- figures

def vlines(ax):
    """x position of each labelled vertical line, by label."""
    return {ln.get_label(): ln.get_xdata()[0] for ln in ax.lines if not ln.get_label().startswith("_")}


def test_range_plot_fp16_shows_the_range_and_the_loss_scale():
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    mags, _ = tiny_loss_run(1e-9)
    fig = range_plot(mags)
    assert plt.get_fignums() == before                      # not a pyplot figure: nothing to show or leak
    act, grad = fig.axes
    assert (act.get_title(), grad.get_title()) == ("activations", "activation gradients")
    assert "fp16" in fig.get_suptitle()
    for ax in (act, grad):
        assert vlines(ax) == {"fp16 smallest subnormal $2^{-24}$": -24, "fp16 smallest normal $2^{-14}$": -14,
                              "fp16 max 65504": pytest.approx(math.log2(FP16_MAX))}
    text = "\n".join(t.get_text() for t in grad.texts)
    frac = mags["summary"]["gradients"]["below_subnormal"]
    assert f"{100 * frac:.3g}% of nonzero gradients < $2^{{-24}}$: zero in fp16" in text
    k = round(math.log2(suggest_loss_scale(mags)))
    assert f"loss scale $2^{{{k}}}$" in text
    legend = [t.get_text() for t in grad.get_legend().get_texts()]
    assert f"gradients × loss scale $2^{{{k}}}$" in legend


def test_range_plot_bf16_uses_its_own_range_and_needs_no_scale():
    mags, _ = tiny_loss_run(1e-9)
    fig = range_plot(mags, "bf16", log_y=True)
    fi = torch.finfo(torch.bfloat16)
    act, grad = fig.axes
    assert sorted(vlines(grad).values()) == [-133, -126, pytest.approx(math.log2(fi.max))]
    assert math.log2(fi.smallest_normal) == -126
    assert grad.get_yscale() == "log"
    assert "no loss scale needed" in "\n".join(t.get_text() for t in grad.texts)
    assert not any("loss scale" in t.get_text() for t in grad.get_legend().get_texts())


def test_loss_scale_plot_draws_scales_on_a_log2_axis_with_skips_marked():
    scales = [2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**15]
    fig = loss_scale_plot(scales, skipped=[0, 3], suggested=2.0**14)
    (ax,) = fig.axes
    assert ax.get_title() == "GradScaler loss scale"
    assert ax.get_yscale() == "log" and ax.yaxis.get_transform().base == 2
    curve, skips, suggested = ax.lines
    assert list(curve.get_ydata()) == scales
    assert list(skips.get_xdata()) == [0, 3] and list(skips.get_ydata()) == [2.0**16, 2.0**16]
    assert "2 of 5" in skips.get_label()
    assert list(suggested.get_ydata()) == [2.0**14, 2.0**14]
    mask = loss_scale_plot(scales, skipped=[True, False, False, True, False])
    assert list(mask.axes[0].lines[1].get_xdata()) == [0, 3]
    assert len(loss_scale_plot(scales).axes[0].lines) == 1


def test_figures_are_written_only_when_given_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mags, _ = tiny_loss_run(1e-9)
    range_plot(mags)
    loss_scale_plot([1.0, 2.0])
    assert list(tmp_path.iterdir()) == []
    range_plot(mags, path=tmp_path / "range.png")
    loss_scale_plot([1.0, 2.0], path=str(tmp_path / "scale.png"))
    for name in ("range.png", "scale.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_importing_ampfx_and_plots_does_not_import_matplotlib():
    code = "import sys, ampfx, ampfx.ui.plots; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_synthetic_loss_and_tuple_inputs_as_the_cli_uses_them():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 10), nn.Linear(3, 10)

        def forward(self, x, z):
            return self.a(x) + self.b(z)

    mags = collect_magnitudes(TwoInputs(), ((torch.randn(5, 4), torch.randn(5, 3)), None), plots.synthetic_loss("ce"))
    assert set(mags["gradients"]) == {"a", "b"} and mags["loss"] > 0
    text = plots.describe(mags)
    assert text.splitlines()[0] == "fp16: zero below 2**-24, subnormal below 2**-14, inf above 65504"
    assert text.splitlines()[-1] == "no gradient becomes zero in fp16: no loss scale needed"
    tiny, _ = tiny_loss_run(1e-9)
    k = round(math.log2(suggest_loss_scale(tiny)))
    assert f"loss scale 2**{k} keeps" in plots.describe(tiny).splitlines()[-1]
    with pytest.raises(ValueError, match="ce, mse"):
        plots.synthetic_loss("hinge")


def test_cli_plot_command_once_it_exists(tmp_path, capsys):
    """`ampfx plot` (when cli.py has it): prints describe() and writes the PNG."""
    from ampfx.ui import cli

    try:
        cli.build_parser().parse_args(["plot", "m.py:build"])
    except SystemExit:
        pytest.skip("cli.py has no plot command")
    (tmp_path / "m.py").write_text("import torch.nn as nn\n"
                                   "def build():\n    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))\n")
    out = tmp_path / "range.png"
    assert cli.main(["plot", f"{tmp_path / 'm.py'}:build", "--input", "32,8", "--dtype", "fp16", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("fp16: zero below 2**-24")
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["plot", f"{tmp_path / 'm.py'}:build"]) == 2
    assert "--input" in capsys.readouterr().err

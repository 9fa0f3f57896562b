"""``passes/calibrate.py``: nodes whose calibration statistics overflow the low dtype
become DENY float32; ``record`` fills the statistics; ``loss_scale_advice`` reads them."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampfx import Category, meta
from ampfx.passes import calibrate, paint
from ampfx.passes.calibrate import Stats, loss_scale_advice

from .helpers import graph, node, rec, run

CALIBRATE = dict(upto=calibrate.calibrate)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.softmax(torch.tanh(F.linear(x, self.w)) + 1, -1)


def calibrated(stats, **options):
    """``Net`` traced, ``stats`` set on its nodes as calibration would, passes run to ``upto``."""
    gm = graph(Net())
    for name, s in stats.items():
        node(gm, name).meta[meta.CALIB] = s
    options.setdefault("upto", calibrate.calibrate)
    return run(gm, **options)[0]


def test_a_node_whose_output_overflowed_becomes_deny_float32():
    """max |output| 1e5 is beyond float16's 65504: the ALLOW linear becomes DENY, float32,
    rule "calibration:overflow"; nodes without statistics keep their table rule."""
    gm = calibrated({"linear": Stats(max_out=1e5)}, dtype=torch.float16)
    d = rec(gm, "linear")
    assert (d.category, d.dtype, d.rule) == (Category.DENY, torch.float32, "calibration:overflow")
    assert "output" in d.reason
    assert (rec(gm, "tanh").category, rec(gm, "tanh").rule) == (Category.INFER, "table")


def test_a_gradient_overflow_counts_too():
    """An overflowing gradient (max |grad| 1e6) keeps the node float32, and the reason says gradient."""
    gm = calibrated({"tanh": Stats(max_out=1.0, max_grad=1e6)}, dtype=torch.float16)
    d = rec(gm, "tanh")
    assert (d.category, d.rule) == (Category.DENY, "calibration:overflow") and "gradient" in d.reason


@pytest.mark.parametrize("margin,overflows", [(2.0, True), (1.0, False)])
def test_the_safety_margin_divides_the_dtypes_maximum(margin, overflows):
    """40000 is below float16's 65504 but above 65504 / 2: it overflows with the default
    margin 2 and not with ``calibration_margin=1``."""
    gm = calibrated({"linear": Stats(max_out=4e4)}, dtype=torch.float16, calibration_margin=margin)
    assert (rec(gm, "linear").rule == "calibration:overflow") is overflows


def test_bfloat16_holds_what_overflows_float16():
    """1e5 fits bfloat16's range: under bfloat16 the same statistics change nothing."""
    gm = calibrated({"linear": Stats(max_out=1e5)}, dtype=torch.bfloat16)
    assert (rec(gm, "linear").category, rec(gm, "linear").rule) == (Category.ALLOW, "table")


def test_gradient_underflow_is_flagged_without_changing_the_decision():
    """More than 1% of gradient values below the smallest subnormal: the reason says so,
    the category and rule stay."""
    gm = calibrated({"tanh": Stats(max_out=1.0, grad_below_subnormal=0.5)}, dtype=torch.float16)
    d = rec(gm, "tanh")
    assert (d.category, d.rule) == (Category.INFER, "table") and "flagged: 50%" in d.reason


def test_only_paintable_low_candidates_are_changed():
    """A DENY node (softmax) keeps its own rule whatever its statistics."""
    gm = calibrated({"softmax": Stats(max_out=1e9)}, dtype=torch.float16)
    assert (rec(gm, "softmax").category, rec(gm, "softmax").rule) == (Category.DENY, "table")


def test_float32_flows_forward_from_a_calibrated_deny_node():
    """Painting after calibration: the infer ops after an overflowing linear follow it
    into float32 ("paint:deny"), as from any deny op."""
    gm = calibrated({"linear": Stats(max_out=1e5)}, dtype=torch.float16, upto=paint.paint)
    assert [(rec(gm, n).dtype, rec(gm, n).rule) for n in ("linear", "tanh", "add")] == [
        (torch.float32, "calibration:overflow"), (torch.float32, "paint:deny"), (torch.float32, "paint:deny")]


def test_record_stores_the_largest_output_and_gradient_per_node():
    """``record`` runs the float32 graph forward and backward on each batch and keeps the
    maxima per node; parameter gradients are restored afterwards."""
    net = Net()
    gm = graph(net)
    batches = [(torch.full((2, 4), 1.0),), (torch.full((2, 4), 3.0),)]
    seen = calibrate.record(gm, batches, lambda out: (out * 1000).sum(), torch.float16)
    assert seen == 2
    expected = max(float(F.linear(b[0], net.w).detach().abs().max()) for b in batches)
    assert meta.calib(node(gm, "linear")).max_out == pytest.approx(expected)
    assert meta.calib(node(gm, "add")).max_grad > 0
    assert net.w.grad is None


def test_loss_scale_advice_from_the_recorded_gradients():
    """No statistics: no advice. float16 with largest gradient 1000: the largest safe
    static scale is 2**6 (65504 / 1000 = 65.5). bfloat16 needs no scaling."""
    gm = graph(Net())
    assert loss_scale_advice(gm, torch.float16) is None
    node(gm, "linear").meta[meta.CALIB] = Stats(max_out=1.0, max_grad=1000.0)
    assert "2**6 = 64" in loss_scale_advice(gm, torch.float16)
    assert "not needed" in loss_scale_advice(gm, torch.bfloat16)

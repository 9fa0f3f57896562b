"""Calibration, loss-scale advice and overflow hunting (issue: numerics tools)."""
import importlib.util
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ampfx

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "overflow_calibration.py"


def load_example():
    spec = importlib.util.spec_from_file_location("overflow_calibration", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calibration_keeps_the_overflowing_layer_fp32_where_plain_and_autocast_give_inf():
    results = load_example().main()
    assert not results["plain_finite"] and not results["autocast_finite"]
    assert results["calibrated_finite"] and results["grads_finite"] and results["max_error"] < 1e-2


def test_calibration_decision_carries_the_numbers():
    ex = load_example()
    torch.manual_seed(0)
    m = ex.Hot()
    gm = ampfx.convert(m, "fp16", calibrate=[torch.randn(8, 16)], calibrate_loss=ex.loss_fn)
    hot = [r for r in gm.ampfx_report.records if r.module == "hot" and r.op == "linear"][0]
    assert (hot.rule, hot.dtype) == ("calibration:overflow", torch.float32)
    assert "exceeds float16's 65504 / margin 2" in hot.reason
    others = [r for r in gm.ampfx_report.records if r.op == "linear" and r.module != "hot"]
    assert all(r.dtype == torch.float16 for r in others)


def test_calibration_leaves_model_state_and_gradients_alone():
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    stats = m[1].running_mean.clone()
    ampfx.convert(m, "fp16", calibrate=[torch.randn(8, 4)] * 3)
    assert torch.equal(stats, m[1].running_mean) and m[1].num_batches_tracked.item() == 0
    assert all(p.grad is None for p in m.parameters())


def test_loss_scale_advice_for_fp16_and_bf16():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    batches = [torch.randn(16, 8)]
    tiny = lambda y: y.float().mean() * 1e-9  # noqa: E731 - gradients far below float16's subnormals
    rep = ampfx.convert(m, "fp16", calibrate=batches, calibrate_loss=tiny).ampfx_report
    advice = [n for n in rep.notes if n.startswith("loss scaling")][0]
    assert "use torch.amp.GradScaler" in advice and "largest safe static loss scale 2**" in advice
    exponent = int(re.search(r"scale 2\*\*(\d+)", advice).group(1))
    largest = float(re.search(r"largest gradient ([0-9.e+-]+);", advice).group(1))
    assert exponent >= 20 and largest * 2**exponent <= 65504 < largest * 2 ** (exponent + 1) * 1.001
    flagged = [r for r in rep.records if "flagged" in r.reason]
    assert flagged, "nodes losing gradients to underflow are flagged"
    rep = ampfx.convert(m, "bf16", calibrate=batches, calibrate_loss=tiny).ampfx_report
    assert any("not needed for bfloat16" in n for n in rep.notes)


def test_debug_names_the_first_non_finite_node_forward_and_backward():
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        m[2].weight.fill_(4e4)
    x = torch.ones(3, 4) * 10
    amp = ampfx.convert(m, "fp16", example_inputs=(x,))
    with pytest.raises(ampfx.NonFiniteError) as err:
        ampfx.debug(amp)(x)
    e = err.value
    assert e.phase == "forward" and e.op == "linear" and e.module == "2" and e.dtype == torch.float16
    assert "max|x|=" in str(e)
    m2 = nn.Sequential(nn.Linear(4, 4))
    amp2 = ampfx.convert(m2, "fp16", example_inputs=(x,))
    out = ampfx.debug(amp2)(x)
    with pytest.raises(ampfx.NonFiniteError, match="backward"):
        (out * 1e38 * 1e38).sum().backward()


def test_debug_needs_a_converted_graph():
    with pytest.raises(TypeError, match="ampfx.convert"):
        ampfx.debug(nn.Linear(2, 2))

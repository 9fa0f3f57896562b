"""Precision sensitivity (issue #16): ``ampfx.sensitivity`` ranks the nodes whose rounding alone moves
the model, bisecting groups; calibration keeps those over ``sensitivity_threshold`` float32."""
import datetime
import math

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.passes import sensitivity as sens
from conftest import rel


class Carry(nn.Module):
    """``big`` makes values ~1e3; ``add`` puts small increments on them and ``sub`` takes them off:
    rounding ``add`` to the low dtype (spacing 4 or more at 1e3 in bfloat16) loses the increments."""

    def __init__(self, depth=1):
        super().__init__()
        self.a, self.big, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(depth))
        with torch.no_grad():
            self.big.weight.mul_(1e3)
            self.big.bias.fill_(1e3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        big = self.big(x)
        acc = big + h * 0.01
        return self.c((acc - big) * 100)


def batch(n=16):
    return torch.randn(n, 8)


def test_the_precision_critical_node_ranks_first():
    """The carried sum ``add`` is the worst node, by far, and names match the converted report."""
    torch.manual_seed(0)
    model, x = Carry(), batch()
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    s = ampfx.sensitivity(amp, x, threshold=0.0)
    assert s.records[0].node == "add" and s.records[0].score > 0.5
    assert all(r.score < 0.05 for r in s.records[1:])
    low = {(r.node, r.op, r.module) for r in amp.ampfx_report.low()}
    assert {(r.node, r.op, r.module) for r in s.records} <= low
    assert s.candidates == len(low) and len(s) >= len(low) - 2  # threshold 0: each node that moves anything


def test_a_model_is_converted_first_and_named_as_its_conversion():
    """Given the model, sensitivity converts it (dtype, batch as example inputs) and names the same nodes."""
    torch.manual_seed(0)
    model, x = Carry(), batch()
    s = ampfx.sensitivity(model, x, torch.float16, top=1)
    assert [r.node for r in s] == ["add"] and s.dtype == torch.float16
    assert s.converted.ampfx_report.by_node("add").dtype == torch.float16
    assert "add (add)" in str(s)


def test_calibration_keeps_the_sensitive_node_float32_and_the_error_drops():
    """``calibrate=`` batches: ``add`` becomes deny float32 with rule calibration:sensitive (the reason
    gives both errors and the threshold); the output error against float32 drops by orders of magnitude."""
    torch.manual_seed(0)
    model, x = Carry(), batch()
    plain = ampfx.convert(model, "bf16", example_inputs=(x,))
    cal = ampfx.convert(model, "bf16", example_inputs=(x,), calibrate=[batch(), batch()])
    d = cal.ampfx_report.by_node("add")
    assert (d.dtype, d.rule, d.category) == (torch.float32, "calibration:sensitive", ampfx.Category.DENY)
    assert "sensitivity_threshold 0.1" in d.reason and "output by" in d.reason
    assert [r.node for r in cal.ampfx_report.records if r.rule == "calibration:sensitive"] == ["add"]
    with torch.no_grad():
        want = model(x)
        before, after = rel(plain(x), want), rel(cal(x), want)
    assert before > 0.1 and after < before / 100
    assert any("precision sensitivity of" in n for n in cal.ampfx_report.notes)


def test_threshold_off_keeps_overflow_calibration_alone():
    """``sensitivity_threshold=0`` (or the env var ``off``): no precision check, the node stays low."""
    torch.manual_seed(0)
    model, x = Carry(), batch()
    for options in ({"sensitivity_threshold": 0}, {"environ": {"AMPFX_SENSITIVITY_THRESHOLD": "off"}}):
        cal = ampfx.convert(model, "bf16", example_inputs=(x,), calibrate=[x], **options)
        assert cal.ampfx_report.by_node("add").dtype == torch.bfloat16
        assert not any("precision sensitivity" in n for n in cal.ampfx_report.notes)


def test_evaluations_grow_with_log_n_on_a_200_node_graph():
    """~200 low nodes, one sensitive: the bisection takes at most 2 + 2*ceil(log2 n) evaluations
    (the float32 reference, all nodes, then two halves per level), not n."""
    torch.manual_seed(0)
    model, x = Carry(depth=95), batch(4)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    s = ampfx.sensitivity(amp, x)
    assert s.candidates >= 190
    assert [r.node for r in s] == ["add"]
    assert s.evaluations <= 2 + 2 * math.ceil(math.log2(s.candidates))


def test_the_budget_is_respected():
    """An evaluation budget is never exceeded and an unfinished search says so; a tiny time budget too."""
    torch.manual_seed(0)
    model, x = Carry(depth=30), batch(4)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    s = ampfx.sensitivity(amp, x, threshold=0.0, budget=5)
    assert s.evaluations == 5 and not s.complete and "unfinished" in str(s)
    t = ampfx.sensitivity(amp, x, threshold=0.0, budget=datetime.timedelta(microseconds=1))
    assert t.evaluations <= 2 and not t.complete


def test_buffers_grads_and_rng_are_unchanged():
    """Batch-norm statistics, ``.grad`` and the global random state are as before; dropout draws the
    same masks in every evaluation (a model without precision issues has no node over 0.1)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).train()
    x = batch()
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    bufs = [b.clone() for b in model.buffers()]
    amp = ampfx.convert(model, "bf16", example_inputs=(x,))
    state = torch.get_rng_state()
    s = ampfx.sensitivity(amp, x)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(a, b) for a, b in zip(bufs, model.buffers()))
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    assert len(s) == 0 and s.whole.score < 0.1  # were the dropout masks redrawn, errors would be ~1


@pytest.mark.parametrize("kwargs,words", [
    ({"budget": 0}, "budget=0"), ({"budget": -3}, "budget=-3"), ({"budget": 2.5}, "budget=2.5"),
    ({"threshold": -0.1}, "threshold=-0.1"), ({"top": 0}, "top=0"),
])
def test_bad_arguments_raise_clear_errors(kwargs, words):
    with pytest.raises(ampfx.PolicyError, match=words):
        ampfx.sensitivity(nn.Linear(8, 2), batch(), **kwargs)


def test_a_non_module_is_refused():
    with pytest.raises(TypeError, match="give an nn.Module"):
        ampfx.sensitivity(lambda x: x, batch())


def test_inference_mode_and_dtype_mismatch_are_refused():
    model, x = Carry(), batch()
    with pytest.raises(ampfx.PolicyError, match="mode='inference'"):
        ampfx.sensitivity(ampfx.convert(model, "bf16", example_inputs=(x,), mode="inference"), x)
    with pytest.raises(ampfx.PolicyError, match="disagrees"):
        ampfx.sensitivity(ampfx.convert(model, "bf16", example_inputs=(x,)), x, "fp16")


@pytest.mark.parametrize("value", [-1.0, True, "0.1", math.inf])
def test_a_bad_policy_threshold_is_an_error(value):
    with pytest.raises(ampfx.PolicyError, match="sensitivity_threshold"):
        ampfx.Policy(sensitivity_threshold=value)


def test_the_environment_sets_the_threshold():
    from ampfx.policy import from_env
    assert from_env(ampfx.Policy(), {"AMPFX_SENSITIVITY_THRESHOLD": "0.3"}).sensitivity_threshold == 0.3
    with pytest.raises(ampfx.PolicyError, match="AMPFX_SENSITIVITY_THRESHOLD"):
        from_env(ampfx.Policy(), {"AMPFX_SENSITIVITY_THRESHOLD": "lots"})


def test_search_bisects_and_stops_at_top():
    """Two bad items among 64: found both in 2 + 2*2*log2(64) evaluations at most; ``top=1`` stops early."""
    bad = {5, 40}
    evaluate = lambda g: sens.Errors(1.0 if bad & set(g) else 0.0)
    s = sens.search(evaluate, range(64), 0.5, sens.Budget())
    assert sorted(i for i, _ in s.found) == [5, 40] and s.complete
    assert s.evaluations <= 2 + 2 * 2 * 6
    assert len(sens.search(evaluate, range(64), 0.5, sens.Budget(), top=1).found) == 1


def test_round_low_rounds_the_gradient_too():
    """The round trip computes what a low-precision node would: value and incoming gradient rounded."""
    x = torch.tensor([1.001], requires_grad=True)
    y = sens.round_low(x, torch.bfloat16)
    y.backward(torch.tensor([1.001]))
    assert y.item() == 1.0 and x.grad.item() == 1.0

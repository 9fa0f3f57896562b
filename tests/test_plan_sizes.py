"""Plans true at the sizes the model runs at: a size-dependent dtype decision (a GEMM under the break-even) records
its condition, and a call whose sizes cross it plans the graph again (``ampfx.runtime.guards.Scale``)."""
from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.errors import PlanSizeError
from ampfx.runtime.guards import Scale

BREAK_EVEN = 2 * 64 * 64 * 64  # a 64 -> 64 linear pays from 64 rows


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


def _rules(module):
    return [r.rule.value for r in module.ampfx_report.compute if r.op == "linear"]


def test_a_model_converted_on_a_small_batch_is_planned_again_at_its_training_size(caplog):
    """Rule: converted on batch 4, every GEMM is under the break-even and stays float32; the first call at batch 256
    crosses it: the graph is planned again for that size (its GEMMs low, logged with the sizes), the result is
    the model's within bfloat16's tolerance, and calls at either size afterwards reuse the two plans."""
    model = _model()
    amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(4, 64),), gemm_min_flops=BREAK_EVEN,
                        gemm_min_rows=0)
    assert _rules(amp) == ["cost:small-gemm"] * 2
    reason = amp.ampfx_report.compute[0].reason
    assert "a call with 16x their elements or more is planned again" in reason, reason
    big = torch.randn(256, 64)
    with caplog.at_level(logging.INFO, logger="ampfx.runtime.graph_module"):
        y = amp(big)
    assert "64x the 256 the plan was made for: past the size from which linear pays" in caplog.text
    assert [_rules(v) for v in amp.variants()] == [["table", "table"]]
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, model(big), rtol=2e-2, atol=2e-2)
    small = torch.randn(4, 64)
    torch.testing.assert_close(amp(small), model(small), rtol=0, atol=0)  # the float32 plan again
    amp(torch.randn(128, 64))
    assert len(amp.variants()) == 1  # batch 128 is in the same bucket as 256


def test_a_large_plan_called_small_plans_again_below_its_condition():
    """Rule: converted at batch 256 (GEMMs low), a call at batch 8 is under the break-even: planned again in
    float32."""
    amp = ampfx.convert(_model(), "bf16", example_inputs=(torch.randn(256, 64),), gemm_min_flops=BREAK_EVEN,
                        gemm_min_rows=0)
    assert _rules(amp) == ["table", "table"]
    amp(torch.randn(8, 64))
    assert [_rules(v) for v in amp.variants()] == [["cost:small-gemm"] * 2]


def test_without_a_plan_left_to_make_the_plan_runs_as_it_is_and_the_log_says_so_once(caplog):
    """Rule: with reconvert_limit=0 a call that crosses the condition runs the plan it has (its numbers are right)
    and the log says so once."""
    model = _model()
    amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(4, 64),), gemm_min_flops=BREAK_EVEN,
                        gemm_min_rows=0, reconvert_limit=0)
    big = torch.randn(256, 64)
    with caplog.at_level(logging.WARNING, logger="ampfx.runtime.graph_module"):
        torch.testing.assert_close(amp(big), model(big), rtol=0, atol=0)
        amp(big)
    assert caplog.text.count("no plan can be made for them") == 1
    assert amp.variants() == []


def test_dynamic_dims_decide_at_the_example_size_and_guard_the_others():
    """Rule: with dynamic_dims the rule is not skipped: decided at the example's batch (the reason writes the
    expression and its value there), guarded at other sizes."""
    amp = ampfx.convert(_model(), "bf16", example_inputs=(torch.randn(4, 64),), dynamic_dims={0: "batch"},
                        gemm_min_flops=BREAK_EVEN, gemm_min_rows=0)
    assert _rules(amp) == ["cost:small-gemm"] * 2
    assert "8192*batch (= 32,768 here)" in amp.ampfx_report.compute[0].reason
    amp(torch.randn(512, 64))
    assert [_rules(v) for v in amp.variants()] == [["table", "table"]]


def test_the_condition_survives_copies_and_pickles():
    amp = ampfx.convert(_model(), "bf16", example_inputs=(torch.randn(4, 64),), gemm_min_flops=BREAK_EVEN,
                        gemm_min_rows=0)
    for other in (copy.deepcopy(amp), pickle.loads(pickle.dumps(amp))):
        guard = other.__dict__["_ampfx_runtime"].guard
        assert guard.signature.scale == Scale(256, 0.0, 16.0, "", "linear")
        with pytest.raises(PlanSizeError, match="64x the 256"):
            guard((torch.randn(256, 64),), {})


def test_a_plan_without_size_dependent_decisions_has_no_size_check():
    """Rule: every GEMM low whatever the size (gemm_min_flops=0): no condition, no check."""
    amp = ampfx.convert(_model(), "bf16", example_inputs=(torch.randn(4, 64),), gemm_min_flops=0)
    rt = amp.__dict__["_ampfx_runtime"]
    assert rt.guard is None or rt.guard.signature.scale is None


def test_a_plan_made_again_at_a_call_leaves_the_callers_autograd_graph_alone():
    """Rule: the conversion a call makes runs on the call's tensors detached: its own backward neither frees what
    the caller's backward needs nor adds to the caller's gradients (an input computed from one of the module's own
    parameters, as a language model's head reads hidden states made from its tied embedding)."""
    model = _model()
    amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(4, 64),), gemm_min_flops=BREAK_EVEN,
                        gemm_min_rows=0)
    tied = model[0].bias  # the input is made from one of the module's own parameters (a tied embedding)
    base = torch.randn(256, 64)
    amp(base * tied).float().sum().backward()  # plans again inside this call
    assert len(amp.variants()) == 1
    got = tied.grad.clone()
    model.zero_grad()
    model(base * tied).sum().backward()
    torch.testing.assert_close(got, tied.grad, rtol=3e-2, atol=3e-2 * float(tied.grad.abs().max()))


def test_a_plan_for_new_sizes_that_cannot_be_made_leaves_the_plan_there_is(monkeypatch, caplog):
    """Rule: where making the plan for a call's sizes fails, the call runs the plan there is (right numbers), the
    log says so once, and it is not tried again at every call."""
    from ampfx.errors import StaleModelError
    from ampfx.runtime import entries
    model = _model()
    amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(4, 64),), gemm_min_flops=BREAK_EVEN,
                        gemm_min_rows=0)
    tries = []

    def failing(self, *args, **kwargs):
        tries.append(1)
        raise StaleModelError("out of memory in the conversion's own run")
    monkeypatch.setattr(entries.Runtime, "convert_again", failing)
    big = torch.randn(256, 64)
    with caplog.at_level(logging.WARNING, logger="ampfx.runtime.graph_module"):
        torch.testing.assert_close(amp(big), model(big), rtol=0, atol=0)
        amp(big)
    assert tries == [1] and caplog.text.count("planning again for them failed") == 1

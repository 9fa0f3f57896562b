"""The fp8 pass on its own: each GEMM node's FP8 decision, FP8 linears calling the FP8 runtime with the recipe."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ampfx.passes import fp8, pad
from ampfx.policy.fp8 import Recipe
from ampfx.report.records import Fp8Rule
from ampfx.runtime.fp8 import linear_fp8

from .helpers import calls, rec, run, run_passes


class Two(nn.Module):
    """A linear of 32 -> 64 (multiples of 16), then a product of activations."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        y = F.linear(x, self.w)
        return y @ y.transpose(0, 1)


def _decided(inputs=(torch.randn(16, 32),), **options):
    gm, ctx = run(Two(), inputs, upto=pad.pad, **options)
    run_passes(gm, ctx, start=fp8.decide_fp8, upto=fp8.decide_fp8)
    return gm


def test_an_fp8_linear_calls_the_fp8_runtime_with_the_recipe_and_records_its_three_gemms():
    gm = _decided(fp8="rowwise_with_gw_hp", fp8_roofline="none")
    (call,) = calls(gm, linear_fp8)
    assert call.args[3] == "rowwise_with_gw_hp" and call.args[2] is None
    d = rec(gm, "linear").fp8
    assert (d.rule, d.output, d.input_grad, d.weight_grad) == (Fp8Rule.FP8, True, True, False)
    assert d.flops == 2 * 16 * 64 * 32
    product = rec(gm, "matmul").fp8
    assert product.rule is Fp8Rule.OP and not product.output and product.flops == 2 * 16 * 16 * 64
    x = torch.randn(16, 32)
    assert gm(x).shape == (16, 16)


def test_a_recipe_of_the_users_own_is_named_by_its_fields():
    mine = Recipe("mine", rowwise=False, forward="float8_e5m2")
    gm = _decided(fp8=mine, fp8_roofline="none")
    (call,) = calls(gm, linear_fp8)
    assert call.args[3] == mine.spec and rec(gm, "linear").fp8.recipe == "mine"
    assert gm(torch.randn(16, 32)).shape == (16, 16)


def test_without_fp8_the_pass_does_nothing():
    gm = _decided()
    assert not calls(gm, linear_fp8) and rec(gm, "linear").fp8 is None


def test_sizes_decide_under_the_default_roofline():
    """At M=16, N=64 an H100 gains less from FP8 than quantising costs; without example inputs M is taken as large
    and N=64 still does not pay."""
    for inputs in ((torch.randn(16, 32),), None):
        d = rec(_decided(inputs, fp8="tensorwise"), "linear").fp8
        assert d.rule is Fp8Rule.COST and "N=64" in d.reason
    assert "M unknown" in rec(_decided(None, fp8="tensorwise"), "linear").fp8.reason

"""``passes/paint.py``: TF-AMP's painting, one graph per step, asserted on the records
(``dtype``, ``rule``, ``out``) after classify, reductions, calibrate and paint.

Several graphs use ``keep_output_dtype=False``: then graph outputs need no cast back
to float32, and step 7 (which counts those casts) leaves the step under test alone.
"""
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampfx import Category, runtime
from ampfx.passes import paint

from .helpers import calls, rec, run

PAINT = dict(upto=paint.paint)
TFAMP = dict(float32_stream=False, float32_operands=False, exact_values=False)
"""TF-AMP's steps alone: without ampfx's fidelity rules (tests/passes/test_fidelity.py), which keep the float32
graph inputs these graphs add to GEMM outputs in float32."""
DTYPES = [torch.bfloat16, torch.float16]


class OneInput(nn.Module):
    """``fn(self, x)`` as a module with two 4x4 weights ``w`` and ``v``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(4, 4))
        self.v = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.fn(self, x)


class TwoInputs(OneInput):
    """``fn(self, x, y)``."""

    def forward(self, x, y):
        return self.fn(self, x, y)


def paints(fn, n_inputs=1, **options):
    """``fn`` traced as a module on ``n_inputs`` float32 [2, 4] inputs, painted under ``options``."""
    module = (OneInput, TwoInputs)[n_inputs - 1](fn)
    inputs = tuple(torch.randn(2, 4) for _ in range(n_inputs))
    return run(module, inputs, **{**PAINT, **options})[0]


def dtype_rule(gm, *names):
    return [(rec(gm, n).dtype, rec(gm, n).rule) for n in names]


@pytest.mark.parametrize("low", DTYPES)
def test_step1_allow_ops_compute_and_produce_the_low_dtype(low):
    """Every ALLOW node computes in the low dtype (its table rule kept) and its value is low."""
    gm = paints(lambda m, x: F.linear(x, m.w), dtype=low)
    d = rec(gm, "linear")
    assert (d.category, d.dtype, d.rule, d.out) == (Category.ALLOW, low, "table", low)


@pytest.mark.parametrize("low", DTYPES)
def test_step2_deny_flows_forward_through_infer_and_clear_ops(low):
    """REFERENCE.md's example: ``deny -> infer -> clear -> infer -> clear -> allow -> infer``
    becomes ``deny -> deny -> deny -> deny -> clear -> allow -> infer``: the clear op
    feeding the GEMM (leading to no infer/deny op) is not denied but goes low."""
    def fn(m, x):
        h = torch.relu(torch.exp(x) + 1) * 2
        return torch.tanh(torch.matmul(h.neg(), m.w))

    gm = paints(fn, dtype=low)
    assert dtype_rule(gm, "add", "relu", "mul") == [(torch.float32, "paint:deny")] * 3
    assert dtype_rule(gm, "neg", "matmul") == [(low, "paint:clear"), (low, "table")]
    assert rec(gm, "tanh").dtype == low


def test_step2_deny_does_not_flow_backward():
    """A clear op *before* a deny op is not painted by it: ``exp(relu(linear(x)))`` keeps relu low."""
    gm = paints(lambda m, x: torch.exp(torch.relu(F.linear(x, m.w))))
    assert dtype_rule(gm, "relu") == [(torch.bfloat16, "paint:follow-allow")]


def test_step3_infer_ops_between_allow_ops_go_low():
    """Under float16 an add of a GEMM output and a float32 input is low only because it
    sits between two GEMMs ("paint:between-allow"); with no GEMM after it, float32 ("paint:default")."""
    gm = paints(lambda m, x, y: F.linear(F.linear(x, m.w) + y, m.v), 2, dtype=torch.float16, **TFAMP)
    assert dtype_rule(gm, "add") == [(torch.float16, "paint:between-allow")]
    gm = paints(lambda m, x, y: F.linear(x, m.w) + y, 2, dtype=torch.float16, **TFAMP)
    assert dtype_rule(gm, "add") == [(torch.float32, "paint:default")]


@pytest.mark.parametrize("low,expect", [(torch.bfloat16, (torch.bfloat16, "paint:follow-allow")),
                                        (torch.float16, (torch.float32, "paint:default"))])
def test_step4_follow_allow_differs_between_bfloat16_and_float16(low, expect):
    """An infer op fed by a GEMM and a float32 input: under bfloat16 it follows the GEMM
    (float32's range); under float16 it needs *all* its float inputs low, so it stays float32."""
    gm = paints(lambda m, x, y: torch.lerp(F.linear(x, m.w), y, 0.5), 2, dtype=low, keep_output_dtype=False, **TFAMP)
    assert dtype_rule(gm, "lerp") == [expect]


def test_step4_under_float16_an_infer_op_with_all_inputs_low_follows_them():
    """float16: an infer op whose float inputs are all low runs in their dtype ("paint:follow-allow")."""
    gm = paints(lambda m, x: torch.lerp(F.linear(x, m.w), F.linear(x, m.v), 0.5), dtype=torch.float16,
                keep_output_dtype=False)
    assert dtype_rule(gm, "lerp") == [(torch.float16, "paint:follow-allow")]


def test_steps4_and_5_repeat_until_nothing_changes():
    """float16: relu before a GEMM goes low in step 5 (clear propagation); only then are
    all inputs of the lerp low, and a second round of step 4 paints it."""
    def fn(m, x):
        t = torch.relu(x)
        return torch.lerp(F.linear(t, m.w), t, 0.5)

    gm = paints(fn, dtype=torch.float16, keep_output_dtype=False, **TFAMP)
    assert dtype_rule(gm, "relu", "lerp") == [(torch.float16, "paint:clear"), (torch.float16, "paint:follow-allow")]


def test_step5_clear_ops_next_to_low_ops_go_low_in_both_directions():
    """Backward: clear ops feeding a GEMM from a float32 input go low. Forward: a clear op
    fed by a GEMM *and* a deny op (so step 4 skips it) still goes low beside the GEMM."""
    def fn(m, x, y):
        h = F.linear(torch.relu(x).neg(), m.w)
        return torch.maximum(h, torch.exp(y))

    gm = paints(fn, 2, keep_output_dtype=False)
    assert dtype_rule(gm, "relu", "neg", "maximum") == [(torch.bfloat16, "paint:clear")] * 3
    assert dtype_rule(gm, "exp") == [(torch.float32, "table")]


def test_step6_an_op_moves_to_float32_where_that_saves_a_cast():
    """GPT-2's tanh-GELU under float16, pow on the deny list: ``h * 0.5`` only feeds the
    float32 product, and ``h`` is cast to float32 for pow anyway, so the product's other
    factor is computed in float32 ("paint:save-cast") and no cast of it is needed."""
    gm = paints(lambda m, x: (lambda h: (h * 0.5) * torch.pow(h, 3))(F.linear(x, m.w)), dtype=torch.float16)
    assert dtype_rule(gm, "mul", "pow_1", "mul_1") == [
        (torch.float32, "paint:save-cast"), (torch.float32, "table"), (torch.float32, "paint:deny")]


def test_step7_a_region_moves_to_float32_when_it_needs_fewer_casts():
    """``exp(linear(x) * scale)`` under bfloat16: step 4 paints the product low, which needs
    ``scale`` cast down and the product cast up for exp. In float32 the product reads the
    GEMM output by type promotion and nothing is cast: it moves ("paint:save-cast"), and
    after the cast pass only the GEMM's own inputs are cast. (With ``float32_operands`` on, the fidelity
    step paints the product float32 first, rule ``fidelity:operand``: the same dtype and casts.)"""
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.scale = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))

        def forward(self, x):
            return torch.exp(F.linear(x, self.w) * self.scale)

    gm, _ = run(Scale(), (torch.randn(2, 4),), **PAINT, float32_operands=False)
    assert dtype_rule(gm, "mul") == [(torch.float32, "paint:save-cast")]
    assert rec(gm, "mul").out == torch.float32
    gm, _ = run(Scale(), (torch.randn(2, 4),), **PAINT)
    assert dtype_rule(gm, "mul") == [(torch.float32, "fidelity:operand")]
    gm, _ = run(Scale(), (torch.randn(2, 4),))
    assert sorted(c.args[0].name for c in calls(gm, runtime.cast)) == ["w", "x"]


@pytest.mark.parametrize("size,moves", [(16, True), (paint.LAUNCH_BYTES // 4, False)])
def test_step7_a_clear_region_moves_where_a_cast_saved_outweighs_its_extra_bytes(size, moves):
    """A diffusion model's timestep embedding: ``cat([cos(t), sin(t)])`` (deny ops, float32) feeds a
    GEMM. Low, the cat needs two casts; in float32, one after it, but it copies float32 (more bytes).
    A cat holds the same values either way, so only cost decides: for a small embedding a cast's
    launch (``LAUNCH_BYTES``) outweighs those bytes and the cat moves; for a large one (float32 moves 16 bytes
    more per row element: 4x ``LAUNCH_BYTES`` here) it stays low.
    (An infer region gets no such credit: tests/passes/test_fidelity.py's TF-AMP-only stream stays low.)"""
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 2 * size))

        def forward(self, t):
            return F.linear(torch.cat([torch.cos(t), torch.sin(t)], -1), self.w)

    gm, _ = run(Embed(), (torch.randn(2, size),), **PAINT)
    assert rec(gm, "cat").out == (torch.float32 if moves else torch.bfloat16)
    if moves:
        before, after = map(int, re.search(r"(\d+) casts -> (\d+)", rec(gm, "cat").reason).groups())
        assert rec(gm, "cat").rule == "paint:save-cast" and before - after == 1


def test_in_place_ops_keep_the_dtype_of_the_tensor_they_mutate():
    """``y.add_(h)`` mutates a float32 input: float32; ``h.mul_(2)`` mutates a low GEMM
    output: low. Both with rule "inplace", whatever their paint."""
    def fn(m, x, y):
        h = F.linear(x, m.w)
        y.add_(h)
        h.mul_(2)
        return h, y

    gm = paints(fn, 2)
    assert dtype_rule(gm, "add_", "mul_") == [(torch.float32, "inplace"), (torch.bfloat16, "inplace")]
    assert (rec(gm, "add_").out, rec(gm, "mul_").out) == (torch.float32, torch.bfloat16)


def test_unlisted_ops_block_propagation():
    """An FP32 (unlisted) op is not painted and paints nothing: the clear op after it,
    with no other low neighbour, stays float32 ("paint:default")."""
    gm = paints(lambda m, x: torch.relu(torch.atan(F.linear(x, m.w))))
    assert dtype_rule(gm, "atan", "relu") == [(torch.float32, "unlisted"), (torch.float32, "paint:default")]


def test_infer_and_clear_ops_with_no_low_neighbour_stay_float32():
    """Without any allow op nothing goes low: every infer/clear op is float32 "paint:default"."""
    gm, _ = run(lambda x: torch.relu(x + 1), (torch.randn(3),), **PAINT)
    assert dtype_rule(gm, "add", "relu") == [(torch.float32, "paint:default")] * 2


def test_out_is_the_dtype_each_value_has_after_conversion():
    """A selection keeps its input's dtype (rule "select"); an explicit ``.float()`` in the
    model produces float32 and ``.half()`` float16 whatever the policy."""
    gm = paints(lambda m, x: (F.linear(x, m.w)[0], F.linear(x, m.v).float(), x.half()))
    assert (rec(gm, "getitem").rule, rec(gm, "getitem").out) == ("select", torch.bfloat16)
    assert (rec(gm, "float_1").out, rec(gm, "half").out) == (torch.float32, torch.float16)

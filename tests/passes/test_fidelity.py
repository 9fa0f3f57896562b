"""``passes/fidelity.py``: paint's step 2b keeps float32 values float32 where autocast's type
promotion keeps them; each rule has a Policy switch and its own report rule."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.passes import paint

from .helpers import rec, run
from .test_paint import TFAMP, OneInput, TwoInputs, dtype_rule

PAINT = dict(upto=paint.paint)
DTYPES = [torch.bfloat16, torch.float16]


class PreLN(nn.Module):
    """``x + fc2(gelu(fc1(norm(x))))`` twice: a pre-LN residual stream."""

    def __init__(self, d=8):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.a, self.b, self.c, self.e = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        x = x + self.b(F.gelu(self.a(self.n1(x))))
        return x + self.e(F.gelu(self.c(self.n2(x))))


@pytest.mark.parametrize("low", DTYPES)
def test_stream_residual_adds_and_norms_read_the_float32_stream(low):
    """The residual adds and the norms that read the stream compute float32 (``fidelity:stream``);
    the GEMMs and the GELUs between them stay low. TF-AMP's steps alone round the stream."""
    gm, _ = run(PreLN(), (torch.randn(2, 8),), dtype=low, **PAINT)
    assert dtype_rule(gm, "add", "n2") == [(torch.float32, "fidelity:stream")] * 2
    assert [rec(gm, n).dtype for n in ("a", "gelu", "b", "c", "gelu_1", "e")] == [low] * 6
    gm, _ = run(PreLN(), (torch.randn(2, 8),), dtype=torch.bfloat16, **PAINT, **TFAMP)
    assert [rec(gm, n).dtype for n in ("add", "n2")] == [torch.bfloat16] * 2


def test_stream_carried_state_stays_float32():
    """``h = a * h + gemm(x)`` over steps, ``h`` starting from ``zeros``: every update reads the
    float32 state and computes float32."""
    def fn(m, x):
        h = torch.zeros(2, 4)
        for _ in range(3):
            h = 0.9 * h + F.linear(x, m.w)
        return F.linear(h, m.v)

    gm, _ = run(OneInput(fn), (torch.randn(2, 4),), **PAINT)
    ops = {rec(gm, n.name).op: [] for n in gm.graph.nodes}
    for n in gm.graph.nodes:
        ops[rec(gm, n.name).op].append(n.name)
    assert len(ops["add"]) == 3 and len(ops["mul"]) >= 2  # fx folds the first 0.9 * zeros
    assert all(rec(gm, n).dtype == torch.float32 for n in ops["add"] + ops["mul"])
    # each add also reads a GEMM output; the first reads fx's folded constant (a buffer: fidelity:operand)
    assert [rec(gm, n).rule for n in ops["add"]] == ["fidelity:operand"] + ["fidelity:stream"] * 2


def test_operand_adds_of_parameters_are_float32_products_are_not():
    """``gemm + pos_embed`` (a parameter, through a slice) computes float32 (``fidelity:operand``) and
    reads the float32 slice (rule ``select``: it keeps the parameter's dtype); ``gemm * scale`` (a
    parameter factor) that only a GEMM reads stays low (layer scale's product, which a residual add
    reads, does not: ``tests/test_lean_patterns.py``)."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 4)
            self.pos = nn.Parameter(torch.randn(8, 4) * 100)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            h = self.fc(x)
            return self.out(h * self.scale), self.out(h + self.pos[: x.shape[0]])

    gm, _ = run(Net(), (torch.randn(3, 4),), **PAINT, float32_stream=False)
    assert dtype_rule(gm, "add") == [(torch.float32, "fidelity:operand")]
    assert (rec(gm, "getitem_1").rule, rec(gm, "getitem_1").out) == ("select", torch.float32)
    assert rec(gm, "mul").dtype == torch.bfloat16
    gm, _ = run(Net(), (torch.randn(3, 4),), **PAINT, **TFAMP)
    assert rec(gm, "add").dtype == torch.bfloat16


def test_operand_0_dim_values_do_not_promote():
    """A 0-dim float32 tensor does not promote a dimensioned one (PyTorch's rule): no reason to
    keep the add float32."""
    class Net(OneInput):
        def __init__(self):
            super().__init__(None)
            self.t = nn.Parameter(torch.tensor(3.0))

        def forward(self, x):
            return F.linear(F.linear(x, self.w) + self.t, self.v)

    gm, _ = run(Net(), (torch.randn(2, 4),), **PAINT)
    assert rec(gm, "add").dtype == torch.bfloat16


@pytest.mark.parametrize("integer", ["long", "to"])
def test_exact_values_feeding_an_integer_conversion_keep_float32(integer):
    """``(gemm * 0 + arange).long()``: the add reads a float32 ``arange`` and its value becomes
    indices, so it computes float32 (``fidelity:exact``) even with the other rules off, and the
    indices are float32's (bfloat16 holds integers exactly only up to 256)."""
    def fn(m, x):
        y = F.linear(x, m.w)[:, 0] * 0 + torch.arange(x.shape[0], dtype=torch.float32)
        return y.long() if integer == "long" else y.to(torch.int64)

    x = torch.randn(600, 4)
    gm, _ = run(OneInput(fn), (x,), float32_stream=False, float32_operands=False)
    assert dtype_rule(gm, "add") == [(torch.float32, "fidelity:exact")]
    assert torch.equal(gm(x), torch.arange(600))
    gm, _ = run(OneInput(fn), (x,), **TFAMP)
    assert rec(gm, "add").dtype == torch.bfloat16 and not torch.equal(gm(x), torch.arange(600))


def test_exact_comparisons_and_low_only_chains():
    """A comparison is an exact consumer too; a chain that reads no float32 value (``gemm > 0``)
    is left low: nothing to keep exact, no cast added."""
    def fn(m, x, y):
        h = F.linear(x, m.w)
        return (h + y > 0.5), (F.relu(h) > 0)

    gm, _ = run(TwoInputs(fn), (torch.randn(2, 4), torch.randn(2, 4)), **PAINT, float32_stream=False)
    assert dtype_rule(gm, "add") == [(torch.float32, "fidelity:exact")]
    assert rec(gm, "relu").dtype == torch.bfloat16


def test_pinned_slots_are_no_reason_and_views_to_a_gemm_are_cast_after():
    """A layer norm reading a low GEMM output stays low though its weight is float32 (a pinned
    slot); a view of the float32 input that only feeds a GEMM is not painted float32."""
    def fn(m, x):
        h = F.layer_norm(F.linear(x, m.w), (4,), m.w[0], m.v[0])
        return F.linear(h, m.v) + F.linear(x.view(2, 4), m.v)

    gm, _ = run(OneInput(fn), (torch.randn(2, 4),), **PAINT)
    assert rec(gm, "layer_norm").dtype == torch.bfloat16
    assert rec(gm, "view").rule != "fidelity:stream"


def test_float32_with_no_low_neighbour_keeps_the_default_rule():
    """``relu(x + 1)`` with no GEMM anywhere: float32 as before, rule ``paint:default`` (the fidelity
    rule is named only where a low neighbour would otherwise have pulled the op low)."""
    gm, _ = run(lambda x: torch.relu(x + 1), (torch.randn(3),), **PAINT)
    assert dtype_rule(gm, "add", "relu") == [(torch.float32, "paint:default")] * 2


@pytest.mark.parametrize("var,field", [("AMPFX_FLOAT32_STREAM", "float32_stream"),
                                       ("AMPFX_FLOAT32_OPERANDS", "float32_operands"),
                                       ("AMPFX_EXACT_VALUES", "exact_values")])
def test_each_rule_switches_off_by_policy_and_environment(var, field):
    """Each rule is a Policy field, on by default, and an ``AMPFX_*`` variable; a bad value is an
    error naming the variable."""
    assert getattr(ampfx.Policy(), field) is True
    assert getattr(ampfx.policy.from_env(ampfx.Policy(), {var: "0"}), field) is False
    assert getattr(ampfx.policy.from_env(ampfx.Policy(**{field: False}), {var: "1"}), field) is True
    with pytest.raises(ampfx.PolicyError, match=var):
        ampfx.policy.from_env(ampfx.Policy(), {var: "off-ish"})
    with pytest.raises(ampfx.PolicyError, match=field):
        ampfx.Policy(**{field: "no"})


def test_report_says_which_value_kept_the_node_float32():
    amp = ampfx.convert(PreLN(), "bf16", example_inputs=(torch.randn(2, 8),))
    r = amp.ampfx_report.by_node("add")
    assert r.rule == "fidelity:stream" and "'x'" in r.reason and "type promotion" in r.reason
    assert "float32 stream" in amp.ampfx_report.summary()


@pytest.mark.parametrize("dtype_kw,shapes,expect", [
    ({}, True, None),  # arange(T) is int64: no float32 value to keep
    ({"dtype": torch.float32}, False, "reads the float32 activation 'arange':"),
    ({}, False, "(assumed: without example_inputs"),  # int64 or float32: only the run shows
])
def test_a_factory_is_a_float32_value_only_when_its_dtype_says_so(dtype_kw, shapes, expect):
    """``gemm + arange(T)``: with example inputs an int64 ``arange`` is no reason for float32; with
    ``dtype=torch.float32`` it is; without either the record says the float32 is assumed."""
    def fn(m, x):
        return F.linear(F.linear(x, m.w) + torch.arange(x.shape[1], **dtype_kw), m.v)

    gm, _ = run(OneInput(fn), (torch.randn(2, 4),) if shapes else None, **PAINT)
    d = rec(gm, "add")
    if expect is None:
        assert d.dtype == torch.bfloat16, d
    else:
        assert d.dtype == torch.float32 and d.rule == "fidelity:stream" and expect in d.reason, d.reason

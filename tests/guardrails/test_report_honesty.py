"""Honest reports: a node's recorded dtype is the dtype it runs in, and a low-precision
norm's record says what stays float32 inside it (issue #17, case 9 and the norm promise).

Each test checks the record against what really happens at run time: an
``fx.Interpreter`` runs the converted graph and compares every node's output
dtype with its record's ``out``; a norm's float32 claims are checked on the
tensors themselves and on the values its kernel produces.
"""
import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.runtime.graph_module import AmpGraphModule
from ampfx.report.records import Decision, Rule


def _runtime_dtypes(amp: nn.Module, *inputs: torch.Tensor) -> dict[str, torch.dtype]:
    """Each node's output dtype when the converted root graph runs on ``inputs``."""
    assert isinstance(amp, AmpGraphModule)
    seen: dict[str, torch.dtype] = {}

    class Spy(fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            if isinstance(value, torch.Tensor):
                seen[n.name] = value.dtype
            return value

    Spy(amp).run(*inputs)
    return seen


def _assert_records_match_runtime(amp: nn.Module, *inputs: torch.Tensor) -> None:
    """Every compute record with a known ``out`` produced exactly that dtype, and its
    ``dtype`` is the dtype of its output or of what it read (no low claim for a float64 op)."""
    ran = _runtime_dtypes(amp, *inputs)
    checked = 0
    for node in amp.graph.nodes:
        d = node.meta.get("ampfx")
        if not isinstance(d, Decision) or d.kind not in ("call_function", "call_method", "call_module"):
            continue
        if isinstance(d.out, torch.dtype) and node.name in ran:
            assert ran[node.name] == d.out, (node.name, d.op, d.dtype, d.out, ran[node.name])
            checked += 1
    assert checked, "no node was checked"


class Float64MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) + 1)


@pytest.mark.parametrize("with_inputs", [False, True], ids=["no-example-inputs", "example-inputs"])
def test_float64_model_reports_float64_and_runs_float64(with_inputs):
    """A float64 model: every op is recorded as float64 (rule other-float), no cast is
    inserted or recorded, and the output equals eager's exactly."""
    model = Float64MLP().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,) if with_inputs else None)
    rep = amp.ampfx_report
    assert rep.compute and all(r.dtype == torch.float64 and r.rule is Rule.OTHER_FLOAT for r in rep.compute)
    assert rep.casts == () and rep.low() == []
    assert "float64 (as given" in rep.summary() and "converted 0/4" in rep.summary()
    assert torch.equal(amp(x), model(x))
    _assert_records_match_runtime(amp, x)


X64 = torch.randn(3, 4, dtype=torch.float64)
FLOAT64_VARIANTS = {
    "export": ("bf16", dict(tracer="export", example_inputs=(X64,))),
    "fp16": ("fp16", {}),
    "inference": ("bf16", dict(mode="inference")),
    "pad": ("bf16", dict(pad="always", example_inputs=(X64,))),
    "calibrate": ("bf16", dict(calibrate=[(X64,)])),
}


@pytest.mark.parametrize("name", list(FLOAT64_VARIANTS))
def test_float64_model_under_every_option(name):
    """Export capture, float16, inference mode (weights stored low), padding, calibration: a
    float64 model's ops stay float64 and say so, its weights stay float64, its output is eager's."""
    dtype, options = FLOAT64_VARIANTS[name]
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 2)).double()
    amp = ampfx.convert(model, dtype, **options)
    rep = amp.ampfx_report
    assert [r.dtype for r in rep.compute] == [torch.float64] * 4 and rep.casts == ()
    assert {p.dtype for p in amp.parameters()} == {torch.float64}
    assert torch.equal(amp(X64), model(X64))


@pytest.mark.parametrize("with_inputs", [False, True], ids=["no-example-inputs", "example-inputs"])
def test_mixed_float32_body_float64_head(with_inputs):
    """A float32 body converted to bfloat16 feeding a float64 head through ``.double()``:
    the body's GEMM is bfloat16, the head's ops float64, each as it runs."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.head = nn.Linear(8, 2).double()

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)).double()) * 2

    model = Mixed()
    x = torch.randn(3, 4)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,) if with_inputs else None)
    rep = amp.ampfx_report
    by_module = {r.module: r for r in rep.compute if r.op == "linear"}
    assert by_module["body"].dtype == torch.bfloat16
    assert by_module["head"].dtype == torch.float64 and by_module["head"].rule is Rule.OTHER_FLOAT
    assert not any(c.to == torch.bfloat16 and c.value.startswith("head") for c in rep.casts)
    assert amp(x).dtype == torch.float64
    _assert_records_match_runtime(amp, x)


def test_zero_dim_float64_buffer_does_not_make_the_op_float64():
    """Type promotion: a 0-dim float64 buffer times a dimensioned float32 tensor is
    float32, so the product follows its neighbours (here bfloat16), as recorded."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.fc2 = nn.Linear(4, 4)
            self.register_buffer("scale", torch.tensor(0.5, dtype=torch.float64))

        def forward(self, x):
            return self.fc2(self.fc(x) * self.scale)

    for ex in (None, (torch.randn(2, 4),)):
        amp = ampfx.convert(Scaled(), "bf16", example_inputs=ex)
        mul = next(r for r in amp.ampfx_report.compute if r.op == "mul")
        assert mul.rule is not Rule.OTHER_FLOAT and mul.dtype == torch.bfloat16
        _assert_records_match_runtime(amp, torch.randn(2, 4))


def test_reduction_asked_for_in_float64_is_recorded_float64():
    """``x.sum(dtype=torch.float64)`` accumulates in float64 as written: recorded so,
    and its input is not cast down first."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.sum(self.fc(x), dim=-1, dtype=torch.float64)

    x = torch.randn(3, 4)
    amp = ampfx.convert(M(), "bf16", example_inputs=(x,))
    s = next(r for r in amp.ampfx_report.compute if r.op == "sum")
    assert s.dtype == torch.float64 and s.rule is Rule.OTHER_FLOAT
    _assert_records_match_runtime(amp, x)


class Spectral(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, dtype=torch.complex64))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        z = self.fc(x).to(torch.complex64) * self.w
        return self.fc(torch.abs(z))


def test_complex_ops_run_and_are_recorded_in_complex64():
    """A complex64 parameter: the complex product is complex64 (never converted), its
    ``abs`` reads only complex data and produces float32, each recorded as it runs."""
    x = torch.randn(2, 4)
    amp = ampfx.convert(Spectral(), "bf16", example_inputs=(x,))
    rep = amp.ampfx_report
    mul = next(r for r in rep.compute if r.op == "mul")
    ab = next(r for r in rep.compute if r.op == "abs")
    assert (mul.dtype, mul.rule) == (torch.complex64, Rule.OTHER_FLOAT)
    assert (ab.dtype, ab.rule, ab.out) == (torch.complex64, Rule.OTHER_FLOAT, torch.float32)
    assert "complex64 (as given" in rep.summary()
    _assert_records_match_runtime(amp, x)


def test_complex_without_example_inputs_claims_no_dtype_it_cannot_know():
    """Without example_inputs, what follows a complex value (``abs(z)`` is real) is recorded as
    running as written with a run-time dtype (``dtype=None``, ``out='dynamic'``), never as a
    complex or low dtype it does not run in; the GEMM before it is still bfloat16."""
    x = torch.randn(2, 4)
    model = Spectral()
    amp = ampfx.convert(model, "bf16")
    rep = amp.ampfx_report
    ran = _runtime_dtypes(amp, x)
    first, second = [r for r in rep.compute if r.op == "linear"]
    assert first.dtype == torch.bfloat16 == ran[first.node]
    for r in rep.compute:
        if r.rule is Rule.OTHER_FLOAT:
            assert r.dtype is None and r.out == "dynamic", r
    assert second.rule is Rule.OTHER_FLOAT and ran[second.node] == torch.float32  # as written: no cast
    assert "run-time dtype (as given" in rep.summary()
    torch.testing.assert_close(amp(x), model(x), atol=0.05, rtol=0.05)


# --------------------------------------------------------------------------- norms


class ConvBN(nn.Module):
    def __init__(self, affine=True, track=True):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4, affine=affine, track_running_stats=track)
        self.c2 = nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.c2(torch.relu(self.bn(self.c1(x))))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_batch_norm_record_and_summary_say_what_stays_float32(tracer):
    """A bfloat16 batch norm's record names its float32 running statistics, affine
    parameters and accumulation; the summary has a ``float32 inside`` line for it."""
    x = torch.randn(2, 3, 6, 6)
    amp = ampfx.convert(ConvBN(), "bf16", example_inputs=(x,), tracer=tracer)
    rep = amp.ampfx_report
    bn = next(r for r in rep.compute if r.op == "batch_norm")
    assert bn.dtype == torch.bfloat16
    assert bn.fp32_inside == ("running statistics: bn.running_mean, bn.running_var",
                              "affine parameters: bn.weight, bn.bias", "accumulation")
    assert "float32 inside: running statistics" in bn.reason
    assert ("float32 inside bfloat16 ops: batch_norm 1 (running statistics, affine parameters, accumulation)"
            in rep.summary())
    assert bn.as_json()["fp32_inside"] == list(bn.fp32_inside)


def test_batch_norm_float32_claims_hold_at_run_time():
    """What the record claims is true after a training step: running statistics and
    affine parameters stay float32 tensors (float32 gradients), and the running mean
    is the float32 mean of the bfloat16 batch (a bfloat16 accumulation would be off by
    more than 0.01 here: values near 256, where bfloat16's spacing is 2)."""
    model = ConvBN()
    with torch.no_grad():
        model.c1.bias.add_(256.0)
    model.bn.momentum = 1.0  # the running mean becomes the batch mean
    amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(2, 3, 6, 6),))
    amp.train()
    x = torch.randn(8, 3, 6, 6)
    amp(x).sum().backward()
    assert model.bn.running_mean.dtype == model.bn.running_var.dtype == torch.float32
    assert model.bn.weight.grad.dtype == model.bn.bias.grad.dtype == torch.float32
    h = F.conv2d(x.bfloat16(), model.c1.weight.bfloat16(), model.c1.bias.bfloat16())  # what bn received
    exact = h.double().mean((0, 2, 3))
    assert (model.bn.running_mean.double() - exact).abs().max() < 1e-3
    assert (h.mean((0, 2, 3)).double() - exact).abs().max() > 1e-2  # a bfloat16 accumulation is caught


def test_norm_without_running_stats_or_affine_claims_only_accumulation():
    """``affine=False, track_running_stats=False``: nothing but the accumulation stays
    float32 inside, and the record says only that."""
    amp = ampfx.convert(ConvBN(affine=False, track=False), "bf16", example_inputs=(torch.randn(2, 3, 6, 6),))
    bn = next(r for r in amp.ampfx_report.compute if r.op == "batch_norm")
    assert bn.dtype == torch.bfloat16 and bn.fp32_inside == ("accumulation",)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_layer_and_group_norm_records_and_their_kernels(low):
    """Layer and group norm between GEMMs: low precision with float32 affine parameters
    and accumulation recorded; the kernel's low output equals the float32 result rounded
    (float32 statistics), checked on values whose mean a 16-bit sum would lose."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.ln = nn.LayerNorm(8)
            self.fc2 = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc2(self.ln(self.fc(x)))

    rep = ampfx.convert(M(), low, example_inputs=(torch.randn(4, 8),)).ampfx_report
    ln = next(r for r in rep.compute if r.op == "layer_norm")
    assert ln.dtype == low and ln.fp32_inside == ("affine parameters: ln.weight, ln.bias", "accumulation")
    base = 200.0 + (torch.arange(2 * 4 * 32 * 32).reshape(2, 4, 32, 32) % 3).float()
    x_low = base.to(low)
    w = torch.full((4,), 1.0 + 2.0 ** -12)  # not representable in 16 bits: a cast weight would lose it
    for f in (lambda t: F.group_norm(t, 2, w, torch.zeros(4)),
              lambda t: F.batch_norm(t, None, None, w, torch.zeros(4), training=True),
              lambda t: F.layer_norm(t, (32,), torch.ones(32), torch.zeros(32))):
        # float32 statistics: the low output is the float32 result to within the low dtype's rounding
        # (a 16-bit mean of values near 200 is off by up to half a unit: normalised outputs off by ~1)
        torch.testing.assert_close(f(x_low).float(), f(x_low.float()), atol=2e-3, rtol=torch.finfo(low).eps)


def test_float32_batch_norm_claims_nothing_inside():
    """A batch norm kept float32 (``fp32_modules``) has nothing to say inside: no
    ``fp32_inside``, and no ``float32 inside`` summary line."""
    amp = ampfx.convert(ConvBN(), "bf16", example_inputs=(torch.randn(2, 3, 6, 6),), fp32_modules=("bn",))
    bn = next(r for r in amp.ampfx_report.compute if r.op == "batch_norm")
    assert bn.dtype == torch.float32 and bn.fp32_inside == ()
    assert "float32 inside" not in amp.ampfx_report.summary()

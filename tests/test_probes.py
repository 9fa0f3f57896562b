"""Device probes: an op whose low-precision kernel fails a tiny run here stays float32, per kernel variant."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx import Category
from ampfx.ops import probes
from ampfx.ops import ENTRIES
from ampfx.ops.probes import Variant
from conftest import DTYPES


@pytest.fixture
def fresh_probes():
    probes.check.cache_clear()
    yield
    probes.check.cache_clear()


def kernel_error(fn, dtype):
    """The error of running ``fn`` on a low-precision input forward and backward, or None."""
    try:
        fn(torch.randn(1, 2, 4, 4, 4).to(dtype).requires_grad_()).float().sum().backward()
    except (RuntimeError, NotImplementedError) as e:
        return str(e)
    return None


class Video(nn.Module):
    """A 3-d CNN: conv3d -> avg_pool3d -> conv3d, and a 2-d pool on a view of the same data."""

    def __init__(self):
        super().__init__()
        self.conv, self.pool, self.head = nn.Conv3d(2, 4, 3, padding=1), nn.AvgPool3d(2), nn.Conv3d(4, 4, 1)

    def forward(self, x):
        y = self.head(self.pool(torch.relu(self.conv(x))))
        return y + F.avg_pool2d(y.flatten(1, 2), 1).view_as(y)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_op_without_a_low_kernel_here_stays_float32_and_the_model_trains(dtype):
    """avg_pool3d has no bfloat16/float16 CPU kernel in torch 2.13 (autocast keeps it float32 too): the
    converted model must run forward and backward, with the pool float32 iff its kernel fails here, and
    avg_pool2d, another kernel of the same op, still low where it works."""
    x = torch.randn(1, 2, 4, 4, 4)
    amp = ampfx.convert(Video(), dtype, example_inputs=(x,))
    amp(x).sum().backward()
    recs = {r.node: r for r in amp.ampfx_report.compute}
    pool3d, pool2d = recs["pool"], recs["avg_pool2d"]
    missing = kernel_error(lambda t: F.avg_pool3d(t, 2), dtype)
    if missing:
        assert (pool3d.category, pool3d.dtype, pool3d.rule) == (Category.FP32, torch.float32, "probe")
        assert "avg_pool (3-d)" in pool3d.reason and missing.splitlines()[0][:40] in pool3d.reason
    else:
        assert pool3d.dtype == dtype
    if kernel_error(lambda t: F.avg_pool2d(t.flatten(1, 2), 1), dtype) is None:
        assert pool2d.dtype == dtype, pool2d
    convs = [r for r in recs.values() if r.op == "conv3d"]
    assert len(convs) == 2 and all(r.dtype == dtype for r in convs)


def test_a_failing_probe_keeps_the_op_float32_with_the_error(monkeypatch, fresh_probes):
    """Whatever the device, a probe that fails makes its op FP32 (rule 'probe') and the reason quotes the
    error; the probe runs once per process and kind, not once per node or conversion."""
    calls = []

    def broken(dtype, device, variant):
        calls.append(dtype)
        raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'\nsecond line')

    monkeypatch.setitem(probes.PROBES, "linear", broken)
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Conv1d(4, 4, 1))
    x = torch.randn(2, 4, 4)
    for _ in range(2):
        rep = ampfx.convert(m, "fp16", example_inputs=(x,)).ampfx_report
        linears = [r for r in rep.compute if r.op == "linear"]
        assert len(linears) == 2
        for r in linears:
            assert (r.category, r.dtype, r.rule) == (Category.FP32, torch.float32, "probe")
            assert r.reason == ("linear has no working float16 kernel on cpu (RuntimeError: \"addmm_impl_cpu_\" not "
                                "implemented for 'Half'): float32")
        assert [r.dtype for r in rep.compute if r.op == "conv1d"] == [torch.float16]
    assert calls == [torch.float16]


def test_probe_false_skips_the_probes(monkeypatch, fresh_probes):
    monkeypatch.setitem(probes.PROBES, "linear", lambda *a: 1 / 0)
    rep = ampfx.convert(nn.Linear(4, 4), "bf16", probe=False).ampfx_report
    assert [r.dtype for r in rep.compute] == [torch.bfloat16]


@pytest.mark.parametrize("kind,target,kwargs,module,rank,args,expected", [
    ("avg_pool", "AvgPool3d", {}, nn.AvgPool3d(2), 5, (), Variant(3, None)),
    ("avg_pool", "torch.nn.functional.avg_pool2d", {}, None, None, (), Variant(2, None)),
    ("avg_pool", "aten.avg_pool3d.default", {}, None, 5, (), Variant(3, None)),
    ("avg_pool", "AdaptiveAvgPool2d", {}, nn.AdaptiveAvgPool2d(1), 4, (), Variant(2, "adaptive")),
    ("avg_pool", "aten._adaptive_avg_pool2d.default", {}, None, 4, (), Variant(2, "adaptive")),
    ("max_pool", "aten.max_pool2d_with_indices.default", {}, None, 4, (), Variant(2, None)),
    ("interpolate", "torch.nn.functional.interpolate", {"mode": "bicubic"}, None, 4, (), Variant(2, "bicubic")),
    ("interpolate", "torch.nn.functional.interpolate", {}, None, 5, (), Variant(3, None)),  # default: nearest
    ("interpolate", "Upsample", {}, nn.Upsample(scale_factor=2, mode="trilinear"), 5, (), Variant(3, "trilinear")),
    ("interpolate", "aten.upsample_bilinear2d.vec", {}, None, 4, (), Variant(2, "bilinear")),
    ("interpolate", "aten._upsample_nearest_exact2d.default", {}, None, 4, (), Variant(2, "nearest-exact")),
    ("interpolate", "aten.upsample_linear1d.vec", {}, None, 3, (), Variant(1, "linear")),
    ("pad", "torch.nn.functional.pad", {}, None, 4, ("x", (1, 1, 1, 1), "reflect"), Variant(2, "reflect")),
    ("pad", "torch.nn.functional.pad", {"mode": "replicate"}, None, 5, (), Variant(3, "replicate")),
    ("pad", "ReplicationPad1d", {}, nn.ReplicationPad1d(1), 3, (), Variant(1, "replicate")),
    ("pad", "ZeroPad2d", {}, nn.ZeroPad2d(1), 4, (), Variant(2, None)),
    ("pad", "aten.constant_pad_nd.default", {}, None, 4, (), Variant(2, None)),
    ("conv_transpose", "ConvTranspose3d", {}, nn.ConvTranspose3d(1, 1, 1), 5, (), Variant(3, None)),
])
def test_variant_is_read_from_the_target_name_mode_and_rank(kind, target, kwargs, module, rank, args, expected):
    """The kernel a node runs: dimensions from the name (avg_pool3d) or the input's rank, mode from the
    argument, the module's attribute or the name (aten.upsample_bilinear2d, nn.ReflectionPad2d)."""
    assert probes.variant_of(kind, target, kwargs, module, rank, args) == expected


def test_ops_with_one_kernel_have_one_variant():
    assert probes.variant_of("linear", "torch._C._nn.linear", {}, None, 4) == Variant()
    assert probes.variant_of("layer_norm", "LayerNorm", {}, nn.LayerNorm(3), 3) == Variant()


VARIANTS = {
    "conv": [Variant(d) for d in (1, 2, 3)], "conv_transpose": [Variant(d) for d in (1, 2, 3)],
    "avg_pool": [Variant(d, m) for d in (1, 2, 3) for m in (None, "adaptive")],
    "max_pool": [Variant(d, m) for d in (1, 2, 3) for m in (None, "adaptive")],
    "interpolate": [Variant(d, m) for d in (1, 2, 3) for m in ("nearest", "area", "nearest-exact")]
    + [Variant(1, "linear"), Variant(2, "bilinear"), Variant(2, "bicubic"), Variant(3, "trilinear")],
    "pad": [Variant(d, m) for d in (1, 2, 3) for m in (None, "reflect", "replicate", "circular")],
}


@pytest.mark.parametrize("kind,variant", [(k, v) for k in probes.PROBES for v in VARIANTS.get(k, [Variant()])])
def test_every_probe_runs_in_float32(kind, variant, fresh_probes):
    """A probe that is itself wrong would keep its op float32 everywhere: each one (every variant) runs
    forward and backward in float32."""
    assert probes.check(kind, torch.float32, "cpu", variant) is None


def test_every_gemm_and_convolution_is_probed():
    """Allow-list ops are the ones a device is most likely to lack a low kernel for (old CPUs, old GPUs)."""
    unprobed = [r.name for r in ENTRIES.values() if r.category is Category.ALLOW and "." not in r.name
                and r.probe not in probes.PROBES]
    assert not unprobed


def test_probing_leaves_the_random_stream_as_it_was(fresh_probes):
    """The first conversion of a process runs the probes; the user's next random numbers must not depend on
    whether it was the first."""
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.LSTM(4, 4))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    ampfx.convert(m, "bf16", example_inputs=(torch.ones(2, 4),))
    assert torch.equal(torch.rand(3), expected)


def test_rounds_once_tells_a_float32_inside_kernel_from_a_low_accumulating_one(monkeypatch):
    """softmax's CPU kernels compute in float32 and round once; a kernel that rounds its partial sums
    to the low dtype (stood in for by a patched softmax) is told apart; unknown ops and absent devices are False."""
    import torch.nn.functional as F
    from ampfx.ops import probes
    assert probes.rounds_once("softmax", torch.bfloat16, "cpu") and probes.rounds_once("softmin", torch.float16, "cpu")
    assert not probes.rounds_once("log_softmax", torch.bfloat16, "cpu")
    assert not probes.rounds_once("softmax", torch.bfloat16, "no-such-device")

    def low_sums(x, dim, dtype=None):
        if dtype is not None:
            return torch.softmax(x.to(dtype), dim)
        e = (x.float() - x.float().amax(dim, keepdim=True)).exp().to(x.dtype)
        total = torch.zeros_like(e[..., :1])
        for i in range(e.shape[dim]):  # a running sum in the low dtype
            total = total + e[..., i:i + 1]
        return e / total

    monkeypatch.setitem(probes._ROUNDS_ONCE, "softmax", low_sums)
    probes.rounds_once.cache_clear()
    try:
        assert not probes.rounds_once("softmax", torch.bfloat16, "cpu")
    finally:
        probes.rounds_once.cache_clear()


class Distances(nn.Module):
    """Pairwise distances between projected sets: a small reduction (cdist) fed by two GEMMs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, y):
        return torch.cdist(self.fc(x), self.fc(y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_op_painted_low_without_a_low_kernel_stays_float32_with_the_error(dtype):
    """Rule: a small reduction that would follow its low inputs (cdist after a Linear) is tried in the low dtype on
    its own arguments, shrunk; where the kernel is missing it stays float32 (rule probe, the error in the reason),
    and the converted model runs and trains."""
    x, y = torch.randn(4, 8), torch.randn(5, 8)
    with pytest.raises(NotImplementedError):
        torch.cdist(x.to(dtype), y.to(dtype))  # the premise: no such kernel on this CPU
    model = Distances()
    amp = ampfx.convert(model, dtype, example_inputs=(x, y))
    d = next(r for r in amp.ampfx_report.records if r.node == "cdist")
    assert (d.dtype, d.rule) == (torch.float32, "probe") and "not implemented for" in d.reason, d
    out = amp(x, y)
    out.sum().backward()
    torch.testing.assert_close(out, model(x, y), rtol=0.05, atol=0.05)


def test_an_op_the_user_adds_to_a_list_without_a_low_kernel_stays_float32():
    """Rule: every op decided low is probed when its arguments' shapes are known, not only the table's probe
    kinds: torch.linalg.inv added to the infer list keeps float32 (no bfloat16 kernel), with the reason."""
    class Inverse(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.linalg.inv(self.fc(x).view(-1, 2, 2))

    x = torch.randn(3, 4)
    amp = ampfx.convert(Inverse(), "bf16", example_inputs=(x,), environ={"AMPFX_INFERLIST_ADD": "torch.linalg.inv"})
    d = next(r for r in amp.ampfx_report.records if "inv" in r.node)
    assert (d.dtype, d.rule) == (torch.float32, "probe"), d
    assert amp(x).dtype == torch.float32


def test_a_probe_that_fails_for_its_inputs_says_nothing():
    """Rule: a call probe that fails in float32 too (the shrunk inputs break the op's own shape rules), or fails for
    another reason than a missing kernel, cannot tell: the decision stands."""
    view_of_eight = probes.check_call(None, "view", (probes.Arg((2, 3), torch.float32), 8), (), torch.bfloat16, "cpu")
    assert view_of_eight is None
    assert probes.check_call(torch.add, None, (probes.Arg((2, 3), torch.float32), probes.Arg((4, 5), torch.float32)),
                             (), torch.bfloat16, "cpu") is None
    assert probes.shrunk((probes.Arg((1, 512, 64), torch.float32), probes.Listed((probes.Arg((64,), torch.int64),))))\
        == (probes.Arg((1, 3, 2), torch.float32), probes.Listed((probes.Arg((2,), torch.int64),)))

"""Shape-aware decisions: FakeTensor shapes, symbolic sizes, reductions by size, GEMM padding."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx import Category, PolicyError
from ampfx.runtime import cast_pad


class Reducer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(512, 512)

    def forward(self, x):
        h = self.fc(x)
        return self.fc(h * h.sum(-1, keepdim=True)), h.sum(), torch.cumsum(h, 0)


def rec(rep, op):
    return [r for r in rep.records if r.op == op]


def test_shapes_come_from_fake_tensors_without_running_the_model():
    """Leaf modules see meta (data-free) tensors during propagation, and fake ones (data-free too) when the
    converted graph's GEMMs are counted, never real ones. (tracer="fx": under "auto" the model and its fx
    graph also run once, for real, to check that the graph reproduces the model.)"""
    from torch._subclasses.fake_tensor import FakeTensor

    m = nn.Sequential(nn.Linear(512, 8), nn.ReLU())
    seen = []
    m[1].register_forward_hook(lambda mod, args, out: seen.append("fake" if isinstance(out, FakeTensor)
                                                                  else out.device.type))
    rep = ampfx.convert(m, "fp16", example_inputs=(torch.randn(4, 512),), tracer="fx",
                        keep_modules=()).ampfx_report  # (a hooked module is kept, converted on inputs seen for real)
    assert "no real compute" in rep.shapes and seen == ["meta", "fake"]
    assert rec(rep, "linear")[0].shapes == ("float32[4, 8]",)


@pytest.mark.parametrize("threshold,small", [(1000, True), (100, False)])
def test_fp16_reductions_follow_inputs_when_small_and_accumulate_in_fp32_when_large(threshold, small):
    rep = ampfx.convert(Reducer(), "fp16", example_inputs=(torch.randn(4, 512),),
                        reduction_threshold=threshold).ampfx_report
    row_sum = rec(rep, "sum")[0]  # 512 elements per output
    if small:
        assert (row_sum.category, row_sum.dtype) == (Category.INFER, torch.float16)
        assert "sum over 512 elements <= threshold 1,000" in row_sum.reason
    else:
        assert (row_sum.category, row_sum.dtype, row_sum.rule) == (Category.DENY, torch.float32, "shape:large-reduction")
        assert "sum over 512 elements > threshold 100: float32 accumulation (float16 max 65504)" in row_sum.reason


def test_large_fp32_reduction_uses_the_ops_dtype_argument():
    """A float32 sum of a low value that stays low for another op reads it through
    ``dtype=``, with no cast."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(512, 512)

        def forward(self, x):
            h = self.fc(x)
            return self.fc(h), h.sum()

    gm = ampfx.convert(Net(), "fp16", example_inputs=(torch.randn(4, 512),), reduction_threshold=100)
    total = next(n for n in gm.graph.nodes if getattr(n.meta.get("ampfx"), "op", "") == "sum")
    assert total.kwargs.get("dtype") == torch.float32
    assert total.args[0].meta["ampfx"].op == "linear" and total.args[0].meta["ampfx"].dtype == torch.float16


def test_bf16_large_sum_stays_low_and_says_why():
    rep = ampfx.convert(Reducer(), "bf16", example_inputs=(torch.randn(4, 512),), reduction_threshold=100).ampfx_report
    r = rec(rep, "sum")[0]
    assert r.dtype == torch.bfloat16 and "bfloat16 has float32's range" in r.reason


def test_without_example_inputs_reductions_are_fp32_size_unknown():
    rep = ampfx.convert(Reducer(), "bf16").ampfx_report
    assert {(r.dtype, r.rule) for r in rec(rep, "sum")} == {(torch.float32, "shape:size-unknown")}
    assert "size unknown" in rec(rep, "sum")[0].reason and "no example_inputs" in rep.shapes


def test_symbolic_sizes_decide_for_every_value_of_the_symbol():
    """512*batch with batch >= 2 is at least 1024 > 1000: large for every batch; a cumsum over
    'batch' elements may or may not exceed it: size unknown."""
    rep = ampfx.convert(Reducer(), "fp16", example_inputs=(torch.randn(4, 512),), dynamic_dims={0: "batch"},
                        reduction_threshold=1000).ampfx_report
    total, cumsum = rec(rep, "sum")[1], rec(rep, "cumsum")[0]
    assert total.rule == "shape:large-reduction" and "512*batch elements" in total.reason
    assert cumsum.rule == "shape:size-unknown" and "between 2 and" in cumsum.reason
    assert rec(rep, "linear")[0].shapes == ("float32[batch, 512]",)


def test_traced_once_with_symbolic_batch_runs_at_several_batch_sizes():
    m = Reducer()
    gm = ampfx.convert(m, "fp16", example_inputs=(torch.randn(4, 512),), dynamic_dims={0: "batch"})
    for batch in (2, 5, 33):
        x = torch.randn(batch, 512) * 0.1
        for a, b in zip(gm(x), m(x)):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())


def test_dynamic_dims_need_example_inputs():
    with pytest.raises(TypeError, match="dynamic_dims"):
        ampfx.convert(Reducer(), "fp16", dynamic_dims={0: "batch"})


# ------------------------------------------------------------------ padding
class Head(nn.Module):
    """602 -> 41 features, then a vocabulary-sized projection: every GEMM dimension odd."""

    def __init__(self):
        super().__init__()
        self.proj, self.lm = nn.Linear(602, 41), nn.Linear(41, 50257)

    def forward(self, x):
        return self.lm(F.gelu(self.proj(x)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_linear_matches_unpadded_outputs_and_gradients(dtype):
    m, x = Head(), torch.randn(4, 602)
    results = {}
    for mode in ("never", "always"):
        gm = ampfx.convert(m, dtype, example_inputs=(x,), pad=mode)
        out = gm(x)
        out.pow(2).mean().backward()
        results[mode] = (out.detach(), [p.grad.clone() for p in m.parameters()])
        m.zero_grad()
    (a, ga), (b, gb) = results["never"], results["always"]
    assert a.shape == b.shape == (4, 50257)
    torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-2)
    for g1, g2 in zip(ga, gb):
        assert g1.shape == g2.shape
        torch.testing.assert_close(g2, g1, rtol=2e-2, atol=1e-4)


def test_padding_rides_on_the_cast_and_keeps_parameters():
    m, x = Head(), torch.randn(4, 602)
    gm = ampfx.convert(m, "bf16", example_inputs=(x,), pad="always")
    reasons = [r.reason for r in gm.ampfx_report.records if r.op == "linear"]
    assert "K=602 padded to 608, N=41 padded to 48" in reasons[0]
    assert "K=41 padded to 48, N=50257 padded to 50264" in reasons[1]
    pads = [n for n in gm.graph.nodes if n.target is cast_pad]
    assert {n.args[0].target for n in pads if n.args[0].op == "get_attr"} == {"proj.weight", "proj.bias", "lm.weight"}
    assert {k: v.shape for k, v in gm.state_dict().items()} == {k: v.shape for k, v in m.state_dict().items()}


def test_should_pad_auto_skips_cpu_and_aligned_sizes_are_reported():
    m = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 41))
    rep = ampfx.convert(m, "bf16", example_inputs=(torch.randn(2, 64),)).ampfx_report
    first, second = rec(rep, "linear")
    assert "K=64, N=64 already multiples of 8" in first.reason
    assert "not padded: pad='auto' pads on CUDA only (device cpu)" in second.reason


def test_pad_env_and_errors():
    m, x = Head(), torch.randn(2, 602)
    rep = ampfx.convert(m, "bf16", example_inputs=(x,), environ={"AMPFX_PAD": "always", "AMPFX_PAD_MULTIPLE": "16"})
    assert "K=602 padded to 608, N=41 padded to 48" in rec(rep.ampfx_report, "linear")[0].reason
    with pytest.raises(PolicyError, match="AMPFX_PAD='sometimes'"):
        ampfx.convert(m, "bf16", environ={"AMPFX_PAD": "sometimes"})
    with pytest.raises(PolicyError, match="AMPFX_REDUCTION_THRESHOLD='lots'"):
        ampfx.convert(m, "bf16", environ={"AMPFX_REDUCTION_THRESHOLD": "lots"})


def test_cast_pad_is_one_copy_with_gradients_in_the_source_dtype():
    w = torch.randn(3, 5, requires_grad=True)
    out = cast_pad(w, torch.bfloat16, (8, 8))
    assert out.dtype == torch.bfloat16 and out.shape == (8, 8) and out[3:].abs().sum() == 0
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and torch.equal(w.grad, torch.ones(3, 5))


class Batched(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(30, 21) * 0.1)

    def forward(self, a, b):
        return torch.bmm(a, b) @ self.w, torch.baddbmm(torch.zeros(1, 5, 30), a, b)


def test_matmul_family_is_padded_and_sliced_back():
    m, a, b = Batched(), torch.randn(2, 5, 13), torch.randn(2, 13, 30)
    ref = ampfx.convert(m, "bf16", example_inputs=(a, b), pad="never")(a, b)
    gm = ampfx.convert(m, "bf16", example_inputs=(a, b), pad="always")
    for x, y in zip(gm(a, b), ref):
        torch.testing.assert_close(x, y)
    reasons = {r.op: r.reason for r in gm.ampfx_report.compute}
    assert "K=13 padded to 16, N=30 padded to 32" in reasons["bmm"] and "K=30 padded to 32" in reasons["matmul"]
    assert "K=13 padded to 16, N=30 padded to 32" in reasons["baddbmm"]


def test_symbolic_gemm_sizes_are_reported_not_padded():
    class Sym(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 13))

        def forward(self, x):  # x: [batch, 13] -> w @ [13, 8*batch]
            return self.w @ x.t().repeat(1, 8)

    rep = ampfx.convert(Sym(), "bf16", example_inputs=(torch.randn(3, 13),), dynamic_dims={0: "batch"},
                        pad="always").ampfx_report
    r = rec(rep, "matmul")[0]
    assert "N=8*batch already aligned" in r.reason and "not padded" in r.reason

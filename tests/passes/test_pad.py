"""``passes/pad.py``: the padding plan for low-precision GEMMs (K and N to multiples
of 8), riding on the casts, with the output narrowed back to N."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ampfx import meta, runtime
from ampfx.passes import pad

from .helpers import calls, node, rec, run

PAD = dict(upto=pad.pad)


class Linear(nn.Module):
    """``tanh(linear(x, w[n, k], b[n]))``: the tanh keeps the GEMM's consumer low (no bias split)."""

    def __init__(self, n, k, bias=True):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, k))
        self.b = nn.Parameter(torch.randn(n)) if bias else None

    def forward(self, x):
        return torch.tanh(F.linear(x, self.w, self.b))


def padded_sizes(gm):
    """``{value name: sizes}`` for every ``cast_pad`` in the graph."""
    return {n.args[0].name: n.args[2] for n in calls(gm, runtime.cast_pad)}


def narrows(gm):
    return calls(gm, torch.narrow)


def test_k_and_n_not_multiples_of_8_are_padded_with_pad_always():
    """K=12, N=10: the weight's cast pads it to [16, 16], the activation's to K=16, the
    bias's to N=16, in the same copies; a narrow (rule "pad") slices the output back to 10."""
    x = torch.randn(4, 12)
    gm, _ = run(Linear(10, 12), (x,), pad="always", **PAD)
    assert padded_sizes(gm) == {"x": (16,), "w": (16, 16), "b": (16,)}
    assert [c for c in calls(gm, runtime.cast) if c.args[0].name in ("x", "w", "b")] == []
    (narrow,) = narrows(gm)
    assert narrow.args == (node(gm, "linear"), -1, 0, 10)
    assert (rec(gm, narrow.name).rule, rec(gm, narrow.name).out) == ("pad", torch.bfloat16)
    assert "K=12 padded to 16" in rec(gm, "linear").reason and "N=10 padded to 16" in rec(gm, "linear").reason
    assert node(gm, "tanh").args[0] is narrow


def test_aligned_dimensions_are_left_alone():
    """K=16, N=8 are multiples of 8: no cast_pad, no narrow, and the record says so."""
    gm, _ = run(Linear(8, 16), (torch.randn(4, 16),), pad="always", **PAD)
    assert padded_sizes(gm) == {} and narrows(gm) == []
    assert "already multiples of 8" in rec(gm, "linear").reason


def test_only_the_unaligned_dimension_is_padded():
    """K=16 aligned, N=10 not: the weight and bias are padded along N, the activation is
    cast without padding."""
    gm, _ = run(Linear(10, 16), (torch.randn(4, 16),), pad="always", **PAD)
    assert padded_sizes(gm) == {"w": (16, 16), "b": (16,)}
    assert [c.args[0].name for c in calls(gm, runtime.cast) if c.args[1] == torch.bfloat16] == ["x"]


def test_symbolic_dimensions_are_not_padded():
    """K is symbolic (``dynamic_dims={-1: "k"}``), not provably a multiple of 8: nothing is
    padded, and the record says why."""
    gm, _ = run(lambda a, b: torch.matmul(a, b.transpose(0, 1)), (torch.randn(4, 12), torch.randn(4, 12)),
                dynamic_dims={-1: "k"}, pad="always", **PAD)
    assert padded_sizes(gm) == {} and narrows(gm) == []
    assert "symbolic operand sizes are not padded" in rec(gm, "matmul").reason


@pytest.mark.parametrize("mode,device,why", [("never", "cpu", "pad='never'"),
                                             ("auto", "cpu", "pads on CUDA only"),
                                             ("auto", "cuda", "padding would add")])
def test_should_we_pad_decides_after_can_we_pad(mode, device, why):
    """``pad="never"`` never pads; ``"auto"`` pads on CUDA only, and only when the padded
    weight is at most 25% larger (10x12 -> 16x16 is 113% larger): the record says which."""
    gm, _ = run(Linear(10, 12), (torch.randn(4, 12),), pad=mode, device=device, **PAD)
    assert padded_sizes(gm) == {} and narrows(gm) == []
    assert why in rec(gm, "linear").reason


def test_auto_pads_on_cuda_when_the_extra_is_small():
    """``pad="auto"`` on CUDA pads 30x30 to 32x32 (14% larger). Only the plan is checked: the
    graph is not run."""
    gm, _ = run(Linear(30, 30), (torch.randn(4, 30),), pad="auto", device="cuda", **PAD)
    assert padded_sizes(gm) == {"x": (32,), "w": (32, 32), "b": (32,)}


def test_without_shapes_the_activation_size_is_unknown_and_nothing_is_padded():
    """No example inputs: K of the activation is unknown, so the GEMM is not padded."""
    gm, _ = run(Linear(10, 12), pad="always", **PAD)
    assert padded_sizes(gm) == {} and "shapes unknown" in rec(gm, "linear").reason


class MatMul(nn.Module):
    """``x[4, 12] @ w[12, 10]``: the matmul layout (K from x, N from w's last dim)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 10))

    def forward(self, x):
        return torch.matmul(x, self.w)


class BiasSplit(nn.Module):
    """A GEMM returned directly: its bias is added in float32 after the cast, then padded."""

    def __init__(self):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(10, 12)), nn.Parameter(torch.randn(10))

    def forward(self, x):
        return F.linear(x, self.w, self.b)


@pytest.mark.parametrize("make,padded_values", [(lambda: Linear(10, 12), {"x", "w", "b"}),
                                                 (lambda: MatMul(), {"x", "w"}),
                                                 (lambda: BiasSplit(), {"x", "w"})],
                         ids=["linear", "matmul", "bias-split"])
def test_padded_gemms_compute_what_the_unpadded_ones_do(make, padded_values):
    """Zero rows and columns change nothing: the padded graph's outputs (shape included)
    and parameter gradients equal those of the same graph converted with ``pad="never"``.
    (A GEMM returned directly has its bias added in float32 after the cast: not padded.)"""
    module, x = make(), torch.randn(4, 12)
    padded, _ = run(module, (x,), pad="always")
    plain, _ = run(module, (x,), pad="never")
    assert set(padded_sizes(padded)) == padded_values and padded_sizes(plain) == {}
    got, want = padded(x), plain(x)
    assert got.shape == want.shape == (4, 10)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    params = list(module.parameters())
    g_pad = torch.autograd.grad(padded(x).sum(), params)
    g_plain = torch.autograd.grad(plain(x).sum(), params)
    for a, b, p in zip(g_pad, g_plain, params):
        assert a.shape == p.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)


def test_narrow_keeps_the_original_sizes_in_meta():
    """The narrow node's ``tensor_meta`` holds the GEMM's sizes before padding."""
    gm, _ = run(Linear(10, 12), (torch.randn(4, 12),), pad="always", **PAD)
    (narrow,) = narrows(gm)
    assert meta.out_infos(narrow)[0].shape == (4, 10)

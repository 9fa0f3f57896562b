"""ampfx.runtime.fp8: FP8 quantisation and a linear layer's three GEMMs. The CPU path equals torch's own
``_scaled_mm`` kernel, the forward equals the float32 product of the dequantised operands, and the gradients
equal a float32 reference computed from the same quantised operands."""
from __future__ import annotations

import pytest
import torch

from ampfx.runtime.fp8 import E4M3, E5M2, RECIPES, linear, quantize, scaled_mm


def _dq(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_path_computes_what_torchs_kernel_computes(rowwise, out_dtype):
    torch.manual_seed(0)
    a, b = torch.randn(16, 32) * 3, torch.randn(24, 32)
    qa, sa = quantize(a, E4M3, 1 if rowwise else None)
    qb, sb = quantize(b, E4M3, 1 if rowwise else None)
    kernel = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t() if rowwise else sb, out_dtype=out_dtype)
    ours = scaled_mm(qa, sa, qb.t(), sb.t() if rowwise else sb, out_dtype)
    assert ours.dtype == kernel.dtype == out_dtype
    torch.testing.assert_close(ours, kernel, rtol=1e-5 if out_dtype == torch.float32 else 1e-2, atol=1e-4)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_forward_and_gradients_equal_float32_of_the_same_quantised_operands(recipe):
    torch.manual_seed(1)
    r = RECIPES[recipe]
    x = torch.randn(6, 32, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    g = torch.randn(6, 16)
    y = linear(x, w, None, r)
    y.backward(g)
    along = (lambda d: d) if r.rowwise else (lambda d: None)
    p2, grads = r.power_of_2_scales, getattr(torch, r.backward)
    assert grads == (E4M3 if r.rowwise else E5M2) and p2 == r.rowwise  # torchao's recipes
    want_y = _dq(*quantize(x.detach(), E4M3, along(1), p2)) @ _dq(*quantize(w.detach(), E4M3, along(1), p2)).t()
    torch.testing.assert_close(y, want_y, rtol=0, atol=0)
    want_gx = _dq(*quantize(g, grads, along(1), p2)) @ _dq(*quantize(w.detach(), E4M3, along(0), p2))
    torch.testing.assert_close(x.grad, want_gx, rtol=0, atol=0)
    if r.weight_grad_high_precision:
        want_gw = g.t() @ x.detach()
    else:
        want_gw = _dq(*quantize(g.t(), grads, along(1), p2)) @ _dq(*quantize(x.detach(), E4M3, along(0), p2))
    torch.testing.assert_close(w.grad, want_gw, rtol=1e-6, atol=1e-6)


def test_the_result_is_close_to_the_float32_layer_and_keeps_dtypes():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)  # a float32 master
    b = torch.randn(32)
    y = linear(x, w, b, RECIPES["rowwise"])
    assert y.shape == (3, 5, 32) and y.dtype == torch.bfloat16
    want = torch.nn.functional.linear(x.float(), w, b)
    assert float((y.detach().float() - want).norm() / want.norm()) < 0.05
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_values_past_the_range_saturate_and_zeros_stay_finite():
    q, s = quantize(torch.tensor([1e30, -1.0, 0.0]), E4M3, None)
    assert torch.isfinite(q.float()).all() and float(q.float().abs().max()) == 448.0
    q, s = quantize(torch.zeros(4, 4), E4M3, 1)
    assert torch.isfinite(s).all() and torch.equal(_dq(q, s), torch.zeros(4, 4))


def test_shapes_the_gpu_kernel_refuses_are_computed_from_the_dequantised_operands():
    from ampfx.runtime.fp8 import _kernel_takes

    one, rows = torch.ones(()), torch.ones(16, 1)
    assert _kernel_takes(torch.empty(16, 32), one, torch.empty(32, 16), torch.float32)
    assert not _kernel_takes(torch.empty(15, 32), one, torch.empty(32, 16), torch.bfloat16)  # tokens not x16
    assert not _kernel_takes(torch.empty(16, 32), rows, torch.empty(32, 16), torch.float32)  # rowwise, fp32 out
    assert _kernel_takes(torch.empty(16, 32), rows, torch.empty(32, 16), torch.bfloat16)


def test_delayed_scaling_scales_by_the_calls_before_never_clips_and_weights_by_their_own():
    """Rule: under delayed scaling the first call equals current scaling; later calls scale the input and output
    gradient by the largest amax of the training calls before them, or by their own where larger (a value past the
    history is never clipped); the weight is scaled by its own amax at every call; a call records its input's and
    gradient's amax when its backward runs; forward and gradients equal float32 of operands quantised so."""
    from ampfx.policy.fp8 import Recipe
    from ampfx.runtime.fp8 import AmaxHistory
    torch.manual_seed(2)
    delayed, current = Recipe("delayed4", rowwise=False, amax_history=4), RECIPES["tensorwise"]
    w = torch.randn(16, 32, requires_grad=True)
    x, g = torch.randn(6, 32), torch.randn(6, 16)
    history = AmaxHistory(4)
    first = linear(x.requires_grad_(), w, None, delayed, history)
    torch.testing.assert_close(first, linear(x.detach(), w.detach(), None, current), rtol=0, atol=0)
    assert not history.values.any()  # recorded when the backward runs
    first.backward(g)
    assert history.values[:, 0].tolist() == [x.abs().max().item(), g.abs().max().item()]

    ax = x.detach().abs().max()
    small = (x.detach() / 4).requires_grad_()  # smaller than the history: scaled by the history's amax
    y = linear(small, w, None, delayed, history)
    want = _dq(*quantize(small.detach(), E4M3, None, amax=ax)) @ _dq(*quantize(w.detach(), E4M3, None)).t()
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.backward(g / 8)
    want_gx = _dq(*quantize(g / 8, E5M2, None, amax=g.abs().max())) @ _dq(*quantize(w.detach(), E4M3, None))
    torch.testing.assert_close(small.grad, want_gx, rtol=0, atol=0)

    big = (x.detach() * 1e6).requires_grad_()  # past the history: scaled by its own amax, nothing clipped
    torch.testing.assert_close(linear(big, w, None, delayed, history), linear(big.detach(), w.detach(), None, current),
                               rtol=0, atol=0)
    with torch.no_grad():
        w.mul_(1e4)  # a weight written: scaled by its new values at once
    torch.testing.assert_close(linear(x.detach(), w, None, delayed, history),
                               linear(x.detach(), w.detach(), None, current), rtol=0, atol=0)


def test_delayed_scaling_learns_nothing_from_a_step_whose_gradients_are_not_finite():
    """Rule: a call whose input or output gradient has a non-finite amax records nothing (the step GradScaler
    would skip), and one whose backward never runs records nothing."""
    from ampfx.policy.fp8 import Recipe
    from ampfx.runtime.fp8 import AmaxHistory
    delayed = Recipe("delayed4", rowwise=False, amax_history=4)
    w = torch.randn(16, 32, requires_grad=True)
    history = AmaxHistory(4)
    linear(torch.randn(6, 32), w, None, delayed, history).backward(torch.full((6, 16), float("nan")))
    linear(torch.randn(6, 32), w, None, delayed, history)  # no backward
    assert not history.values.any()
    x = torch.randn(6, 32)
    linear(x, w, None, delayed, history).backward(torch.ones(6, 16))
    assert history.values[:, 0].tolist() == [x.abs().max().item(), 1.0] and not history.values[:, 1:].any()


@pytest.mark.parametrize("bad, message", [
    ({"rowwise": True, "amax_history": 16}, "delayed scaling keeps one amax per tensor"),
    ({"rowwise": False, "amax_history": -1}, "amax_history=-1"),
    ({"rowwise": False, "amax_history": True}, "amax_history=True"),
])
def test_a_bad_delayed_recipe_is_an_error_naming_it(bad, message):
    from ampfx.errors import PolicyError
    from ampfx.policy.fp8 import Recipe
    with pytest.raises(PolicyError, match=message):
        Recipe("mine", **bad)

"""AmpfxAccelerator: an Accelerate loop trains through ampfx without autocast, like Accelerate's own bf16."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from conftest import gap

from ampfx.errors import ArgumentError
from ampfx.integrations.accelerate import AmpfxAccelerator
from ampfx.errors import PolicyMismatchError


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def batches(n=24):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, 16, generator=g)
    return [(xb, (xb[:, :4].argmax(1) + (xb[:, 4] > 1).long()) % 4) for xb in x]


def train(acc, net=None, poison_first=False, clip=None):
    net = net or model()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    net, opt = acc.prepare(net, opt)
    losses, skipped = [], []
    for i, (x, y) in enumerate(batches()):
        loss = F.cross_entropy(net(x), y)
        losses.append(loss.item())
        acc.backward(loss * math.inf if poison_first and i == 0 else loss)
        if clip:
            acc.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        skipped.append(opt.step_was_skipped)
        opt.zero_grad()
    return net, losses, skipped


def test_trains_like_accelerates_own_bf16_without_autocast(autocast_spy):
    """The loss curve is as close to Accelerator(mixed_precision='bf16') as that is to float32, no autocast
    is entered, and the report is on the accelerator."""
    _, fp32, _ = train(Accelerator(cpu=True))
    AcceleratorState._reset_state(True)
    _, own, _ = train(Accelerator(cpu=True, mixed_precision="bf16"))
    assert autocast_spy.entered > 0
    autocast_spy.entered = 0
    AcceleratorState._reset_state(True)
    acc = AmpfxAccelerator("bf16", cpu=True)
    net, amp, _ = train(acc)
    assert autocast_spy.entered == 0
    assert gap(amp, own) <= 2 * gap(own, fp32) + 1e-3
    assert amp[-1] < 0.8 * amp[0]
    assert acc.mixed_precision == "no" and acc.report.dtype == torch.bfloat16
    assert [r.op for r in acc.report.low()].count("linear") == 2
    assert net[0].weight.dtype == torch.float32


def test_float16_scales_unscales_before_clipping_and_skips_non_finite_steps():
    """fp16 on the CPU (Accelerate's own fp16 is CUDA-only): the accelerator's GradScaler skips the step with
    infinite gradients (weights unchanged, scale halved), and clip_grad_norm_ clips unscaled gradients."""
    acc = AmpfxAccelerator("fp16", cpu=True)
    assert isinstance(acc.scaler, torch.amp.GradScaler)
    net = model()
    before = net[0].weight.detach().clone()
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    net, opt = acc.prepare(net, opt)
    x, y = batches()[0]
    acc.backward(F.cross_entropy(net(x), y) * math.inf)
    opt.step()
    assert opt.step_was_skipped and torch.equal(net[0].weight, before)
    assert acc.scaler.get_scale() == 2.0 ** 15
    opt.zero_grad()
    acc.backward(F.cross_entropy(net(x), y))
    norm = acc.clip_grad_norm_(net.parameters(), 1e9)  # unscaled first: the true norm, not 2**15 times it
    assert 1e-3 < float(norm) < 100
    opt.step()
    assert not opt.step_was_skipped and not torch.equal(net[0].weight, before)
    assert acc.report.dtype == torch.float16


def test_autocast_flags_that_disagree_are_refused(monkeypatch):
    """mixed_precision= (or accelerate launch's ACCELERATE_MIXED_PRECISION) asking for another dtype's
    autocast is an error naming it; the same dtype is done by ampfx, with autocast off."""
    with pytest.raises(ArgumentError, match="mixed_precision='fp16'"):
        AmpfxAccelerator("bf16", cpu=True, mixed_precision="fp16")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ArgumentError, match="ACCELERATE_MIXED_PRECISION"):
        AmpfxAccelerator("bf16", cpu=True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert AmpfxAccelerator("bf16", cpu=True).mixed_precision == "no"


def test_a_model_prepared_by_plain_accelerate_autocast_is_refused():
    """A model whose forward Accelerate already wrapped in autocast cannot be converted: the error says to
    give it to ampfx first."""
    net = Accelerator(cpu=True, mixed_precision="bf16").prepare(model())
    AcceleratorState._reset_state(True)
    net._is_accelerate_prepared = False
    with pytest.raises(ArgumentError, match="forward was replaced"):
        AmpfxAccelerator("bf16", cpu=True).prepare(net)


def test_save_and_load_state_keep_the_scaler_and_the_policy(tmp_path):
    """save_state writes the scaler and the policy; load_state restores the scale, and an accelerator with
    another policy refuses the state, naming the field."""
    acc = AmpfxAccelerator("fp16", cpu=True, ampfx_options={"fp32_modules": ("3",)})
    net, _, _ = train(acc, poison_first=True)
    assert acc.report.by_node("linear_1").dtype == torch.float32
    acc.save_state(tmp_path / "state")
    scale = acc.scaler.get_scale()

    AcceleratorState._reset_state(True)
    again = AmpfxAccelerator("fp16", cpu=True, ampfx_options={"fp32_modules": ("3",)})
    again.prepare(model(), torch.optim.SGD(model().parameters(), lr=0.1))
    again.load_state(tmp_path / "state")
    assert again.scaler.get_scale() == scale

    AcceleratorState._reset_state(True)
    other = AmpfxAccelerator("fp16", cpu=True)
    other.prepare(model(), torch.optim.SGD(model().parameters(), lr=0.1))
    with pytest.raises(PolicyMismatchError, match="fp32_modules"):
        other.load_state(tmp_path / "state")


def test_a_module_converted_by_hand_is_refused():
    """A module that ampfx.convert already made is refused with the fix (give the model itself)."""
    import ampfx

    with pytest.raises(ArgumentError, match="already a module converted by ampfx.convert"):
        AmpfxAccelerator("bf16", cpu=True).prepare(ampfx.convert(model(), "bf16"))


def test_a_plan_with_no_gemm_low_is_said_through_the_accelerator(monkeypatch):
    """Rule: where ampfx's plan keeps every GEMM float32, the accelerator's conversion warns so, with the switch."""
    monkeypatch.setenv("AMPFX_GEMM_MIN_FLOPS", str(10 ** 12))
    acc = AmpfxAccelerator("bf16")
    with pytest.warns(UserWarning, match=r"no GEMM runs in bfloat16.*AMPFX_GEMM_MIN_FLOPS=0"):
        train(acc)
    assert "no GEMM runs in bfloat16" in acc.report.summary()

"""One layer of this model overflows float16 (its pre-activation reaches ~1e5 > 65504).

Plain conversion and torch.autocast both produce inf; ampfx.tools.debug names the layer;
conversion with a few calibration batches keeps that layer float32 and gives
loss-scale advice, and the float16 forward/backward is finite and close to FP32.

The models are tiny: each conversion passes ``gemm_min_flops=0``, which lowers every GEMM (on a CPU ampfx
would keep GEMMs this small float32, where bfloat16 is slower: docs/concepts.md#small-gemms).

    python examples/overflow_calibration.py
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import ampfx


class Hot(nn.Module):
    """A small MLP whose middle layer has weights 1e5 times too large: its outputs pass 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.hot, self.out = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 4)
        with torch.no_grad():
            self.hot.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        return self.out(self.hot(h) * 1e-3)


def loss_fn(y: torch.Tensor) -> torch.Tensor:
    return y.float().pow(2).mean()


def main() -> dict:
    torch.manual_seed(0)
    model, batches = Hot(), [torch.randn(32, 16) for _ in range(4)]
    x = batches[0]
    ref = model(x)
    plain = ampfx.convert(model, torch.float16, example_inputs=(x,), gemm_min_flops=0)
    with torch.autocast("cpu", torch.float16):
        auto = model(x)
    calibrated = ampfx.convert(model, torch.float16, calibrate=batches[1:], calibrate_loss=loss_fn,
                               gemm_min_flops=0)
    out = calibrated(x)
    loss_fn(out).backward()
    results = {
        "plain_finite": bool(torch.isfinite(plain(x)).all()),
        "autocast_finite": bool(torch.isfinite(auto).all()),
        "calibrated_finite": bool(torch.isfinite(out).all()),
        "grads_finite": all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()),
        "max_error": float(((out - ref).abs().max() / ref.abs().max()).detach()),
    }
    print(f"float16 forward finite: plain ampfx {results['plain_finite']}, autocast {results['autocast_finite']}, "
          f"ampfx with calibration {results['calibrated_finite']} (gradients finite: {results['grads_finite']})")
    print(f"calibrated output vs FP32: max relative error {results['max_error']:.2e}")
    try:
        ampfx.debug(plain)(x)
    except ampfx.NonFiniteError as e:
        print(f"ampfx.tools.debug on the plain conversion: {str(e).splitlines()[0]}")
    print(calibrated.ampfx_report.summary())
    return results


if __name__ == "__main__":
    main()

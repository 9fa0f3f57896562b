"""Large example inputs: a torch.fx capture is checked on the first rows of the batch (a torch.fx graph holds no
size), and the full example decides wherever the cut does not settle it."""
from __future__ import annotations

import torch
import torch.nn as nn

import ampfx


def _why(amp):
    return next(p.why for p in amp.ampfx_report.parts if p.path == "") if amp.ampfx_report.parts else ""


def test_a_large_example_is_checked_on_its_first_rows_and_computes_the_same():
    """Rule: example inputs of a million elements or more are checked on their first 8 rows; the converted model
    computes what the model computes on the whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x = torch.randn(4096, 256)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,), gemm_min_flops=0)
    assert "on the first rows of the example inputs" in _why(amp), _why(amp)
    torch.testing.assert_close(amp(x), model(x), rtol=5e-2, atol=5e-2)


def test_a_model_that_does_not_run_on_the_cut_is_checked_on_the_whole_example():
    """Rule: a model whose Python needs the example's batch (a reshape to a fixed size) fails on the cut; the
    check on the full example decides, and the conversion goes on as before."""
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(256, 256)

        def forward(self, x):
            return self.lin(x).reshape(4096 // 8, 8, 256).sum(1)

    torch.manual_seed(0)
    model, x = Fixed(), torch.randn(4096, 256)
    amp = ampfx.convert(model, "bf16", example_inputs=(x,), gemm_min_flops=0)
    assert "first rows" not in _why(amp)
    torch.testing.assert_close(amp(x), model(x), rtol=5e-2, atol=5e-2)


def test_small_examples_are_checked_whole():
    amp = ampfx.convert(nn.Linear(16, 16), "bf16", example_inputs=(torch.randn(32, 16),), gemm_min_flops=0)
    assert "first rows" not in _why(amp)

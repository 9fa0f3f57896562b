"""Capture details that cost a region its graph: var-positional forwards under torch.export.

- ``forward(self, *xs)`` exports with dynamic sizes: ``dynamic_shapes`` follows the inputs bound to
  ``forward``'s signature (a tuple for ``*xs``, a dict for ``**kwargs``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ampfx


# ---------------------------------------------------------------------------------------------------------------
# Cause: torch.export of a var-positional forward


class Concat(nn.Module):
    """``forward(self, *xs)``, with Python on ``len(xs)`` that torch.fx cannot trace: torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        h = torch.cat(xs, -1) if len(xs) > 1 else xs[0]
        return self.lin(h).relu()


def _export_step(amp: nn.Module) -> str:
    return next(s for s in amp.ampfx_report.regions[0].steps if s.startswith("exported"))


def test_var_positional_forward_exports_with_dynamic_sizes() -> None:
    """The export's ``dynamic_shapes`` gives ``*xs`` one tuple entry: dynamic sizes, and another batch
    size runs with no conversion made again and no GuardError."""
    torch.manual_seed(0)
    model = Concat()
    amp = ampfx.convert(model, torch.bfloat16, (torch.randn(4, 4), torch.randn(4, 4)))
    region = amp.ampfx_report.regions[0]
    assert region.method == "export"
    assert "dynamic sizes" in _export_step(amp), region.steps
    assert not any("static" in s or "dynamic_shapes" in s for s in region.steps), region.steps
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    torch.testing.assert_close(amp(a, b).float(), model(a, b), atol=0.05, rtol=0.05)
    assert amp.variants() == []


class Signature(nn.Module):
    """Positional, var-positional, keyword-only with defaults, and var-keyword parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, *xs, scale=2.0, mask=None, **extra):  # noqa: ANN001, ANN003, ANN201
        y = self.lin(x) * scale
        for t in xs:
            y = y + t
        if mask is not None:
            y = y * mask
        for v in extra.values():
            y = y + v
        return y


@pytest.mark.parametrize("args, kwargs", [
    ((4, 4, 4), {"mask": 4, "bias": 4}),
    ((4,), {"scale": 3.0, "bias": 4}),
    ((), {"x": 4, "mask": 4}),
    ((4, 4), {}),
], ids=["var-positional and var-keyword", "keyword-only and var-keyword", "keywords only", "var-positional"])
def test_export_dynamic_shapes_follow_the_signature(args: tuple, kwargs: dict) -> None:
    """``*args``, ``**kwargs``, keyword-only arguments and defaults: the export is dynamic, and a call at
    another batch size runs without GuardError."""
    torch.manual_seed(0)

    def make(n: int, spec: tuple, named: dict) -> tuple[tuple, dict]:
        return (tuple(torch.randn(n, 3) for _ in spec),
                {k: (torch.randn(n, 3) if isinstance(v, int) else v) for k, v in named.items()})

    model = Signature()
    ex_args, ex_kwargs = make(4, args, kwargs)
    amp = ampfx.convert(model, torch.bfloat16, ampfx.inputs.ExampleInputs(ex_args, ex_kwargs), tracer="export")
    assert "dynamic sizes" in _export_step(amp), amp.ampfx_report.regions[0].steps
    call_args, call_kwargs = make(7, args, kwargs)
    torch.testing.assert_close(amp(*call_args, **call_kwargs).float(), model(*call_args, **call_kwargs),
                               atol=0.05, rtol=0.05)

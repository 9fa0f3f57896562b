"""One training step of ampfx against one of CPU autocast, measured the same way: the casts made
(forward and backward), the bytes autograd saved for backward, and the GEMMs that ran. The loss is
computed in float32 inside autocast's region, as users write it; each step starts as a training
step does, from no gradients and weights an optimizer step just wrote (so the weight cache makes
its copies, as it does every step).

>>> import torch.nn as nn
>>> m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
>>> cost = against_autocast(m, (torch.randn(4, 8),))
>>> cost.casts <= cost.casts_autocast and cost.saved <= cost.saved_autocast
True
>>> cost.gemms_run, cost.gemms_reported
(2, 2)
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampfx
from ampfx.ops import ATEN_GEMMS
from ampfx.tools.measure import measure_step, saved_bytes

class GemmCounter(TorchDispatchMode):
    """Counts the ATen GEMMs (``ampfx.ops.ATEN_GEMMS``) called while active, by dtype of their first input: what
    ran, counted at dispatch, against which the report's own count (``Report.gemms``, made at conversion) is checked."""

    def __init__(self) -> None:
        super().__init__()
        self.by_dtype: dict[torch.dtype, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.overloadpacket in ATEN_GEMMS and isinstance(args[0], torch.Tensor):
            self.by_dtype[args[0].dtype] = self.by_dtype.get(args[0].dtype, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.by_dtype.values())


@dataclasses.dataclass(frozen=True)
class Cost:
    casts: int
    casts_autocast: int | None
    saved: int
    """Bytes saved for backward by ampfx's step."""
    saved_autocast: int | None
    gemms_run: int
    """GEMMs ampfx's forward ran (any dtype)."""
    gemms_low: int
    """Of those, the ones that ran in the low dtype."""
    gemms_reported: int
    """GEMMs the report counts."""
    report: Any

    def __str__(self) -> str:
        return (f"casts {self.casts} (autocast {self.casts_autocast}), saved {self.saved} B "
                f"(autocast {self.saved_autocast} B), GEMMs run {self.gemms_run} ({self.gemms_low} low), "
                f"reported {self.gemms_reported}")


def _fresh(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0)


def _float_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out.float().square().mean()
    leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return sum(t.float().square().mean() for t in leaves)


def against_autocast(model: nn.Module, inputs: tuple, loss: Callable[[Any], torch.Tensor] = _float_loss, *,
                     dtype: torch.dtype = torch.bfloat16, autocast: bool = True, **convert_options: Any) -> Cost:
    """Convert ``model`` (training mode) with ``convert_options`` and measure one step of it and one of
    ``torch.autocast("cpu", dtype)`` on the same model and inputs (``autocast=False``: ampfx's alone, the autocast
    figures ``None``; autocast's bfloat16 LSTM needs oneDNN kernels an AVX2-only CPU does not have)."""
    model.train()
    amp = convert_options.pop("amp", None) or ampfx.convert(model, dtype, example_inputs=inputs, **convert_options)
    amp.train()

    def ours() -> None:
        loss(amp(*inputs)).backward()

    def theirs() -> None:
        with torch.autocast("cpu", dtype=dtype):
            value = loss(model(*inputs))
        value.backward()

    counts, saved = [None, None], [None, None]
    for i, step in enumerate((ours, theirs) if autocast else (ours,)):
        _fresh(model)
        torch.manual_seed(0)
        counts[i] = measure_step(step).count
    for i, step in enumerate((ours, theirs) if autocast else (ours,)):
        _fresh(model)
        torch.manual_seed(0)
        saved[i] = saved_bytes(step)
    _fresh(model)
    torch.manual_seed(0)
    with torch.no_grad(), GemmCounter() as gemms:
        amp(*inputs)
    model.zero_grad(set_to_none=True)
    report = amp.ampfx_report
    return Cost(casts=counts[0], casts_autocast=counts[1], saved=saved[0], saved_autocast=saved[1],
                gemms_run=gemms.total, gemms_low=gemms.by_dtype.get(dtype, 0),
                gemms_reported=report.gemms, report=report)

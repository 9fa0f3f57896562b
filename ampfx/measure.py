"""Counting what a step costs: dtype-changing copies at the ATen level.

>>> import torch
>>> with CastCounter() as c:
...     _ = torch.ones(3).to(torch.bfloat16)
>>> c.count
1
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CastCounter(TorchDispatchMode):
    """Counts ``aten._to_copy`` calls that change dtype (forward and backward,
    autocast's casts included) and the bytes they write."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten._to_copy and isinstance(args[0], torch.Tensor):
            if "dtype" in kwargs and kwargs["dtype"] is not None and kwargs["dtype"] != args[0].dtype:
                self.count += 1
                self.bytes += out.numel() * out.element_size()
        return out


def count_casts(step: Callable[[], Any]) -> int:
    """Run ``step()`` (e.g. forward + backward) and return how many
    dtype-changing copies it made."""
    with CastCounter() as counter:
        step()
    return counter.count

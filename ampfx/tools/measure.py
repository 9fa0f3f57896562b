"""Counting what a step costs: dtype-changing copies at the ATen level, and
the bytes every op writes.

>>> import torch
>>> x = torch.ones(3)
>>> with CastCounter() as c:
...     _ = x.to(torch.bfloat16) * 2        # a cast writes 3 x 2 bytes, the product 3 x 2 more
>>> c.count, c.bytes, c.written
(1, 6, 12)
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


_LAZY_CLONE = getattr(torch.ops.aten, "_lazy_clone", None)


class CastCounter(TorchDispatchMode):
    """Counts ``aten._to_copy`` calls that change dtype (forward and backward,
    autocast's casts included) and each dtype-changing pair of an
    ``aten._foreach_copy_`` (the weight cache's refresh), and the bytes they write (``bytes``), and the
    bytes written by every op's tensor outputs, casts included (``written``: a
    measure of the memory traffic a dtype choice causes, views excluded, and ``_lazy_clone``, which copies
    nothing: :mod:`ampfx.runtime.written` stamps a tensor with it)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.bytes = 0
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten._to_copy and isinstance(args[0], torch.Tensor):
            if "dtype" in kwargs and kwargs["dtype"] is not None and kwargs["dtype"] != args[0].dtype:
                self.count += 1
                self.bytes += out.numel() * out.element_size()
        if func.overloadpacket is torch.ops.aten._foreach_copy_:  # in place, one launch for many copies
            for dst, src in zip(args[0], args[1]):
                nbytes = dst.numel() * dst.element_size()
                self.written += nbytes
                if dst.dtype != src.dtype:
                    self.count += 1
                    self.bytes += nbytes
            return out
        if not func.is_view and func.overloadpacket is not _LAZY_CLONE:
            self.written += sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def count_casts(step: Callable[[], Any]) -> int:
    """Run ``step()`` (e.g. forward + backward) and return how many
    dtype-changing copies it made."""
    with CastCounter() as counter:
        step()
    return counter.count


def measure_step(step: Callable[[], Any]) -> CastCounter:
    """Run ``step()`` and return its :class:`CastCounter` (``count``, ``bytes``, ``written``)."""
    with CastCounter() as counter:
        step()
    return counter


def saved_bytes(step: Callable[[], Any]) -> int:
    """Run ``step()`` (forward + backward) and return the bytes autograd saved for backward: the
    storages of the tensors saved, each counted once (activation memory; weights' low copies too).

    >>> w = torch.ones(4, 4, requires_grad=True)
    >>> saved_bytes(lambda: (torch.ones(2, 4) @ w).sum().backward())  # matmul saves its input: 2 x 4 x 4 bytes
    32
    """
    storages: dict[Any, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    return sum(storages.values())

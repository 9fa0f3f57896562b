"""Small integer buffers read as their values while a module is exported.

A "same"-padding convolution that keeps its stride and kernel size as buffers
(``register_buffer("stride", torch.tensor([2, 2]))``) computes its padding in Python::

    pad = max((math.ceil(ih / self.stride[0]) - 1) * self.stride[0] + ... - ih, 0)

torch.export runs that Python on fake tensors: the buffer's values are unknown, ``max`` asks
for one and export stops (``GuardOnDataDependentSymNode``); torch.fx stops at the same
``max`` (a proxy used as a bool). The module then keeps its Python and its neighbours their
float32. While :func:`folding` is active, each small integer buffer of the model's own modules
(not torch's: a batch norm's ``num_batches_tracked`` is its state) is a :class:`Folded` tensor:
what is computed from folded tensors alone is computed for real (a folded result), a folded
number meeting a size of the input gives a Python number or size expression, and a folded
tensor meeting any other tensor is that op's constant. The graph then holds the buffer's
values, as torch.fx holds a plain attribute's: :mod:`ampfx.runtime.fixed` checks them before
every call (a change converts again). A forward that writes a folded buffer stops the export
(:class:`FoldRefused`): its values are the module's state, not constants.

>>> import math, torch, torch.nn as nn
>>> class Pad(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.register_buffer("stride", torch.tensor([2, 2]))
...     def forward(self, x):
...         pad = max((math.ceil(x.shape[-1] / self.stride[0]) - 1) * self.stride[0] + 3 - x.shape[-1], 0)
...         return nn.functional.pad(x, [0, int(pad)])
>>> net = Pad()
>>> with folding(net) as folded:
...     ep = torch.export.export(net, (torch.randn(1, 15),), strict=False)
>>> folded.read, net.stride
((('', 'stride', [2, 2]),), tensor([2, 2]))
"""
from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree
from torch.utils._mode_utils import no_dispatch

from ..errors import FoldRefused

FOLD_NUMEL = 16
"""The largest integer buffer folded: strides, kernel sizes, dilations, a handful of sizes (an index table
of thousands stays a tensor of the graph)."""

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_REFLECTED = lambda op: (lambda a, b: op(b, a))  # noqa: E731
_SCALAR_OPS: dict[str, Callable[..., Any]] = {
    **{name: op for names, op in (
        (("__add__", "add"), operator.add), (("__sub__", "sub"), operator.sub), (("__mul__", "mul"), operator.mul),
        (("__truediv__", "__div__", "div", "true_divide"), operator.truediv),
        (("__floordiv__", "floor_divide"), operator.floordiv), (("__mod__", "remainder"), operator.mod),
        (("__pow__", "pow"), operator.pow), (("__lt__", "lt"), operator.lt), (("__le__", "le"), operator.le),
        (("__gt__", "gt"), operator.gt), (("__ge__", "ge"), operator.ge), (("__eq__", "eq"), operator.eq),
        (("__ne__", "ne"), operator.ne)) for name in names},
    **{name: _REFLECTED(op) for names, op in (
        (("__radd__",), operator.add), (("__rsub__",), operator.sub), (("__rmul__",), operator.mul),
        (("__rtruediv__", "__rdiv__"), operator.truediv), (("__rfloordiv__",), operator.floordiv),
        (("__rmod__",), operator.mod), (("__rpow__",), operator.pow)) for name in names},
}
"""Tensor methods a folded number may meet a size in (``ih / self.stride[0]``), as Python's operators."""


class Folded(torch.Tensor):
    """A real tensor standing for a buffer's values while :func:`folding` is active (see the module
    docstring). ``_ampfx_plain`` holds the plain tensor, ``_ampfx_from`` the buffers it was computed from,
    ``_ampfx_folding`` the :class:`Folding` told of every read."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        folded = [a for a in leaves if isinstance(a, Folded)]
        folding, sources = folded[0]._ampfx_folding, frozenset().union(*(f._ampfx_from for f in folded))
        folding.reads |= sources
        name = getattr(func, "__name__", "")
        if _writes(name, kwargs):
            raise FoldRefused(f"the forward writes a buffer folded into the graph ({name})")
        plain = pytree.tree_map_only(Folded, lambda f: f._ampfx_plain, (args, kwargs))
        others = [a for a in leaves if isinstance(a, torch.Tensor) and not isinstance(a, Folded)]
        sizes = [a for a in leaves if isinstance(a, _SYMBOLIC)]
        if not others and not sizes:  # computed from folded values alone: for real, and folded too
            with torch._C.DisableTorchFunction(), no_dispatch():
                out = func(*plain[0], **plain[1])
                out = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), out)
            return pytree.tree_map_only(torch.Tensor, lambda t: _fold(t, folding, sources), out)
        if sizes and not others and name in _SCALAR_OPS and all(f.dim() == 0 for f in folded):
            with torch._C.DisableTorchFunction(), no_dispatch():
                numbers = pytree.tree_map_only(torch.Tensor, lambda t: t.item(), plain)
            return _SCALAR_OPS[name](*numbers[0], **numbers[1])
        with torch._C.DisableTorchFunctionSubclass():  # a constant of the op
            return func(*plain[0], **plain[1])


def _writes(name: str, kwargs: dict) -> bool:
    """Does the Tensor method or function ``name`` write its first argument (``add_``, ``x[i] = v``, ``+=``) or an
    ``out=`` tensor?"""
    in_place = name.endswith("_") and not name.endswith("__") and name != "__get__"
    return in_place or name == "__setitem__" or (name.startswith("__i") and name.endswith("__")
                                                and name not in ("__index__", "__int__", "__invert__")) \
        or "out" in kwargs


def _fold(t: torch.Tensor, folding: Folding, sources: frozenset[tuple[str, str]]) -> Folded:
    f = torch.Tensor._make_subclass(Folded, t)
    f.__dict__.update(_ampfx_plain=t, _ampfx_folding=folding, _ampfx_from=sources)
    return f


@dataclass
class Folding:
    """What :func:`folding` folded: the values of each buffer by ``(module path, name)``, and (after the
    block) ``read``: ``(module path, name, values)`` of those the forward read. ``active``: a caller's
    flag, set once folding is needed."""

    values: dict[tuple[str, str], Any] = field(default_factory=dict)
    reads: set[tuple[str, str]] = field(default_factory=set)
    read: tuple[tuple[str, str, Any], ...] = ()
    active: bool = False


def candidates(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(module path, module, buffer name)`` of the buffers :func:`folding` folds: integer or bool, at most
    :data:`FOLD_NUMEL` values, of modules outside torch (whose integer buffers are counters they update).

    >>> class Pad(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("stride", torch.tensor([2, 2]))
    ...         self.norm = nn.BatchNorm1d(2)
    >>> [(p, n) for p, _, n in candidates(Pad())]
    [('', 'stride')]
    """
    return [(path, m, name) for path, m in model.named_modules() if not type(m).__module__.startswith("torch.")
            for name, b in m._buffers.items()
            if b is not None and not b.is_floating_point() and not b.is_complex() and b.numel() <= FOLD_NUMEL
            and not b.requires_grad and b.device.type != "meta"]


@contextlib.contextmanager
def folding(model: nn.Module) -> Iterator[Folding]:
    """While active, each :func:`candidates` buffer of ``model`` is read as a :class:`Folded` tensor of its
    values (an instance attribute over the buffer, which export then does not see); put back after."""
    found = Folding()
    saved: dict[int, tuple[nn.Module, dict]] = {}
    for path, m, name in candidates(model):
        saved.setdefault(id(m), (m, dict(m._buffers)))
        b = m._buffers.pop(name)
        found.values[(path, name)] = b.tolist()
        m.__dict__[name] = _fold(b, found, frozenset({(path, name)}))
    try:
        yield found
    finally:
        for m, buffers in saved.values():
            for name in buffers.keys() - m._buffers.keys():
                m.__dict__.pop(name, None)
            added = {k: v for k, v in m._buffers.items() if k not in buffers}
            m._buffers.clear()
            m._buffers.update(buffers)
            m._buffers.update(added)
        found.read = tuple((p, n, v) for (p, n), v in found.values.items() if (p, n) in found.reads)

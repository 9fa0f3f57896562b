"""Reuse of meta-tensor (or fake-tensor) results across the repeated blocks of one graph.

Shape propagation on ``meta`` tensors runs torch's Python references for some ops (``layer_norm``
goes through ``torch._refs``, about 1 ms a call); a model of 2,000 identical blocks runs the same op
on the same sizes 2,000 times. :class:`ShapeMemo` keys a call by what its result can depend on: the
op, the sizes, strides, dtype, device and ``requires_grad`` of each tensor argument and the value of every
other argument, and for a module its class, mode and plain attributes (with its parameters' and
buffers' sizes, and the same of its children). A call whose key was seen gets fresh meta tensors of
the recorded sizes instead of running again.

Nothing is reused where reuse could differ from a run: an in-place op (its change to its input's
sizes would be lost), a result that is one of the inputs, a module with hooks or with an attribute
that is not a plain value (a function, an object: its behaviour is not in the key), a module whose
run changed its own attributes or an input's sizes, and any argument that is not a tensor or a plain
value.

>>> memo = ShapeMemo()
>>> x = torch.empty(2, 3, device="meta")
>>> key = memo.key_of_call(torch.add, (x, 1.0), {})
>>> memo.find(key) is None
True
>>> memo.keep(key, torch.add(x, 1.0), (x, 1.0), {})
>>> memo.find(key).shape
torch.Size([2, 3])
>>> memo.key_of_call(torch.ops.aten.add_.Tensor, (x, 1.0), {}) is None  # it writes into x
True
"""
from __future__ import annotations

from typing import Any, Hashable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from .. import ops
from ..state import TORCH_KEYS

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout,
          type(Ellipsis))
_NO_KEY = object()
_TENSORS = (torch.Tensor, torch.nn.Parameter, FakeTensor)
_MODULE_KEYS = TORCH_KEYS - {"_parameters", "_buffers", "_modules", "training"}
_UNSAFE = object()
"""Stored under a key whose run showed it must not be reused."""


def _leaf_key(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        if type(value) not in _TENSORS or value.layout is not torch.strided:
            return _NO_KEY
        return ("T", tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.requires_grad,
                value.device.type)
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, slice):
        parts = tuple(_leaf_key(p) for p in (value.start, value.stop, value.step))
        return _NO_KEY if _NO_KEY in parts else ("slice",) + parts
    if type(value) is torch.Size:
        return ("Size", tuple(value))
    return _NO_KEY


def _tree_key(tree: Any) -> Hashable:
    """The key of a nest of tuples, lists and dicts (the arguments of a call), or ``_NO_KEY``."""
    kind = type(tree)
    if isinstance(tree, (tuple, list)) and kind is not torch.Size:  # fx's immutable_list, namedtuples too
        keys = tuple(_tree_key(v) for v in tree)
        return _NO_KEY if any(k is _NO_KEY for k in keys) else (kind, keys)
    if isinstance(tree, dict):
        keys = tuple((k, _tree_key(v)) for k, v in tree.items())
        return _NO_KEY if any(k is _NO_KEY for _, k in keys) or not all(type(k) is str for k, _ in keys) \
            else (kind, keys)
    return _leaf_key(tree)


def _module_key(mod: torch.nn.Module) -> Hashable:
    """What a module's run on meta tensors can depend on besides its inputs, or ``_NO_KEY``."""
    parts: list[Any] = [type(mod)]
    for name, value in sorted(vars(mod).items()):
        if name in ("_parameters", "_buffers"):
            tensors = tuple((k, None if t is None else _leaf_key(t)) for k, t in value.items())
            if any(k is _NO_KEY for _, k in tensors):
                return _NO_KEY
            parts.append((name, tensors))
        elif name == "_modules":
            children = tuple((k, None if m is None else _module_key(m)) for k, m in value.items())
            if any(k is _NO_KEY for _, k in children):
                return _NO_KEY
            parts.append(children)
        elif name in _MODULE_KEYS:  # nn.Module's own hook dicts and bookkeeping
            if "forward" in name and value:
                return _NO_KEY  # a hook's behaviour is not in the key
        else:
            key = _tree_key(value)
            if key is _NO_KEY:
                return _NO_KEY
            parts.append((name, key))
    return tuple(parts)


def _in_place(target: Any) -> bool:
    """Does the op write into an argument (``add_``, ``aten.add_.Tensor``, ``setitem``, ``out=`` ops)?"""
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    return ops.is_inplace_name(target if isinstance(target, str) else getattr(target, "__name__", "")) \
        or ops.is_inplace_operator(target)


class ShapeMemo:
    """Results of meta-tensor calls by key, for one propagation (see the module's docstring)."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, Any] = {}
        self._unsafe_types: set[type] = set()

    def key_of_call(self, target: Any, args: Any, kwargs: Any) -> Hashable | None:
        """Key of a ``call_function`` or ``call_method`` (target a string), or ``None``: not reusable."""
        if _in_place(target):
            return None
        key = _tree_key((args, kwargs))
        return None if key is _NO_KEY else (target, key)

    def key_of_module(self, mod: torch.nn.Module, args: Any, kwargs: Any) -> Hashable | None:
        from torch.nn.modules import module as nn_module

        if type(mod) in self._unsafe_types or nn_module._global_forward_hooks or \
                nn_module._global_forward_pre_hooks:
            return None
        inputs = _tree_key((args, kwargs))
        state = _module_key(mod) if inputs is not _NO_KEY else _NO_KEY
        return None if state is _NO_KEY else ("module", state, inputs)

    def state_of(self, module: torch.nn.Module) -> Hashable:
        """What a module's run depends on besides its inputs (:meth:`keep` compares it after the run)."""
        return _module_key(module)

    def find(self, key: Hashable | None) -> Any:
        """A fresh copy of the result stored under ``key``, or ``None``."""
        if key is None:
            return None
        found = self._seen.get(key)
        if found is None or found is _UNSAFE:
            return None
        leaves, spec = found
        return tree_unflatten([_fresh(v) for v in leaves], spec)

    def keep(self, key: Hashable | None, result: Any, args: Any, kwargs: Any,
             module: torch.nn.Module | None = None, state: Hashable = None) -> None:
        """Store ``result`` of the run keyed ``key``; the inputs are checked for changes the run made,
        which a reuse would not make, and so is ``module`` (the module that ran: its key before the run
        is ``state``; a class whose run changes its attributes is not reused again)."""
        if module is not None and _module_key(module) != state:  # its next run differs: the class is not reused
            self._unsafe_types.add(type(module))
            if key is not None:
                self._seen[key] = _UNSAFE
            return
        if key is None:
            return
        inputs = (args, kwargs)
        leaves, spec = tree_flatten(result)
        ins = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
        now, before = _tree_key(inputs), key[1] if module is None else key[2]
        if now != before or any(v is t for v in leaves for t in ins) or _tree_key(result) is _NO_KEY:
            if module is not None:
                self._unsafe_types.add(type(module))
            self._seen[key] = _UNSAFE
            return
        self._seen[key] = ([_spec(v) for v in leaves], spec)


class _TensorSpec(tuple):
    pass


def _spec(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _TensorSpec((tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
                            value.requires_grad, value.device))
    return value


def _fresh(value: Any) -> Any:
    """A tensor of the recorded sizes on the recorded device: a meta tensor, or under a ``FakeTensorMode`` a
    fake one (:mod:`ampfx.passes.gemms`)."""
    if isinstance(value, _TensorSpec):
        shape, stride, offset, dtype, grad, device = value
        out = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if offset:
            out = out.as_strided(shape, stride, offset)
        return out.requires_grad_(grad) if grad and (dtype.is_floating_point or dtype.is_complex) else out
    return value

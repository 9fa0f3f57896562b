"""Has a tensor been written since a moment? Every in-process write seen, at two C calls a check.

A copy kept across calls (the low copies of ``mode="inference"`` and of the weight cache, the values a
graph holds of a buffer) is stale once its source is written. Version counters miss writes made
through ``.data`` (``p.data.mul_(m)``: a teacher's momentum update, a hand-written SGD step,
``_init_weights``), since ``.data`` is a tensor with a version counter of its own, and fused
optimizer steps, which bump none. torch's copy-on-write storage sees them all: :func:`stamp`
makes the tensor's storage copy-on-write with no other owner (``torch._lazy_clone``, the clone
dropped at once: nothing is copied and no memory is held), and the first write through any
tensor that shares the storage (the tensor, its views, its ``.data``, a fused kernel) takes the
storage back as an ordinary one, in place and without a copy. :func:`unwritten` reads that
flag and the storage's identity (``p.data = t`` re-points the tensor).

Several holders stamp one tensor (two conversions of one model, a weight tied across graph modules, the cache
and a buffer check): a holder that finds it written stamps it again, making it copy-on-write once more, which
must not hide that write from the others. So each stamp is a number never given before, and the storage keeps
the last one given for it: a holder's stamp stands while the storage is copy-on-write *and* still holds that
number; stamping a storage no write touched since the last stamp gives that same number.

What it cannot see, so stamps are refused for it (:func:`stamp` returns ``None``, and a copy of
the tensor is made again at every call):

- storage in shared memory (``model.share_memory()``: Hogwild workers write it from other
  processes);
- a torch without copy-on-write storage (before 2.3), tensor subclasses (DTensor), meta tensors;
- a tensor ``torch.func`` wraps (``torch.vmap``'s batched tensors, ``torch.func.grad``'s): it has no storage of its
  own, and lives for one call of the transform.

Reading the storage's raw address (``t.data_ptr()``, ``t.numpy()``, ``torch.save``) counts as a
write: the copy is made again, needlessly but correctly. A NumPy array taken from the tensor
*before* the stamp writes behind its back: write such tensors through torch.

>>> import torch
>>> p = torch.nn.Parameter(torch.ones(3))
>>> s = stamp(p)
>>> unwritten(p, s)
True
>>> _ = p.data.mul_(2)            # through .data: no version counter moves
>>> unwritten(p, s), p._version
(False, 0)
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

_LAZY_CLONE = getattr(torch, "_lazy_clone", None)
_IS_COW = getattr(torch._C, "_is_cow_tensor", None)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
_STAMPS: dict[int, int] = {}  # a stamped storage's identity -> the last stamp given for it (two ints a storage)
_NUMBERS = itertools.count(1)  # every stamp a number of its own


def _identity(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the storage itself (not its address: reading that counts as a write)


def stamp(t: Any) -> int | None:
    """Mark ``t``'s storage so that the next write to it shows (:func:`unwritten`); the stamp, or ``None`` where
    writes to ``t`` cannot be seen (see the module docstring: then treat ``t`` as written at every check)."""
    if (_LAZY_CLONE is None or _IS_COW is None or type(t) not in _PLAIN or t.layout != torch.strided
            or t.device.type == "meta" or (_WRAPPED is not None and _WRAPPED(t))):  # a batched or grad-tracking tensor
        return None
    try:
        if t.device.type == "cpu" and t.is_shared():  # CUDA storage says shared
            return None
        key = _identity(t)
        held = _STAMPS.get(key)
        if held is not None and _IS_COW(t):
            return held  # stamped, and written by nothing since (another holder's stamp): the same stamp
        with torch.no_grad():
            _LAZY_CLONE(t.detach())  # the clone is dropped: the storage stays copy-on-write with one owner
        if not _IS_COW(t):
            return None
        mark = _STAMPS[key] = next(_NUMBERS)
        return mark
    except (RuntimeError, NotImplementedError):  # a tensor without storage, or one torch cannot make copy-on-write
        return None


def unwritten(t: Any, mark: int | None) -> bool:
    """Is ``t`` unwritten since :func:`stamp` gave ``mark`` (its storage neither written nor replaced)?"""
    if mark is None:
        return False
    try:
        return _IS_COW(t) and _STAMPS.get(_identity(t)) == mark
    except (RuntimeError, NotImplementedError):  # no storage to read (a tensor torch.func wraps): unseen, so written
        return False

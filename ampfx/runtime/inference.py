"""Inference mode: the weights of low-precision ops cast once, and again only when they change.

In training mode (the default) parameters stay float32 masters and are cast
after ``get_attr`` on every call. With ``convert(..., mode="inference")`` a
parameter whose every graph use is a cast to the low dtype is read from a
low-precision copy the converted graph module keeps (:class:`LowCopies`): the
casts in the graph then find the dtype already right and copy nothing. The
copy is made again before a call when its float32 master changed: written in
place by anything in the process (an in-place load, an optimizer step, fused ones
too, a write through ``.data`` such as a teacher's momentum update:
:mod:`ampfx.runtime.written`), re-pointed (``p.data = t``, ``vector_to_parameters``)
or replaced. A master in shared memory (``model.share_memory()``, whose Hogwild
workers write it from other processes) is copied at every call. A value given for one call in place of a
parameter (``torch.func.functional_call``'s tensors, the batched and grad-tracking tensors of ``torch.vmap`` and
``torch.func.grad`` over it, as in a ``stack_module_state`` ensemble) is read as it is and cast by the graph at that
call, as in training mode (its gradient reaches it), then let go: the copies of the model's own weights stay.
Parameters any consumer reads in float32 (batch-norm and layer-norm
affine parameters, embedding tables, biases added in float32) and the
parameters of leaves (which run as the model's own modules) are not copied.
The model's parameters are not changed, and they are the converted module's
``parameters()``: the copies sit beside them (2 bytes per bf16/fp16 weight). A graph module converted again at a
call (a value its graph fixed changed) keeps copies of its own, as the first conversion did.

>>> import torch, ampfx
>>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
>>> x = torch.ones(1, 8)
>>> inf, train = ampfx.convert(m, "bf16", mode="inference"), ampfx.convert(m, "bf16")
>>> _ = inf(x)                    # (converting the second wrote the weights back, so the first call copies)
>>> ampfx.count_casts(lambda: inf(x)) < ampfx.count_casts(lambda: train(x)), m[0].weight.dtype
(True, torch.float32)
>>> with torch.no_grad():
...     _ = m[0].weight.zero_()   # the master changes: its copy is made again at the next call
>>> torch.equal(inf(x), train(x))
True
>>> _ = m[2].weight.data.mul_(2)  # through .data too (a teacher's momentum update)
>>> torch.equal(inf(x), train(x))
True
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from .. import runtime
from . import written
from .reads import reads
from ..errors import StaleModelError


def _low_only_params(gm: fx.GraphModule, low: torch.dtype) -> set[str]:
    """``get_attr`` targets of parameters every graph use of which is a cast to ``low`` (:func:`reads`)."""
    wanted: dict[str, bool] = {}
    for r in reads(gm, low):
        if r.owner is None or r.param.dtype not in runtime.CASTABLE:
            continue
        wanted[r.path] = wanted.get(r.path, True) and r.how in ("cast", "cast_pad") and r.dtype == low
    return {k for k, ok in wanted.items() if ok}


@dataclass(eq=False)
class LowCopies:
    """The low-precision copies a graph module reads in place of float32 parameters, each made again
    before a call when its master changed: ``(owner's parameter dict, name, attribute the graph reads,
    master when copied, its version and storage then)``."""

    dtype: torch.dtype
    entries: list[list[Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # each copy's parameter, by its path in the graph module

    def add(self, owner: dict, name: str, attr: str, path: str) -> None:
        self.entries.append([owner, name, attr, None, None])
        self.paths.append(path)

    def __repr__(self) -> str:
        return f"LowCopies({str(self.dtype).replace('torch.', '')}: {', '.join(self.paths)})"

    def _anew(self, owner: Callable[[dict], dict]) -> list[list[Any]]:
        """The entries of a copy (``owner`` maps each parameter dict to the copy's): each low copy made again at
        its first call, since the copied masters' version counters start anew."""
        return [[owner(d), name, attr, None, None] for d, name, attr, _, _ in self.entries]

    def __deepcopy__(self, memo: dict) -> "LowCopies":
        return LowCopies(self.dtype, self._anew(lambda d: copy.deepcopy(d, memo)), list(self.paths))

    def __getstate__(self) -> dict:
        return {"dtype": self.dtype, "paths": self.paths, "entries": self._anew(lambda d: d)}

    def refresh(self, gm: nn.Module) -> list[tuple[str, Any]] | None:
        """Copy again each weight whose master was replaced or written since its copy was made. A value given for
        this call only (:func:`_given_for_the_call`) is read as it is, the graph casting it; the attributes it
        was put in, with what they held (:meth:`put_back` after the call), or ``None`` where there is none."""
        lent = None
        for entry in self.entries:
            owner, name, attr, seen, mark = entry
            master = owner.get(name)
            if master is seen and written.unwritten(master, mark):
                continue  # neither replaced, re-pointed, nor written (through .data and fused kernels too)
            if master is None:
                raise StaleModelError(f"parameter {name!r} the inference-mode conversion reads was removed from the "
                                      "model: convert the model again")
            if _given_for_the_call(master):  # the graph's cast makes its low value (with its gradient): no copy kept
                lent = lent if lent is not None else []
                lent.append((attr, gm.__dict__.get(attr)))
                gm.__dict__[attr] = master
                continue
            with torch.no_grad():
                gm.__dict__[attr] = master.detach().to(self.dtype) if master.dtype in runtime.CASTABLE else master
            entry[3], entry[4] = master, written.stamp(master)
        return lent

    @staticmethod
    def put_back(gm: nn.Module, lent: list[tuple[str, Any]]) -> None:
        """After a call that read values given for it (:meth:`refresh`): the copies the graph reads otherwise."""
        for attr, held in lent:
            if held is None:
                gm.__dict__.pop(attr, None)  # none made yet: the next call makes it
            else:
                gm.__dict__[attr] = held

    def nbytes(self) -> int:
        return sum(e[3].numel() * torch.finfo(self.dtype).bits // 8 for e in self.entries if e[3] is not None)


def _given_for_the_call(t: torch.Tensor) -> bool:
    """Is ``t``, found in a parameter's place, a value given for one call rather than a parameter of the model:
    a plain tensor (``torch.func.functional_call`` puts its tensors there; a module's own parameters are
    ``nn.Parameter``), or one a ``torch.func`` transform wraps (``torch.vmap``'s, ``torch.func.grad``'s)?"""
    return not isinstance(t, nn.Parameter) or bool(_WRAPPED is not None and _WRAPPED(t))


_WRAPPED = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)


def store_low(gm: fx.GraphModule, low: torch.dtype) -> LowCopies:
    """Make ``gm`` read a low-precision copy of each parameter all of whose uses are casts to ``low``
    (tied parameters share one copy); the copies, made now, which ``gm`` is armed with
    (:func:`ampfx.runtime.arming.arm`, ``low``)."""
    names = _low_only_params(gm, low)
    copies = LowCopies(low)
    attrs: dict[tuple[int, str], str] = {}
    for node in gm.graph.nodes:
        target = str(node.target)
        if node.op != "get_attr" or target not in names:
            continue
        owner_path, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        key = (id(owner._parameters[leaf]), leaf)
        if key not in attrs:
            attrs[key] = f"_ampfx_low{len(attrs)}"
            copies.add(owner._parameters, leaf, attrs[key], target)
        node.target = attrs[key]
    gm.recompile()
    lent = copies.refresh(gm)
    if lent:  # converted while functional_call's values sit in the parameters' places: copies made at the first call
        copies.put_back(gm, lent)
    return copies

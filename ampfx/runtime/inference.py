"""Inference mode: the weights of low-precision ops cast once, and again only when they change.

In training mode (the default) parameters stay float32 masters and are cast
after ``get_attr`` on every call. With ``convert(..., mode="inference")`` a
parameter whose every graph use is a cast to the low dtype is read from a
low-precision copy the converted graph module keeps, in the weight cache training mode uses
(:class:`~ampfx.runtime.weight_cache.WeightCache` with ``reads_copies``: one store of weight copies): the
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

from typing import Any

import torch
import torch.fx as fx

from .. import runtime
from .reads import reads
from .weight_cache import WeightCache, _Entry


def _low_only_params(gm: fx.GraphModule, low: torch.dtype) -> set[str]:
    """``get_attr`` targets of parameters every graph use of which is a cast to ``low`` (:func:`reads`)."""
    wanted: dict[str, bool] = {}
    for r in reads(gm, low):
        if r.owner is None or r.param.dtype not in runtime.CASTABLE:
            continue
        wanted[r.path] = wanted.get(r.path, True) and r.how in ("cast", "cast_pad") and r.dtype == low
    return {k for k, ok in wanted.items() if ok}


class LowCopies:
    """Inference copies as a module pickled before they were kept by the weight cache holds them: loaded, they become
    that cache (:meth:`as_cache`, by :class:`ampfx.runtime.entries.Runtime` as it is loaded). Nothing makes one now."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def as_cache(self) -> WeightCache:
        """The weight cache over the same parameters, read from the same attributes, each copy made again at its
        first call."""
        entries = [_Entry(owner, name, path, attr=attr) for (owner, name, attr, _, _), path in
                   zip(self.entries, self.paths)]
        return WeightCache(self.dtype, entries, reads_copies=True)


def store_low(gm: fx.GraphModule, low: torch.dtype) -> WeightCache:
    """Make ``gm`` read a low-precision copy of each parameter all of whose uses are casts to ``low``
    (tied parameters share one copy) from an attribute of its own; the weight cache that keeps those copies
    (:class:`~ampfx.runtime.weight_cache.WeightCache`, ``reads_copies``), made now, which ``gm`` is armed with
    (:func:`ampfx.runtime.arming.arm`, ``weights``)."""
    names = _low_only_params(gm, low)
    copies = WeightCache(low, reads_copies=True)
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
            copies.entries.append(_Entry(owner._parameters, leaf, target, attr=attrs[key]))
        node.target = attrs[key]
    gm.recompile()
    lent: list[tuple[str, Any]] = []
    copies.refresh(entries=copies.entries, gm=gm, lent=lent)
    if lent:  # converted while functional_call's values sit in the parameters' places: copies made at the first call
        copies.put_back(gm, lent)
    return copies

"""Low-precision values handed between converted children through their parent's own Python.

A module that keeps its Python (control flow on tensor values) has its children converted one by one.
Where its Python only moves a child's outputs into other converted children (views, transposes, a
``cat``: :data:`ampfx.ops.MOVES`), the child returns them in the low dtype it computes them in and the
next child takes them so, as under ``torch.autocast``, instead of a cast to float32 and back at every
boundary. The observation run shows where that pays (:mod:`ampfx.capture.observe`); this module makes
it safe on every call, whatever path the parent's Python takes:

- while the parent's Python runs, a :class:`Handing` mode (a ``TorchFunctionMode``) follows the low
  values the children hand it: ops that move them keep them low, and ``h.dtype`` says float32; anything
  else that reads or writes one (an add, ``h += 1``, an ``nn.Linear`` the parent calls itself) finds it
  back in float32, one cast, the one the child's graph made before (a write through one view is seen
  through the others, as in the model);
- a converted child called there runs outside the mode (:meth:`Linked.run`) and hands its low outputs
  to it; the same child called anywhere else returns its outputs in their original dtypes;
- what the parent returns is float32 again (:meth:`Handing.lift`).

So the parent's Python sees the values it saw before, exactly (an upcast from the low dtype is exact):
only values that go from child to child through moves stay low.

>>> import torch
>>> with Handing(torch.bfloat16) as mode:
...     h = torch.ones(2, 3, dtype=torch.bfloat16)
...     mode.hand(h, (torch.float32,))
...     moved = h.t().contiguous()            # a move: still the child's low value
...     summed = h + torch.ones(2, 3)         # read in float32
...     seen = h.dtype
>>> moved.dtype, summed.dtype, seen
(torch.bfloat16, torch.float32, torch.float32)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack, _pop_mode_temporarily
from torch.utils._pytree import tree_leaves, tree_map

from .. import ops

MOVE, SIZE, DTYPE, WRITE, COMPUTE = "move", "size", "dtype", "write", "compute"


def kind(func: Callable, args: tuple, kwargs: dict) -> str:
    """What ``func`` (as ``__torch_function__`` receives it: a function, a ``Tensor`` method, an attribute's
    ``__get__``) does with the tensors it reads: moves them (:data:`MOVE`), reads their sizes (:data:`SIZE`) or
    dtype (:data:`DTYPE`) or what is the same for a low value and its upcast (:data:`SIZE`: ``h.shape``,
    ``h.item()``), writes into its first argument (:data:`WRITE`), or computes (:data:`COMPUTE`).

    >>> kind(torch.Tensor.view, (), {}), kind(torch.cat, (), {}), kind(torch.Tensor.add, (), {})
    ('move', 'move', 'compute')
    >>> kind(torch.Tensor.to, (torch.ones(1), torch.float16), {}), kind(torch.Tensor.add_, (), {})
    ('compute', 'write')
    """
    try:
        what = _by_name(func)
    except TypeError:  # unhashable
        what = _by_name.__wrapped__(func)
    if what is not None:
        return what
    named = [v for v in tree_leaves((args[1:], kwargs)) if isinstance(v, (torch.dtype, torch.Tensor, str))]
    return COMPUTE if any(not isinstance(v, str) or "Tensor" in v for v in named) else MOVE


@functools.lru_cache(maxsize=4096)
def _by_name(func: Callable) -> str | None:
    """:func:`kind` of ``func`` where its name alone says (once per callable: the parent's Python runs it per
    op); ``None`` for a method that moves unless its arguments name a dtype (``to``)."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # an attribute: Tensor.shape, Tensor.T
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    if name in ops.SIZE_ATTRS or name in ops.TO_PYTHON:  # the same for a low value and its upcast
        return SIZE
    if name == "dtype":
        return DTYPE
    if name in ops.MOVE_METHODS:
        return None
    if name == "__setitem__" or ops.is_inplace_name(name):
        return WRITE
    if name == "__getitem__" or (ops.lookup_name(func) or ops.lookup_name(name)) in ops.MOVES:
        return MOVE
    return COMPUTE


def _floats(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class Handing(TorchFunctionMode):
    """The mode a parent's Python runs in while its converted children hand each other ``low`` values
    (see the module docstring). ``made``: the low tensors handed to it, and those moves made of them (kept
    alive for the call, so that their ids stay theirs).

    Where its Python does more than move one of them, the op reads it in float32: a view of one float32
    copy of its storage (one cast a value, as the child's graph made one for its output before; a part of
    a storage no whole view reads is copied alone). Where it writes into one (``h += 1``, through a view)
    or an op returns what shares a copy's storage (``h.float()``, which was ``h`` itself in the model), that
    storage goes back to float32 for good (:meth:`_settle`): every handed tensor in it is a float32 view of
    one copy from then on, so a write through one is seen through every other, as in the model, and no
    graph output is written in place (autograd may have saved it)."""

    def __init__(self, low: torch.dtype) -> None:
        super().__init__()
        self.low = low
        self.made: dict[int, torch.Tensor] = {}
        self.copies: dict[tuple, Any] = {}  # by storage (or tensor, for a part): float32, until a child runs
        self.holds: dict[tuple, torch.Tensor] = {}  # a tensor of each storage copied: its memory is not reused meanwhile
        self.settled: dict[int, torch.Tensor] = {}  # by id of a handed tensor: its float32 view, from then on

    def hand(self, value: Any, originals: tuple[torch.dtype, ...] | None = None) -> None:
        """The ``low`` float tensors of ``value``, a child's outputs, are handed values (with ``originals``,
        only those whose original dtype, in the order of ``value``'s float tensors, is float32)."""
        self.copies.clear()  # a child ran: it may have written into what it was handed
        self.holds.clear()
        for k, t in enumerate(_floats(value)):
            original = originals[k] if originals is not None and k < len(originals) else torch.float32
            if t.dtype == self.low and original == torch.float32:
                self._make(t)

    def _make(self, t: torch.Tensor) -> None:
        self.made[id(t)] = t

    def _settled(self, t: torch.Tensor) -> torch.Tensor | None:
        return self.settled.get(id(t))

    def handed(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and self.made.get(id(t)) is t

    def lift(self, value: Any) -> Any:
        """``value`` with its handed tensors in float32, the dtype the parent's Python was written for."""
        return tree_map(lambda v: self._lift(v) if self.handed(v) else v, value)

    def resolve(self, value: Any) -> Any:
        """``value`` with each handed tensor that went back to float32 for good in its float32 view (what the
        Python may have written since); the others as they are."""
        return tree_map(lambda v: self._settled(v) if self.handed(v) and self._settled(v) is not None else v, value)

    def settle(self, value: Any) -> None:
        """The handed tensors of ``value`` in float32 for good (:meth:`_settle`)."""
        for t in _floats(value):
            if self.handed(t):
                self._settle(t)

    def _lift(self, t: torch.Tensor) -> torch.Tensor:
        hit = self._settled(t)
        if hit is not None:
            return hit
        key = _storage(t)
        whole = self.copies.get(key)
        if whole is not None and t.requires_grad and not whole.requires_grad:
            whole = None  # made for a detached alias of t: its copy carries no gradient
        if whole is None and _spans(t):
            whole = self.copies[key] = _float32(t, flat=True)
            self.holds[key] = t
        if whole is not None:
            return _follow(_view(whole, t), t)
        part = self.copies.get(("part", id(t)))
        if part is None or part[0] is not t:
            part = self.copies[("part", id(t))] = (t, _float32(t))
        return part[1]

    def _settle(self, t: torch.Tensor) -> None:
        """Every handed tensor sharing ``t``'s storage in float32 for good (see the class docstring)."""
        if self._settled(t) is not None:
            return
        key = _storage(t)
        members = [m for m in self.made.values() if self._settled(m) is None and _storage(m) == key]
        whole = self.copies.pop(key, None)
        self.holds.pop(key, None)
        if whole is None or (not whole.requires_grad and any(m.requires_grad for m in members)):
            whole = _assemble(members, t.untyped_storage().nbytes() // t.element_size())
        with torch.enable_grad():  # views that record autograd even where the write is made under no_grad
            for m in members:
                self.settled[id(m)] = _follow(_view(whole, m), m)
                self.copies.pop(("part", id(m)), None)

    def _copies_in(self, read: list[torch.Tensor]) -> dict[tuple, torch.Tensor]:
        """The storages of the float32 copies ``read`` was lifted to, with a handed tensor each."""
        found = {}
        for t in read:
            if self._settled(t) is not None:
                continue
            part = self.copies.get(("part", id(t)))
            copy = part[1] if part is not None and part[0] is t else self.copies.get(_storage(t))
            if copy is not None:
                found[_storage(copy)] = t
        return found

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        floats = _floats((args, kwargs))
        read = [t for t in floats if self.handed(t)]
        if not read:
            return func(*args, **kwargs)
        what = kind(func, args, kwargs)
        if what == SIZE:
            return func(*args, **kwargs)
        if what == DTYPE:
            return torch.float32
        if what == MOVE and len(read) == len(floats) and not any(self._settled(t) is not None for t in read):
            out = func(*args, **kwargs)
            for t in _floats(out):
                self._make(t)
            return out
        if what == WRITE and args and self.handed(args[0]):
            self._settle(args[0])
        lifted = self.lift((args, kwargs))
        out = func(*lifted[0], **lifted[1])
        copies = self._copies_in(read)
        shared = [copies[_storage(o)] for o in _floats(out) if _storage(o) in copies]
        if not shared:
            return out
        for t in shared:  # it returned a copy (or a view of one) the Python now holds: float32 for good
            self._settle(t)
        again = self.lift((args, kwargs))
        if all(a is b for a, b in zip(tree_leaves(again), tree_leaves(lifted))):
            return out
        return func(*again[0], **again[1])


def _spans(t: torch.Tensor) -> bool:
    """Is ``t`` its whole storage, in order (a plain view of a copy of it, no ``as_strided``)?"""
    return t.storage_offset() == 0 and t.is_contiguous() and \
        t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _float32(t: torch.Tensor, flat: bool = False) -> torch.Tensor:
    """A float32 copy of ``t`` (``flat``: of a ``t`` that spans its storage, one dimension) that records autograd
    where ``t`` does, even read first under ``no_grad`` (the copy is shared by the reads after)."""
    with torch.enable_grad():
        return (t.reshape(-1) if flat else t).to(torch.float32)


def _assemble(members: list[torch.Tensor], size: int) -> torch.Tensor:
    """A float32 copy of the storage ``members`` share, ``size`` elements, taking each member's gradient back
    to it: the copy of a member spanning it (one that records autograd first), else each member copied in
    its place (the parts a child returned, ``chunk``'s: one part's copy would drop the others' gradients)."""
    spans = sorted((m for m in members if _spans(m)), key=lambda m: not m.requires_grad)
    if spans:
        return _float32(spans[0], flat=True)
    with torch.enable_grad():
        whole = members[0].new_zeros(size, dtype=torch.float32)
        for m in members:
            whole.as_strided(m.size(), m.stride(), m.storage_offset()).copy_(m)
    return whole


def _follow(view: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``view``, read for ``t``: detached where ``t`` records no autograd (``h.detach()``, ``h.data``, made under
    ``no_grad``), as ``t``'s float32 value was in the model."""
    return view.detach() if view.requires_grad and not t.requires_grad else view


def _view(whole: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """What ``t`` is of its storage, taken of ``whole``, a float32 copy of that storage."""
    return whole.view(t.shape) if _spans(t) else whole.as_strided(t.size(), t.stride(), t.storage_offset())


def _storage(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


def current() -> Handing | None:
    """The :class:`Handing` mode the code now running is in, or ``None``."""
    stack = _get_current_function_mode_stack()
    return stack[-1] if stack and isinstance(stack[-1], Handing) else None


def run_parent(low: torch.dtype, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, the forward of a module whose converted children hand each other ``low``
    values, in a :class:`Handing` mode; what it returns, in float32 where it is a handed value."""
    mode = Handing(low)
    with mode:
        out = call(*args, **kwargs)
    return mode.lift(out)


@dataclasses.dataclass(frozen=True)
class Linked:
    """A converted child of such a module (set on its graph module). ``originals``: the original dtype of
    each float output where its graph returns them as it computes them (low ones included), ``None``
    where it only takes handed values."""

    originals: tuple[torch.dtype, ...] | None = None
    writes: bool = False
    """Its graph writes into its float inputs (``h.relu_()``): it takes handed values settled in float32, the
    values its writes reached before (and its parent reads after)."""
    keeps: frozenset[int] = frozenset()
    """Its float outputs (by index) returned in their original dtypes even to its parent: two or more readers
    read them there (their gradients would be summed in the low dtype)."""

    def run(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)``: the graph outside its parent's :class:`Handing` mode, its outputs handed to that
        mode; called anywhere else, its outputs in their original dtypes."""
        mode = current()
        if mode is None:
            return self.restore(call(*args))
        if self.writes:
            mode.settle(args)
        with _pop_mode_temporarily():
            out = call(*mode.resolve(args))
        if self.originals is not None:
            out = self.restore(out, self.keeps)
            mode.hand(out, self.originals)
        return out

    def restore(self, out: Any, which: frozenset[int] | None = None) -> Any:
        """``out`` with its float outputs (those of index in ``which``, all without) in their original dtypes."""
        if self.originals is None or which == frozenset():
            return out
        floats = iter(range(len(self.originals)))

        def back(v: Any) -> Any:
            if not (isinstance(v, torch.Tensor) and v.is_floating_point()):
                return v
            k = next(floats, None)
            want = self.originals[k] if k is not None and (which is None or k in which) else v.dtype
            return v.to(want) if v.dtype != want else v
        return tree_map(back, out)


class _Enter:
    """Forward pre-hook of :func:`hand_on`: the module's Python runs in a :class:`Handing` mode."""

    def __init__(self, low: torch.dtype) -> None:
        self.low, self.open = low, []

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        mode = Handing(self.low)
        mode.__enter__()
        self.open.append(mode)

    def __getstate__(self) -> dict:
        return {"low": self.low, "open": []}


class _Leave:
    """Forward hook of :func:`hand_on` (always called): leaves the mode, its result in float32."""

    def __init__(self, enter: _Enter) -> None:
        self.enter = enter

    def __call__(self, module: torch.nn.Module, args: tuple, out: Any) -> Any:
        if not self.enter.open:
            return out
        mode = self.enter.open.pop()
        mode.__exit__(None, None, None)
        return mode.lift(out)


def hand_on(module: torch.nn.Module, low: torch.dtype) -> None:
    """Make ``module`` (one of ampfx's own: the private copy conversion works on, a loaded copy) run its Python
    in a :class:`Handing` mode, as :func:`run_parent` runs a converted module's (which cannot take hooks: its
    hook dicts are the model module's).

    >>> net = torch.nn.Sequential(torch.nn.Identity())
    >>> hand_on(net, torch.bfloat16)
    >>> handed_dtype(net)
    torch.bfloat16
    """
    enter = _Enter(low)
    module.register_forward_pre_hook(enter, prepend=True)
    module.register_forward_hook(_Leave(enter), prepend=True, always_call=True)


def handed_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The low dtype ``module``'s children hand each other through its Python (:func:`hand_on`), or ``None``."""
    return next((h.low for h in module._forward_pre_hooks.values() if isinstance(h, _Enter)), None)

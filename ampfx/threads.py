"""Converting while other threads run: one conversion at a time, and what it patches acts in its own thread only.

Converting changes process-wide state while it traces. torch.fx's ``Tracer.trace`` replaces
``nn.Module.__call__`` and ``nn.Module.__getattr__`` until its trace ends: any module call in the process goes
to the tracer (another thread calling a module outside the traced tree gets ``NameError: module is not
installed as a submodule``; one inside it, or reading a parameter the traced copy shares, gets proxies). Two
traces in two threads undo each other's patches in the wrong order and leave ``nn.Module.__call__`` patched for
good. ampfx's own capture wraps grad-mode context managers, ``autograd.Function.apply``, ``torch.rand``,
``random.random`` and module attribute reads while it captures (:mod:`ampfx.capture.semantics`,
:mod:`~ampfx.capture.draws`, :mod:`~ampfx.capture.lift`), and its clean-up puts the model's attributes back as
it found them. So, while :func:`converting` is held:

- one conversion runs at a time in the process (a re-entrant lock, as dynamo compiles one frame at a time under
  ``torch._dynamo.convert_frame.compile_lock``): ``ampfx.convert``, a conversion made again at a call, the other
  training mode's, an unpickled converted module's re-trace. Where dynamo is loaded its lock is taken first: the
  ``ampfx`` backend converts inside a compile, so the two locks are always taken in one order;
- torch.fx's replacements of ``nn.Module.__call__`` / ``__getattr__`` act in the thread whose trace made them
  (:class:`_Route`): every other thread calls and reads modules as torch does, and fx still undoes them when its
  trace ends, however it ends. ampfx's own wrappers check the thread they were made in the same way;
- an attribute another thread sets on a module (``model.eval()``, a flag) is that thread's: the conversion's
  clean-up (:func:`ampfx.state.kept_attributes`) does not put it back (:func:`set_elsewhere`).

Calls of converted modules take no lock: a call that needs a conversion (:mod:`ampfx.runtime.entries`) takes it,
then looks again for an entry another thread made while it waited.

>>> import torch.fx, torch.nn as nn
>>> with converting():
...     with converting():  # re-entrant
...         graph = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2))).graph
>>> nn.Module.__call__ is torch.fx._symbolic_trace._orig_module_call
True
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Callable, Iterator

import torch.fx as fx
import torch.nn as nn

_LOCK = threading.RLock()


class _Held:
    """Who holds :data:`_LOCK` (a thread id, ``None`` when free) and what other threads set meanwhile."""

    owner: int | None = None
    elsewhere: dict[int, set[str]] = {}  # id(module) -> attribute names other threads set on it


ROUTED = ("__call__", "__getattr__")
"""The ``nn.Module`` methods torch.fx's tracer replaces for the length of a trace, routed by thread."""

_ROUTES: dict[tuple[int, str], list[Callable[..., Any]]] = {}  # (thread, method) -> fx's replacements, innermost last
_GATES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {}  # method -> (gate on nn.Module, what it replaced)


@contextlib.contextmanager
def converting() -> Iterator[None]:
    """Hold the process-wide conversion lock (re-entrant: a conversion inside a conversion goes on); see the
    module docstring for what holds while it is held."""
    me = threading.get_ident()
    if _Held.owner == me:
        yield
        return
    with contextlib.ExitStack() as stack:
        dynamo = _compile_lock()
        if dynamo is not None:
            stack.enter_context(dynamo)
        stack.enter_context(_LOCK)
        _Held.owner = me
        stack.callback(_release)
        stack.enter_context(_routing())
        stack.enter_context(_noting_writes())
        yield


def _release() -> None:
    _Held.owner = None
    _Held.elsewhere = {}


def _compile_lock() -> Any:
    """dynamo's compile lock where dynamo is loaded (taken before ampfx's: the backend converts inside a compile)."""
    module = sys.modules.get("torch._dynamo.convert_frame")
    return getattr(module, "compile_lock", None)


def set_elsewhere(module: nn.Module) -> set[str] | tuple[()]:
    """The attributes of ``module`` another thread set while this conversion ran (through ``nn.Module.__setattr__``):
    the conversion's clean-up leaves them as that thread set them.

    >>> set_elsewhere(nn.Linear(2, 2))
    ()
    """
    return _Held.elsewhere.get(id(module), ())


@contextlib.contextmanager
def _noting_writes() -> Iterator[None]:
    """``nn.Module.__setattr__`` notes the attributes threads other than the converting one set, until the block
    ends."""
    original = nn.Module.__dict__["__setattr__"]
    owner = _Held.owner
    elsewhere = _Held.elsewhere

    def __setattr__(self: nn.Module, name: str, value: Any) -> None:
        if threading.get_ident() != owner:
            elsewhere.setdefault(id(self), set()).add(name)
        original(self, name, value)

    nn.Module.__setattr__ = __setattr__
    try:
        yield
    finally:
        if nn.Module.__dict__.get("__setattr__") is __setattr__:
            nn.Module.__setattr__ = original


# --- torch.fx's patches of nn.Module, per thread ------------------------------------------------------------


class _Route:
    """One replacement torch.fx's ``_Patcher`` made of an ``nn.Module`` method (:data:`ROUTED`), in force in the
    thread that made it. It stands in the patcher's ``patches_made``: fx calls :meth:`revert` when its trace ends
    (an error too) and :meth:`patch` to put it back after a pause (dynamo's ``_maybe_revert_all_patches``)."""

    def __init__(self, name: str, new: Callable[..., Any]) -> None:
        self.key = (threading.get_ident(), name)
        self.new = new

    def patch(self) -> None:
        _ROUTES.setdefault(self.key, []).append(self.new)
        _open(self.key[1])

    def revert(self) -> None:
        routes = _ROUTES.get(self.key, [])
        for i in range(len(routes) - 1, -1, -1):
            if routes[i] is self.new:
                del routes[i]
                break
        if not routes:
            _ROUTES.pop(self.key, None)
            if not any(name == self.key[1] for _, name in _ROUTES):
                _close(self.key[1])


def _open(name: str) -> None:
    """Put the gate for ``nn.Module.<name>`` in place (once): the calling thread's innermost route, else what was
    there."""
    if name in _GATES:
        return
    original = nn.Module.__dict__[name]

    @functools.wraps(original, updated=())
    def gate(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        routes = _ROUTES.get((threading.get_ident(), name))
        return (routes[-1] if routes else original)(module, *args, **kwargs)

    _GATES[name] = (gate, original)
    setattr(nn.Module, name, gate)


def _close(name: str) -> None:
    gate, original = _GATES.pop(name)
    if nn.Module.__dict__.get(name) is gate:
        setattr(nn.Module, name, original)


def _routed_patch_method(fx_patch_method: Callable[..., Any]) -> Callable[..., Any]:
    """``_Patcher.patch_method`` that routes :data:`ROUTED` replacements of ``nn.Module`` by thread."""
    @functools.wraps(fx_patch_method)
    def patch_method(patcher: Any, cls: type, name: str, new_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        if cls is not nn.Module or name not in ROUTED:
            return fx_patch_method(patcher, cls, name, new_fn, *args, **kwargs)
        route = _Route(name, new_fn)
        patcher.patches_made.append(route)
        route.patch()
        return None
    return patch_method


@contextlib.contextmanager
def _routing() -> Iterator[None]:
    """torch.fx's patcher routes its ``nn.Module`` replacements by thread until the block ends (a torch.fx without
    that patcher: as it is, the lock alone)."""
    patcher = getattr(fx._symbolic_trace, "_Patcher", None)
    fx_patch_method = getattr(patcher, "patch_method", None)
    if fx_patch_method is None or not isinstance(getattr(patcher(), "patches_made", None), list):
        yield
        return
    patcher.patch_method = _routed_patch_method(fx_patch_method)
    try:
        yield
    finally:
        patcher.patch_method = fx_patch_method

"""Structure changes to the model after conversion: shown through, or an error at the next call.

The converted module is a view of the model (:mod:`ampfx.runtime.view`): the model's own modules,
parameter and buffer dicts, flags, attributes and hooks, so most changes need nothing to
be seen. What a graph fixed of the model's values is checked at every call
(:mod:`ampfx.runtime.fixed`). What remains is the model's *structure* where the converted tree
holds its own: torch announces every ``setattr`` of a module, parameter or buffer through
its global registration hooks
(``torch.nn.modules.module.register_module_{parameter,buffer,module}_registration_hook``,
fired by ``register_parameter`` / ``register_buffer`` / ``add_module`` and by
``__setattr__``); a :class:`Follower` listens for the model's modules only (by weak
reference) and settles what it heard at the next call:

- a parameter or buffer replaced (``model.fc.weight = nn.Parameter(...)``,
  ``load_state_dict(sd, assign=True)``): **shown through** (the dicts are shared), unless a
  graph reads it and the new one has another shape, dtype or device, or is ``None``, or it
  was tied (held at several places of the model, which a graph reads through one name);
- a submodule replaced or added (``model[2] = nn.Linear(...)``), a parametrization added, a
  parameter added, where a graph traced through that module or a converted module stands
  for it: the call raises :class:`~ampfx.errors.StaleModelError` naming what changed and
  saying to convert again. Elsewhere (inside a module the converted tree calls as the
  model's own) the change shows through.

What is not heard (no torch hook fires): ``del model.fc`` and writes straight into
``model._modules``. A copy (``copy.deepcopy``, pickling) of the converted module follows
nothing: it no longer shares the model's tensors.

Cost per call: one list test (the global hooks cost nothing at call time). The hooks are
removed once no follower is alive.

>>> import torch, torch.nn as nn, ampfx
>>> net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
>>> amp = ampfx.convert(net, example_inputs=(torch.ones(2, 4),))
>>> net[0].weight = nn.Parameter(torch.zeros(4, 4))
>>> torch.allclose(amp(torch.ones(2, 4)), net(torch.ones(2, 4)), atol=1e-2)
True
>>> net[0] = nn.Identity()
>>> amp(torch.ones(2, 4))
Traceback (most recent call last):
ampfx.errors.StaleModelError: model.0 was replaced by another module after conversion; ...
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as torch_module

from ..errors import StaleModelError

_TRACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model module -> WeakSet of followers
_HANDLES: list[Any] = []  # the three global hooks while a follower lives
_LIVE = [0]
_KINDS = ("parameter", "buffer")
FIX = ("convert the model again (ampfx.convert(model, ...)); in-place updates (optimizer steps, "
       "load_state_dict(), .data.copy_()) and tensors replaced by ones of the same shape and dtype need nothing")


def _note(module: nn.Module, kind: str, name: str) -> None:
    try:
        followers = _TRACKED.get(module)
    except TypeError:  # an unhashable module cannot have been converted
        return
    for f in list(followers or ()):
        f.pending.append((weakref.ref(module), kind, name))


def _on_parameter(module: nn.Module, name: str, value: Any) -> None:
    _note(module, "parameter", name)


def _on_buffer(module: nn.Module, name: str, value: Any) -> None:
    _note(module, "buffer", name)


def _on_module(module: nn.Module, name: str, value: Any) -> None:
    _note(module, "module", name)


def _hold() -> None:
    if not _HANDLES:
        _HANDLES.extend([torch_module.register_module_parameter_registration_hook(_on_parameter),
                         torch_module.register_module_buffer_registration_hook(_on_buffer),
                         torch_module.register_module_module_registration_hook(_on_module)])
    _LIVE[0] += 1


def _release() -> None:
    _LIVE[0] -= 1
    if _LIVE[0] == 0:
        for h in _HANDLES:
            h.remove()
        _HANDLES.clear()


def _ref(value: Any) -> Any:
    return weakref.ref(value) if value is not None else (lambda: None)


class Follower:
    """Settles the structure changes torch announced for the model's modules (see the module
    docstring). Called with the converted module before each of its calls. ``views``
    (:class:`ampfx.runtime.view.Views`) says what the converted tree holds of the model."""

    def __init__(self, model: nn.Module, views: Any) -> None:
        self.pending: list[tuple[Any, str, str]] = []
        self.stale: str | None = None
        self.holders: dict[int, list[Any]] = {}
        self.inlined: set[int] = set()
        self.read: set[tuple[int, str]] = set()
        self.watch(views)
        places: dict[int, int] = {}
        self.paths: dict[int, str] = {}
        modules = {id(m): (p, m) for p, m in reversed(list(model.named_modules(remove_duplicate=False)))}
        for path, m in modules.values():
            self.paths[id(m)] = path
            for d in (m._parameters, m._buffers):
                for v in d.values():
                    places[id(v)] = places.get(id(v), 0) + (v is not None)
        self.slots: dict[tuple[int, str, str], tuple[Any, bool, Any]] = {}
        for _, m in modules.values():
            for kind, d in zip(_KINDS, (m._parameters, m._buffers)):
                for k, v in d.items():
                    self.slots[(id(m), kind, k)] = (_ref(v), places.get(id(v), 0) > 1, _meta(v))
            for k, child in m._modules.items():
                self.slots[(id(m), "module", k)] = (_ref(child), False, None)
            _TRACKED.setdefault(m, weakref.WeakSet()).add(self)
        _hold()
        weakref.finalize(self, _release)

    def watch(self, views: Any) -> None:
        """Depend on what ``views`` (:class:`ampfx.runtime.view.Views`: the converted tree, or a conversion made again at
        a call) holds of the model: stand-ins keeping their own submodules (weakly), modules graphs traced
        through, tensors graphs read by name."""
        for key, stand_ins in views.holders.items():
            self.holders.setdefault(key, []).extend(weakref.ref(s) for s in stand_ins)
        self.inlined |= set(views.inlined)
        self.read |= views.read_tensors

    def __call__(self, converted: nn.Module, *_: Any) -> None:
        if self.pending:
            self._settle()
        if self.stale is not None:
            raise StaleModelError(self.stale)

    def __reduce__(self) -> tuple:
        return (_Inert, ())  # a copy shares no tensors with the model: it follows nothing

    def __deepcopy__(self, memo: dict) -> "_Inert":
        return _Inert()

    def _settle(self) -> None:
        pending, self.pending = self.pending, []
        for ref, kind, name in pending:
            module = ref()
            if module is not None and self.stale is None:
                self.stale = self._follow(module, kind, name)

    def _follow(self, module: nn.Module, kind: str, name: str) -> str | None:
        """Settle one change the hooks heard of; why it cannot be shown through, or ``None``."""
        path = self.paths.get(id(module), "?")
        where = f"model.{path}.{name}" if path else f"model.{name}"
        slot = self.slots.get((id(module), kind, name))
        new = getattr(module, f"_{kind}s" if kind != "module" else "_modules").get(name)
        traced = id(module) in self.inlined
        if slot is None:
            if kind == "module" and not traced:
                self._put(module, name, None, new)
                return None
            if not traced:
                return None
            return f"{where}: a {kind} was added to the model after conversion; the converted module lacks it: {FIX}"
        old_ref, tied, meta = slot
        old = old_ref()
        if new is old:
            return None
        if kind == "module":
            # a graph calling the old module by its path calls the new one: the same kind of module only
            called = traced and old is not None and id(old) not in self.inlined and type(new) is type(old)
            if (traced and not called) or not self._put(module, name, old, new):
                return (f"{where} was replaced by another module after conversion; the converted module still runs "
                        f"the old one: {FIX}")
            self.slots[(id(module), kind, name)] = (_ref(new), False, None)
            return None
        if tied or ((id(module), name) in self.read and _meta(new) != meta):
            what = "a tied tensor (held at several places of the model)" if tied else _describe(meta, new)
            return f"{where}: {kind} replaced after conversion ({what}); the converted module's graph reads it: {FIX}"
        self.slots[(id(module), kind, name)] = (_ref(new), tied, meta)
        return None


    def _put(self, module: nn.Module, name: str, old: Any, new: Any) -> bool:
        """Put ``new`` where the converted tree's stand-ins for ``module`` hold the model's ``old`` child; ``False``
        where one holds a converted module there instead (it was made from ``old``: it cannot follow)."""
        for ref in self.holders.get(id(module), ()):
            stand_in = ref()
            if stand_in is None:
                continue
            own = stand_in._modules
            if own.get(name) is not old:
                return False
            own[name] = new
        return True


class _Inert:
    """The follower of a copy: checks nothing."""

    def __call__(self, converted: nn.Module, *_: Any) -> None:
        return None


_FLOATS = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _meta(t: Any) -> tuple | None:
    """What a graph reading ``t`` by name depends on: its shape, kind of dtype and device (``None``: no tensor).
    A float32 weight replaced by a float16 or bfloat16 one is cast by the graph as before (FSDP2's
    ``MixedPrecisionPolicy`` gathers weights low; :mod:`ampfx.runtime.fixed` checks the dtype against the conversion's)."""
    return None if t is None else (tuple(t.shape), _FLOATS.get(t.dtype, t.dtype), t.device)


def _describe(meta: tuple | None, new: Any) -> str:
    def one(m: tuple | None) -> str:
        return "nothing" if m is None else f"{str(m[1]).replace('torch.', '')}{list(m[0])} on {m[2]}"
    return f"was {one(meta)}, is {one(_meta(new))}"


def follow(model: nn.Module, result: nn.Module, views: Any) -> Follower:
    """Make ``result`` (the converted ``model``, whose stand-ins ``views`` lists) check the model's structure
    from its next call on."""
    follower = Follower(model, views)
    setter = getattr(result, "set_check", None)
    if setter is not None:  # a converted graph module calls it inline (cheaper than a hook)
        setter(follower)
    else:  # a mirror: the root keeps its Python
        object.__setattr__(result, "_ampfx_check", follower)
    return follower

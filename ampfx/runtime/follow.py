"""Structure changes to the model after conversion: shown through, or converted again at the next call.

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
- a submodule replaced or added (``model[2] = nn.Linear(...)``, a LoRA-style wrapper put around a
  ``Linear``), a parametrization added, a parameter added, where a graph traced through that module
  or a converted module stands for it: the innermost graph module around the change is **converted
  again** at its next call, as when a value its graph fixed changed (within ``reconvert_limit``,
  logged, listed in ``variants()``; :meth:`~ampfx.runtime.graph_module.AmpGraphModule.restructured`).
  Elsewhere (inside a module the converted tree calls as the model's own) the change shows through.
  Where nothing can convert again (``reconvert_limit=0``), the call raises
  :class:`~ampfx.errors.StaleModelError` naming what changed.

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
>>> torch.equal(amp(torch.ones(2, 4)), net(torch.ones(2, 4))), len(amp.variants())
(True, 1)
>>> amp.variants()[0].ampfx_report.notes[-1]
'converted again at a call: model.0 was replaced by another module (Identity) after conversion'
>>> frozen = ampfx.convert(net, example_inputs=(torch.ones(2, 4),), reconvert_limit=0)
>>> net[0] = nn.Linear(4, 4)
>>> frozen(torch.ones(2, 4))
Traceback (most recent call last):
ampfx.errors.StaleModelError: model.0 was replaced by another module (Linear) after conversion: convert the model again ...
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as torch_module

from .. import runtime
from ..errors import StaleModelError

_TRACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model module -> WeakSet of followers
_HANDLES: list[Any] = []  # the three global hooks while a follower lives
_LIVE = [0]
_KINDS = ("parameter", "buffer")
FIX = ("convert the model again (ampfx.convert(model, ...)), or allow conversions at call time (reconvert_limit > 0); "
       "in-place updates (optimizer steps, load_state_dict(), .data.copy_()) and tensors replaced by ones of the same "
       "shape and dtype need nothing")


def _note(module: nn.Module, kind: str, name: str) -> None:
    if runtime.is_compiling():  # a registration in code dynamo traces: recorded by Python, at a graph break (traced,
        return _recorded_eagerly(module, kind, name)  # the table of followed modules would become one of its guards)
    _record(module, kind, name)


def _record(module: nn.Module, kind: str, name: str) -> None:
    try:
        followers = _TRACKED.get(module)
    except TypeError:  # an unhashable module cannot have been converted
        return
    for f in list(followers or ()):
        f.pending.append((weakref.ref(module), kind, name))


_recorded_eagerly = runtime.compile_disabled(_record)


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
        self.graphs: list[Any] = []  # weak references to the converted tree's graph modules
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
        self.graphs.extend(weakref.ref(gm) for gm, _ in views.graphs)

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
        """Settle one change the hooks heard of: shown through, or the graph module that traced it converted
        again at its next call (:meth:`_convert_again`); why it can be neither, or ``None``."""
        change = self._change(module, kind, name)
        if change is None or self._convert_again(module, change):
            return None
        return f"{change}: {FIX}"

    def _convert_again(self, module: nn.Module, change: str) -> bool:
        """Mark for conversion again the innermost graph modules whose model module is ``module`` or one of its
        parents (:meth:`ampfx.runtime.graph_module.AmpGraphModule.restructured`); ``False`` where there is none
        that can convert again (a copy, ``reconvert_limit=0``)."""
        path = self.paths.get(id(module))
        if path is None:
            return False
        graphs = [gm for gm in (ref() for ref in self.graphs) if gm is not None
                  and gm._rt.reconvert is not None and gm._rt.reconvert.limit and _within(path, gm._rt.where)]
        if not graphs:
            return False
        deepest = max(len(gm._rt.where) for gm in graphs)
        for gm in graphs:
            if len(gm._rt.where) == deepest:
                gm.restructured(change)
        return True

    def _change(self, module: nn.Module, kind: str, name: str) -> str | None:
        """One change the hooks heard of: ``None`` where it shows through as it is, else what changed, in
        words."""
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
            return f"{where}: a {kind} was added to the model after conversion, where the converted graph traced it"
        old_ref, tied, meta = slot
        old = old_ref()
        if new is old:
            return None
        if kind == "module":
            # a graph calling the old module by its path calls the new one: the same kind of module only
            called = traced and old is not None and id(old) not in self.inlined and type(new) is type(old)
            self.slots[(id(module), kind, name)] = (_ref(new), False, None)
            held = self._put(module, name, old, new)  # the converted tree holds the model's new child
            if traced and not called or not held:
                return f"{where} was replaced by another module ({type(new).__name__}) after conversion"
            return None
        self.slots[(id(module), kind, name)] = (_ref(new), False, _meta(new))
        if tied or ((id(module), name) in self.read and meta != _meta(new)):
            what = "a tied tensor (held at several places of the model)" if tied else _describe(meta, new)
            return f"{where}: {kind} replaced after conversion ({what}), where the converted graph reads it"
        return None


    def _put(self, module: nn.Module, name: str, old: Any, new: Any) -> bool:
        """Put ``new`` where the converted tree's stand-ins for ``module`` hold its child ``name`` (so their
        ``parameters()`` are the model's); ``False`` where one held a converted module there instead (made from
        ``old``: it cannot follow, and the graph around it is converted again)."""
        followed = True
        for ref in self.holders.get(id(module), ()):
            stand_in = ref()
            if stand_in is None:
                continue
            own = stand_in._modules
            followed = followed and own.get(name) is old
            own[name] = new
        return followed


def _within(path: str, where: str) -> bool:
    """Is the module at ``path`` the one at ``where`` or inside it?"""
    return not where or path == where or path.startswith(where + ".")


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


def follow(model: nn.Module, views: Any) -> Follower:
    """The follower of ``model``'s structure for its converted module (whose stand-ins ``views`` lists), which the
    converted root is armed with (:func:`ampfx.runtime.arming.arm`, ``check``: a graph module calls it inline,
    cheaper than a hook; a mirror, the root keeping its Python, before its Python runs)."""
    return Follower(model, views)

"""The converted module follows the model it was converted from, or says it cannot.

The converted module shares the model's parameters and buffers, so in-place
updates (optimizer steps, ``.data.copy_``, ``load_state_dict()``) reach both.
Changes that *replace* objects in the model do not: ``model.fc.weight =
nn.Parameter(...)``, ``model[2] = nn.Linear(...)``, ``load_state_dict(sd,
assign=True)``, a parametrization or pruning added. torch announces each of
them through its global registration hooks
(``torch.nn.modules.module.register_module_{parameter,buffer,module}_registration_hook``,
fired by ``register_parameter`` / ``register_buffer`` / ``add_module`` and by
``__setattr__``); a :class:`Follower` listens for the model's modules only
(by weak reference) and settles what it heard at the next call:

- a parameter or buffer replaced by a tensor of the same shape, dtype and
  device, held by one place of the model (not tied) and by the converted
  module as it was at conversion: **followed** — the converted module
  computes and trains the new tensor from then on;
- anything else (another shape or dtype, a tied weight untied, a submodule
  swapped, a parametrization added, a name added, ``mode="inference"``
  copies): the call raises :class:`~ampfx.errors.StaleModelError` naming
  what changed and saying to convert again. Never the old tensors in silence.

The training mode follows too: when ``model.train()`` / ``model.eval()`` changed
the model's flag since the last call, the converted module is switched the
same way first. ``amp.eval()`` on the converted module holds until the
model's own flag changes again: the later switch wins (for a converted root
that keeps its Python, which cannot tell which came first, the model's flag
wins when both changed since the last call).

What is not heard (no torch hook fires): ``del model.fc`` and writes straight
into ``model._parameters`` / ``_buffers`` (``model.to()`` / ``.double()`` move
buffers that way; parameters are converted in place and so stay shared), and
the modes of submodules switched one by one. A copy (``copy.deepcopy``,
pickling) of the converted module follows nothing: it no longer shares the
model's tensors.

Cost per call: one attribute test, one weak reference and one flag compare
(the global hooks cost nothing at call time). The hooks are removed once no
follower is alive.

>>> import torch, torch.nn as nn, ampfx
>>> net = nn.Sequential(nn.Linear(4, 4), nn.Dropout())
>>> amp = ampfx.convert(net, example_inputs=(torch.ones(2, 4),))
>>> _ = net.eval(); _ = amp(torch.ones(2, 4)); amp.training
False
>>> net[0].weight = nn.Parameter(torch.zeros(4, 4))
>>> _ = amp(torch.ones(2, 4)); amp.get_submodule("0").weight is net[0].weight
True
>>> net[1] = nn.Identity()
>>> amp(torch.ones(2, 4))
Traceback (most recent call last):
ampfx.errors.StaleModelError: model.1 was replaced by another module after conversion; ...
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as torch_module

from .errors import StaleModelError
from .graph_module import AmpGraphModule

_TRACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model module -> WeakSet of followers
_HANDLES: list[Any] = []  # the three global hooks while a follower lives
_LIVE = [0]
_KINDS = ("parameter", "buffer")


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


def _converted_modules(result: nn.Module) -> list[nn.Module]:
    """Every module of ``result``, with the other training mode's conversions its graph modules
    keep outside their tree (:meth:`~ampfx.graph_module.AmpGraphModule.mode_module`)."""
    seen: dict[int, nn.Module] = {}
    todo = [result]
    while todo:
        for m in todo.pop().modules():
            if id(m) not in seen:
                seen[id(m)] = m
                if isinstance(m, AmpGraphModule):
                    todo.extend(other for other in (m.mode_module(True), m.mode_module(False)) if other is not m)
    return list(seen.values())


class Follower:
    """Keeps a converted module in step with its model (see the module docstring).
    Called with the converted module before each of its calls."""

    def __init__(self, model: nn.Module, result: nn.Module) -> None:
        self.pending: list[tuple[Any, str, str]] = []
        self.stale: str | None = None
        self.model = weakref.ref(model)
        self.seen = model.training
        holders: dict[int, list[tuple[dict, str]]] = {}
        for m in _converted_modules(result):
            for d in (m._parameters, m._buffers):
                for k, v in d.items():
                    if v is not None:
                        holders.setdefault(id(v), []).append((d, k))
        places: dict[int, int] = {}
        self.paths: dict[int, str] = {}
        modules = {id(m): (p, m) for p, m in reversed(list(model.named_modules(remove_duplicate=False)))}
        for path, m in modules.values():
            self.paths[id(m)] = path
            for kind, d in zip(_KINDS, (m._parameters, m._buffers)):
                for v in d.values():
                    places[id(v)] = places.get(id(v), 0) + (v is not None)
        self.slots: dict[tuple[int, str, str], tuple[Any, list, bool]] = {}
        for _, m in modules.values():
            for kind, d in zip(_KINDS, (m._parameters, m._buffers)):
                for k, v in d.items():
                    self.slots[(id(m), kind, k)] = (_ref(v), holders.get(id(v), []), places.get(id(v), 0) > 1)
            for k, child in m._modules.items():
                self.slots[(id(m), "module", k)] = (_ref(child), [], False)
            _TRACKED.setdefault(m, weakref.WeakSet()).add(self)
        _hold()
        weakref.finalize(self, _release)

    def __call__(self, converted: nn.Module, *_: Any) -> None:
        if self.pending:
            self._settle()
        if self.stale is not None:
            raise StaleModelError(self.stale)
        model = self.model()
        if model is not None and model.training is not self.seen:
            self.seen = model.training
            converted.train(self.seen)

    def own_mode(self) -> None:
        """The converted module's own ``.train()`` / ``.eval()`` was called: the model's flag as it
        is now counts as seen (a switch of the model before this one is not followed)."""
        model = self.model()
        if model is not None:
            self.seen = model.training

    def __reduce__(self) -> tuple:
        return (_Inert, ())  # a copy shares no tensors with the model: it follows nothing

    def _settle(self) -> None:
        pending, self.pending = self.pending, []
        for ref, kind, name in pending:
            module = ref()
            if module is not None and self.stale is None:
                self.stale = self._follow(module, kind, name)

    def _follow(self, module: nn.Module, kind: str, name: str) -> str | None:
        """Follow one change the hooks heard of; why it cannot be followed, or ``None``."""
        path = self.paths.get(id(module), "?")
        where = f"model.{path}.{name}" if path else f"model.{name}"
        fix = ("convert the model again (ampfx.convert(model, ...)); in-place updates (optimizer steps, "
               "load_state_dict() without assign=True, .data.copy_()) are followed without that")
        slot = self.slots.get((id(module), kind, name))
        new = getattr(module, f"_{kind}s" if kind != "module" else "_modules").get(name)
        if slot is None:
            return f"{where}: a {kind} was added to the model after conversion; the converted module lacks it: {fix}"
        old_ref, mirrors, tied = slot
        old = old_ref()
        if new is old:
            return None
        if kind == "module":
            return (f"{where} was replaced by another module after conversion; the converted module still runs "
                    f"the old one: {fix}")
        live = [(d, k) for d, k in mirrors if old is not None and d.get(k) is old]
        if not live:  # nothing converted holds the model's old tensor (dead, or replaced by a low copy)
            return (f"{where}: {kind} replaced after conversion; the converted module holds its own copy of the "
                    f"old one (mode='inference'): {fix}")
        if new is None or tied or not _alike(old, new):
            what = "a tied tensor (held at several places of the model)" if tied else _describe(old, new)
            return f"{where}: {kind} replaced after conversion ({what}); the converted module holds the old one: {fix}"
        for d, k in live:
            d[k] = new
        self.slots[(id(module), kind, name)] = (_ref(new), live, tied)
        return None


class _Inert:
    """The follower of a copy: checks nothing."""

    def __call__(self, converted: nn.Module, *_: Any) -> None:
        return None


def _alike(old: torch.Tensor, new: torch.Tensor) -> bool:
    return (type(old) is type(new) and old.shape == new.shape and old.dtype == new.dtype
            and old.device == new.device)


def _describe(old: Any, new: Any) -> str:
    def one(t: Any) -> str:
        return "nothing" if t is None else f"{type(t).__name__} {t.dtype}{list(t.shape)} on {t.device}"
    return f"was {one(old)}, is {one(new)}"


def follow(model: nn.Module, result: nn.Module) -> Follower:
    """Make ``result`` (the converted ``model``) follow ``model`` from its next call on."""
    follower = Follower(model, result)
    setter = getattr(result, "set_check", None)
    if setter is not None:  # a converted graph module calls it inline (cheaper than a hook)
        setter(follower)
    else:  # the root kept its Python
        result.register_forward_pre_hook(follower)
    return follower

"""The converted module is a view of the model: the model's own modules run, except where converted.

Conversion works on a private copy of the model's module tree (:func:`ampfx.state.copy_tree`),
which it may change freely. :func:`rebase` then builds the converted module the user gets,
path by path against the model:

- a copy the conversion left as it was (a leaf such as ``nn.Dropout`` or ``nn.BatchNorm2d``,
  a module a graph calls, a subtree nothing converted) is replaced by **the model's own
  module**: its flags, attributes, hooks, parameters and Python state are the model's;
- a converted graph (:class:`~ampfx.runtime.graph_module.AmpGraphModule`) becomes a view of the
  model's module at its path (its parameter, buffer and hook dicts, its flag and attributes);
- a module whose Python runs around converted children (a module kept eager, a ``ModuleList``
  holding a converted block) becomes a :class:`Mirror`: an object of the model module's class
  that shares the model module's ``__dict__`` itself (every attribute, the flag, the hooks,
  the parameter and buffer dicts, whatever its ``forward`` sets) and differs only in its children.

So ``parameters()``, ``state_dict()`` and ``buffers()`` are the model's in the model's order,
``amp.train()`` runs the model's own ``train()``, a hook on the model's module fires, and
``self.attn_map = ...`` in a forward lands on the model's module. What a graph fixed of the
model's Python is checked at every call (:mod:`ampfx.runtime.fixed`); a change converts that module
again (:class:`Reconvert`) or raises.

>>> import torch, torch.nn as nn, ampfx
>>> net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2))
>>> amp = ampfx.convert(net, example_inputs=(torch.ones(2, 4),))
>>> amp.get_submodule("1") is net[1], [n for n, _ in amp.named_parameters()] == [n for n, _ in net.named_parameters()]
(True, True)
>>> _ = amp.eval(); net.training
False
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import logging
from typing import Any, Callable

import torch
import torch.nn as nn

from .. import runtime
from ..errors import StaleModelError
from . import handing
from .entries import plan_of
from .graph_module import HOOKS, AmpGraphModule
from ..state import CONTAINERS, origin_of, same_contents

log = logging.getLogger(__name__)

_MODULE_CALL = nn.Module.__call__
"""``nn.Module.__call__`` as torch defines it (a tracer replaces it while it traces)."""
_profiling = torch._C._autograd._profiler_enabled

_SLOTS = ("_ampfx_modules", "_ampfx_model", "_ampfx_cross", "_ampfx_check", "_ampfx_hand", "ampfx_report")


class Mirror:
    """A module of the converted tree that stands for one of the model's modules whose children are not
    all the model's own: an object of that module's class sharing its ``__dict__`` (so every attribute,
    flag, hook, parameter and buffer is the model module's), with its own ``_modules``. Attribute writes
    go through the model module (torch's registration hooks fire there). ``_ampfx_cross``: a kept module
    whose caller's graph gives it low-precision values and that keeps its Python takes them in float32
    and returns its float32 outputs low (:func:`ampfx.runtime.cross_in_float32`, done here without hooks).
    ``_ampfx_hand``: its converted children hand each other low values through its Python, which runs in a
    :class:`~ampfx.runtime.handing.Handing` mode (:func:`ampfx.runtime.handing.hand_on`, here without hooks)."""

    __slots__ = ()
    _ampfx_plain_call = False  # its model class's __call__ is nn.Module's (set per class by mirror_class)

    @property
    def _modules(self) -> dict:
        return self._ampfx_modules

    @_modules.setter
    def _modules(self, value: dict) -> None:
        object.__setattr__(self, "_ampfx_modules", value)

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("_ampfx", "ampfx_")):
            raise AttributeError(name)
        modules = self._ampfx_modules
        if name in modules:
            return modules[name]
        return super().__getattr__(name)

    __getattr__._ampfx_modules_first = True  # children from _modules first (ampfx.runtime.lowered reads so)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith(("_ampfx", "ampfx_")) or name == "_modules":
            object.__setattr__(self, name, value)
        elif isinstance(value, nn.Module) or (value is None and name in self._ampfx_modules):
            self._ampfx_modules[name] = value  # the converted tree's structure is its own (a checkpoint wrapper)
        else:  # parameters, buffers, attributes: the model module's, through its own __setattr__
            setattr(self._ampfx_model, name, value)

    def __delattr__(self, name: str) -> None:
        if name in self._ampfx_modules:
            del self._ampfx_modules[name]
        else:
            delattr(self._ampfx_model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The check, then its class's ``__call__``. A mirror that crosses nothing, of a class whose ``__call__`` is
        ``nn.Module``'s (not a checkpointing layer's own), calls ``_call_impl`` itself, as that ``__call__`` would:
        its model's Python then runs as deep in the stack as it runs in the model (CPython 3.11 allocates frames in
        16 KiB chunks, and a recursive function such as torch's pytree flattening, called again and again across a
        chunk's end, frees and allocates one at each call: Mixtral's mask, built four frames deeper, took 5.3 ms
        against 4.6 ms)."""
        check = self._ampfx_check
        if check is not None:
            check(self)
        if type(self)._ampfx_plain_call and self._ampfx_hand is None and self._ampfx_cross is None and \
                self.__dict__.get("_compiled_call_impl") is None and nn.Module.__call__ is _MODULE_CALL and \
                not _profiling():  # (fx's tracers patch nn.Module.__call__; the profiler names modules by its frame)
            return self._call_impl(*args, **kwargs)
        return _crossed(self, super().__call__, args, kwargs)

    @staticmethod
    def _ampfx_run(module: Mirror, args: tuple, kwargs: dict) -> Any:
        """Its ``forward`` alone (another conversion of a module whose call already fired the hooks)."""
        return _crossed(module, module.forward, args, kwargs)

    def _get_name(self) -> str:
        return type(self)._ampfx_base.__name__

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """A mirror of the copy of the model module (``copy.deepcopy`` of a converted module copies the model
        along and stays a view of the copy)."""
        made = mirror(copy.deepcopy(self._ampfx_model, memo), {}, self._ampfx_cross, self._ampfx_hand)
        memo[id(self)] = made
        object.__setattr__(made, "_ampfx_modules", copy.deepcopy(self._ampfx_modules, memo))
        report = getattr(self, "ampfx_report", None)
        if report is not None:
            made.ampfx_report = report
        return made

    def __reduce_ex__(self, protocol: Any) -> tuple:
        """A pickled copy is a plain module of the model module's class with these children: it shares
        nothing with the model."""
        state = {k: v for k, v in self.__dict__.items() if k != "_modules"}
        state["_modules"] = dict(self._ampfx_modules)
        return (_materialize, (type(self)._ampfx_base, state, self._ampfx_cross, self._ampfx_hand))


def _crossed(module: Mirror, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``call(*args, **kwargs)``; for a mirror that crosses its boundary low (``_ampfx_cross``), with its low
    inputs in float32 and its float32 outputs back in the low dtype."""
    low, hand = module._ampfx_cross, module._ampfx_hand
    if hand is not None:
        call = functools.partial(handing.run_parent, hand, call)
    if low is None:
        return call(*args, **kwargs)
    args, kwargs = runtime._arguments_in(torch.float32, low, module, args, kwargs)
    return runtime._outputs_in(low, module, args, call(*args, **kwargs))


def _materialize(cls: type, state: dict, cross: torch.dtype | None, hand: torch.dtype | None = None) -> nn.Module:
    obj = cls.__new__(cls)
    obj.__dict__.update(state)
    if hand is not None:
        handing.hand_on(obj, hand)
    if cross is not None:
        runtime.cross_in_float32(obj, cross)
    return obj


_CLASSES: dict[type, type] = {}


def mirror_class(cls: type) -> type:
    """The :class:`Mirror` class of modules of ``cls`` (made once per class)."""
    made = _CLASSES.get(cls)
    if made is None:
        extra = {"__getitem__": _sliced} if issubclass(cls, (nn.ModuleList, nn.Sequential)) else {}
        made = type(cls.__name__, (Mirror, cls), {"__slots__": _SLOTS, "_ampfx_base": cls,
                                                   # its class's __call__ is nn.Module's: none of its own to run
                                                   "_ampfx_plain_call": cls.__call__ is nn.Module.__call__,
                                                   "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                                   "__doc__": cls.__doc__, **extra})
        _CLASSES[cls] = made
    return made


def _sliced(self: Mirror, idx: Any) -> Any:
    """``blocks[:n]`` of a mirrored ``ModuleList`` / ``Sequential``: a container of the model's class holding the
    converted tree's children (torch builds it as ``self.__class__(...)``, which for a mirror is a mirror that
    stands for no model module; torch.compile could not trace making one)."""
    base = type(self)._ampfx_base
    if not isinstance(idx, slice):
        return base.__getitem__(self, idx)
    items = list(self._ampfx_modules.items())[idx]
    if issubclass(base, nn.Sequential):
        return base(collections.OrderedDict(items))
    return base([m for _, m in items])


def mirror(model: nn.Module, children: dict, cross: torch.dtype | None = None,
           hand: torch.dtype | None = None) -> nn.Module:
    """A :class:`Mirror` of ``model`` with ``children`` as its own submodules."""
    if isinstance(model, torch.jit.ScriptModule):
        raise StaleModelError(f"a TorchScript module ({type(model).__name__}) cannot stand for converted "
                              "children; convert the Python model before scripting it")
    cls = mirror_class(type(model))
    # GraphModule.__new__ makes a class for each instance (one that dynamo hands a backend is one): not for a mirror
    obj = object.__new__(cls) if isinstance(model, torch.fx.GraphModule) else cls.__new__(cls)
    object.__setattr__(obj, "__dict__", model.__dict__)
    for name, value in zip(_SLOTS[:5], (children, model, cross, None, hand)):
        object.__setattr__(obj, name, value)
    return obj


# --- the rebase ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class Views:
    """What :func:`rebase` made: the graph modules (each with the model module it stands for); for each
    model module a graph module or mirror stands for, that module (its ``_modules`` are its own, and a
    submodule the model replaces there must be put there too); the model modules whose ``forward`` a
    graph traced through (a submodule replaced there cannot show through); the tensors graphs read by
    name."""

    graphs: list[tuple[AmpGraphModule, nn.Module]] = dataclasses.field(default_factory=list)
    bound: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # id(graph module) -> what to arm
    holders: dict[int, list[nn.Module]] = dataclasses.field(default_factory=dict)  # id(model module) -> stand-ins
    inlined: dict[int, nn.Module] = dataclasses.field(default_factory=dict)
    read_tensors: set[tuple[int, str]] = dataclasses.field(default_factory=set)  # (id(model module), name)

    def hold(self, model: nn.Module, stand_in: nn.Module) -> None:
        self.holders.setdefault(id(model), []).append(stand_in)


def rebase(result: nn.Module, model: nn.Module) -> tuple[nn.Module, Views]:
    """The converted module the user gets: ``result`` (the converted private copy of ``model``) with every
    unchanged copy replaced by the model's own module, every graph module a view of its model module,
    and a :class:`Mirror` wherever the model's Python runs around converted children. The root is never
    the model itself."""
    views = Views()
    root = _view(result, model, views, where="", root=True)
    return root, views


def _view(r: nn.Module | None, m: nn.Module | None, views: Views, where: str, root: bool = False,
          alternative: bool = False) -> nn.Module | None:
    """The module standing at ``where`` in the converted tree for ``r`` (what conversion left there)
    and ``m`` (the model's module there, ``None`` if the model has none)."""
    if r is None or r is m:
        return r
    if isinstance(r, torch.jit.ScriptModule):  # opaque: nothing inside was converted
        return m if m is not None and origin_of(r) is m else r
    if isinstance(r, AmpGraphModule):
        return _view_graph(r, m, views, where, alternative)
    rebase_hook = getattr(r, "_ampfx_rebase", None)
    if rebase_hook is not None and m is not None:  # a module conversion made around the model's (a DGL leaf)
        rebase_hook(m, lambda c, mc, p: _view(c, mc, views, p))
        return r
    children = {name: _view(c, m._modules.get(name) if m is not None else None, views, _join(where, name))
                for name, c in r._modules.items()}
    if m is None or origin_of(r) is not m:  # made by the conversion (a holder, ModeUnavailable)
        r.__dict__["_modules"] = children
        return r
    cross, hand = _cross(r), handing.handed_dtype(r)
    if not root and cross is None and hand is None and _unchanged(r, m) and list(children) == list(m._modules) \
            and all(children[k] is m._modules[k] for k in children):
        return m
    made = mirror(m, children, cross, hand)
    if "ampfx_report" in r.__dict__:  # the other mode's conversion, which keeps its Python: what it runs
        made.ampfx_report = r.__dict__["ampfx_report"]
    views.hold(m, made)
    return made


def _view_graph(gm: AmpGraphModule, m: nn.Module | None, views: Views, where: str, alternative: bool) -> nn.Module:
    if m is None:
        raise StaleModelError(f"ampfx: no module of the model at {where!r} for its converted graph; please report "
                              "this with the model")
    children = {name: _view(c, m._modules.get(name), views, _join(where, name)) for name, c in gm._modules.items()}
    gm.__dict__["_modules"] = children
    gm.view_of(m)
    if alternative:  # runs inside the call of the graph module it stands in for, whose hooks fired: none of its own
        for name in HOOKS:
            if isinstance(gm.__dict__.get(name), dict):
                gm.__dict__[name] = type(gm.__dict__[name])()
    plan = plan_of(gm)
    if not alternative and not plan.own_hooks:
        gm.share_hooks(m)
    views.graphs.append((gm, m))
    views.hold(m, gm)
    bound = views.bound[id(gm)] = {}
    recorded = plan.recorded
    if recorded is not None:  # armed with the graph (ampfx.runtime.arming)
        bound["fixed"] = recorded.bind(m, where, root_hooks=plan.own_hooks and not alternative, low=plan.low)
        for path in recorded.inlined:
            sub = _at(m, path)
            if sub is not None:
                views.inlined[id(sub)] = sub
        for owner, attr, _, _ in recorded.tensors:
            sub = _at(m, owner)
            if sub is not None:
                views.read_tensors.add((id(sub), attr))
    if plan.other is not None:
        bound["alt"] = (plan.other.mode, _view(plan.other, m, views, where, root=True, alternative=True))
    return gm


def _at(m: nn.Module, path: str) -> nn.Module | None:
    try:
        return m.get_submodule(path) if path else m
    except AttributeError:
        return None


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _cross(r: nn.Module) -> torch.dtype | None:
    """The low dtype a kept module takes and returns across its boundary (:func:`ampfx.runtime.cross_in_float32`
    registered it on the copy), or ``None``."""
    for hook in r._forward_pre_hooks.values():
        if isinstance(hook, functools.partial) and hook.func is runtime._arguments_in:
            return hook.args[1]
    return None


def _unchanged(r: nn.Module, m: nn.Module) -> bool:
    """Is ``r`` (a copy of ``m``) as ``m`` is, but for its training flag (flags are read from the model)
    and hooks conversion removed (the other mode's twin runs without its root's hooks)? Its children
    are compared by the caller."""
    mine, theirs = r.__dict__, m.__dict__
    if mine.keys() - {"training", "ampfx_report"} != theirs.keys() - {"training"}:
        return False
    for key, value in mine.items():
        if key in ("training", "_modules", "ampfx_report"):
            continue
        other = theirs[key]
        if value is other:
            continue
        if key in HOOKS:
            if any(k not in other or other[k] is not h for k, h in value.items()):
                return False  # a hook the conversion added
            continue
        if type(value) is not type(other) or type(value) not in CONTAINERS:
            return False
        if isinstance(value, (set, frozenset)) and value != other or \
                not isinstance(value, (set, frozenset)) and not same_contents(other, value):
            return False
    return True


# --- converting again at call time ----------------------------------------------------------------------


@dataclasses.dataclass
class Reconvert:
    """Converts a graph module's model module again, with the values it has now, on the inputs of the call
    that found its graph's fixed values changed (armed with it: :func:`ampfx.runtime.arming.arm`).
    At most ``limit`` times per module (``Policy.reconvert_limit``). With ``training``, it makes the other
    training mode's conversion instead, when first needed
    (:class:`~ampfx.runtime.graph_module.PendingMode`; ``memo``: what the first mode's capture learnt)."""

    #: (model module, call, path, arrive, training mode or None, memo or None)
    convert: Callable[[nn.Module, Any, str, Any, Any, Any], tuple[nn.Module, Any]]
    arrive: torch.dtype | None
    limit: int
    arm: Callable[[Views], None] = lambda views: None  # gives the new conversion's graphs their own Reconvert

    def __call__(self, gm: AmpGraphModule, args: tuple, kwargs: dict, changes: list[str],
                 training: bool | None = None, memo: Any = None) -> nn.Module:
        model = gm.__dict__["_ampfx_model"]
        where = gm._rt.where
        if self.arrive not in (None, torch.float32):  # the caller's graph hands it low values: the model's are float32
            args, kwargs = runtime._arguments_in(torch.float32, self.arrive, model, args, kwargs)
        result, report = self.convert(model, (args, kwargs), where, self.arrive, training, memo)
        made, views = rebase_part(result, model, where)
        self.arm(views)
        note = f"converted again at a call: {'; '.join(changes[:3])}" if training is None else "; ".join(changes)
        # an attribute of its own (a mirror's __dict__ is the model module's)
        made.ampfx_report = dataclasses.replace(report, notes=(*report.notes, note))
        return made

    def __deepcopy__(self, memo: dict) -> "Reconvert":
        return self


def rebase_part(result: nn.Module, model: nn.Module, where: str) -> tuple[nn.Module, Views]:
    """:func:`rebase` for a module converted again at ``where``, which runs inside the call of the converted
    module it replaces (its hooks fired there): never the model module itself (a graph module, or a mirror
    for Python that reads its values live)."""
    views = Views()
    if isinstance(result, AmpGraphModule):
        return _view_graph(result, model, views, where, alternative=True), views
    return _view(result, model, views, where, root=True), views

"""What a converted graph fixed about the model's Python, checked at every call.

A graph is the model's Python run once: every module whose ``forward`` it traced
through (*inlined* modules) had its training flag, its plain attributes
(``self.eps``, ``self.scale``, a flag in an ``if``), the module-level globals its
code reads, and its hooks read then, and the graph holds those values for ever.
torch.compile guards each such value and recompiles when one changes; ampfx does
the same with a :class:`Fixed` per graph:

1. :func:`ampfx.capture.fixing.record` (at conversion, on the module the graph was captured from) notes,
   for every inlined module, its flag (where its class reads ``training``), the
   attributes its class's code names (read from the bytecode), the globals that
   code reads (plain values only: numbers, strings, tuples, plain containers), whether
   it has hooks, and the dtype and device of each parameter and buffer the graph reads;
2. :meth:`Recorded.bind` (when the converted module becomes a view of the model,
   :mod:`ampfx.runtime.view`) points each entry at the model's own module;
3. :meth:`Fixed.holds` runs before every call of the graph: list compares over
   those slots (flags, attributes, globals), identity for tensors and objects, one
   global counter for hooks (``RemovableHandle.next_id``: a hook registered anywhere
   moves it), dtype and device of the tensors. When it fails, the converted module
   runs another conversion that holds (the other training mode, an earlier
   re-conversion) or converts again (:mod:`ampfx.runtime.graph_module`); :meth:`Fixed.changes`
   says what changed.

Leaves (``nn.Dropout``, ``nn.BatchNorm2d``, modules that keep their Python) are the
model's own modules, called at run time: their flags and attributes are read
live and need no entry here.

>>> import torch, torch.nn as nn
>>> from ampfx.capture.fixing import record
>>> class Scaled(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.lin, self.t = nn.Linear(2, 2), 2.0
...     def forward(self, x):
...         return self.lin(x) / self.t
>>> net = Scaled()
>>> fixed = record(net, inlined=("", "lin"), tensors=("lin.weight", "lin.bias")).bind(net, "")
>>> fixed.holds()
True
>>> net.t = 4.0
>>> fixed.holds(), fixed.changes()
(False, ['model.t is 4.0, the graph was converted with 2.0'])
"""
from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import operator
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .. import runtime
from . import written

_MISSING = object()

HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
"""The hook dicts a traced forward reads (the ``*_with_kwargs`` / ``always_called`` dicts are keyed like these)."""

_ATOMS = (int, float, bool, str, bytes, complex, type(None), torch.dtype, torch.device, torch.Size, enum.Enum,
          slice, range, type(Ellipsis), torch.memory_format, torch.layout)

MAX_DEPTH = 2
"""How many calls deep :func:`global_reads` follows functions named in a forward's code."""


def plain(value: Any, depth: int = 0) -> bool:
    """Is ``value`` compared by ``==`` (numbers, strings, dtypes, and tuples, lists, sets and dicts of
    those)? Tensors, modules, functions and other objects are compared by identity.

    >>> plain((1, 2.0, "a")), plain({"k": [1, 2]}), plain(torch.ones(1)), plain([torch.ones(1)])
    (True, True, False, False)
    """
    if isinstance(value, _ATOMS) and not isinstance(value, torch.Tensor):
        return True
    if depth > 3:
        return False
    if type(value) in (tuple, list, set, frozenset):
        return all(plain(v, depth + 1) for v in value)
    if type(value) is dict:
        return all(plain(k, depth + 1) and plain(v, depth + 1) for k, v in value.items())
    return False


@dataclass(frozen=True)
class _Place:
    """A module-level global by its place (``module.name``), in a pickle of :class:`Recorded`."""

    home: str
    name: str

    def resolve(self) -> Any:
        try:
            return getattr(importlib.import_module(self.home), self.name, _MISSING)
        except ImportError:
            return _MISSING


def _loaded(fields: dict) -> Recorded:
    """A :class:`Recorded` from its pickle: each global compared by identity is the object its place holds now."""
    fields["globals"] = tuple((home, glob, by_value, value.resolve() if isinstance(value, _Place) else value)
                              for home, glob, by_value, value in fields["globals"])
    return Recorded(**fields)


def _snapshot(value: Any) -> tuple[bool, Any]:
    """``(by_value, what to compare with)``: a copy of a plain value, else the object (compared by identity)."""
    if plain(value):
        return True, copy.deepcopy(value)
    return False, value


@dataclass(frozen=True)
class Recorded:
    """What :func:`record` saw, by path relative to the converted module (bound by :meth:`bind`)."""

    flags: tuple[tuple[str, bool], ...] = ()
    attributes: tuple[tuple[str, str, bool, Any], ...] = ()  # (path, name, by value, snapshot)
    configs: tuple[tuple[str, str, dict], ...] = ()  # (path, name, plain vars of an object attribute)
    hooked: tuple[str, ...] = ()  # inlined modules that had hooks (traced in)
    inlined: tuple[str, ...] = ()
    globals: tuple[tuple[str, str, bool, Any], ...] = ()  # (module name, global name, by value, snapshot)
    tensors: tuple[tuple[str, str, torch.dtype, int], ...] = ()  # (owner path, name, dtype, device index)
    children: tuple[str, ...] = ()  # the converted module's own submodules' names (``del model.x`` is not heard)
    lifted: tuple[tuple[str, str, float], ...] = ()  # float attributes read at every call: (path, name, largest)
    classes: tuple[tuple[type, str, Any], ...] = ()  # class-level defaults the forward reads (class, name, value)
    objects: tuple[tuple[str, str, dict], ...] = ()  # plain fields of module-level objects (module, global, fields)
    folded: tuple[tuple[str, str, Any], ...] = ()  # buffers the graph holds the values of: (path, name, values)

    def __reduce__(self) -> tuple:
        """A pickle keeps each global compared by identity (a registry, a function table: HF's
        ``ALL_ATTENTION_FUNCTIONS``) as its place, not as a copy: a loaded copy compares with the object that
        place holds when it is loaded (a copy of the object would never be it)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        fields["globals"] = tuple((home, glob, by_value, value if by_value else _Place(home, glob))
                                  for home, glob, by_value, value in self.globals)
        return (_loaded, (fields,))

    def bind(self, module: nn.Module, where: str, root_hooks: bool = False, low: torch.dtype = torch.bfloat16) -> Fixed:
        """The check of these values against ``module`` (the model's module the graph stands for, at
        ``where`` in the model) and its submodules, from now on. ``root_hooks``: ``module``'s own hooks
        are checked too (the graph module keeps copies of them instead of sharing its dicts)."""
        found: dict[str, nn.Module | None] = {}

        def at(path: str) -> nn.Module | None:
            if path not in found:
                try:
                    found[path] = module.get_submodule(path) if path else module
                except AttributeError:
                    found[path] = None
            return found[path]
        name = (lambda p: f"model.{where}.{p}".rstrip(".") if where else f"model.{p}".rstrip("."))
        eq: list[tuple[dict, str, Any, str]] = []
        same: list[tuple[dict, str, Any, str]] = []
        for path, flag in self.flags:
            m = at(path)
            if m is not None:  # a graph module loaded from a pickle keeps its own flag under another name
                key = "_ampfx_training" if "_ampfx_training" in m.__dict__ else "training"
                eq.append((m.__dict__, key, flag, f"{name(path)} mode"))
        for path, attr, by_value, value in self.attributes:
            m = at(path)
            if m is None or (not by_value and value is not _MISSING and attr not in m.__dict__):
                continue  # a loaded copy keeps no function attributes of its model: nothing to compare
            (eq if by_value else same).append((m.__dict__, attr, value, name(path) + f".{attr}"))
        for path in self.inlined:  # an instance attribute `forward` replaces the forward the graph traced
            m = at(path)
            if m is not None:
                same.append((m.__dict__, "forward", m.__dict__.get("forward", _MISSING), f"{name(path)}.forward"))
        eq.append((module._modules, _KEYS, list(self.children), f"{name('')} submodules"))
        for path, attr, fields in self.configs:
            m = at(path)
            obj = m.__dict__.get(attr) if m is not None else None
            if obj is not None and isinstance(getattr(obj, "__dict__", None), dict):
                eq.extend((obj.__dict__, key, value, f"{name(path)}.{attr}.{key}") for key, value in fields.items())
        for klass, attr, value in self.classes:
            eq.append((klass.__dict__, attr, value, f"{klass.__qualname__}.{attr}"))
        for home, glob, fields in self.objects:
            obj = getattr(sys.modules.get(home), glob, None)
            if isinstance(getattr(obj, "__dict__", None), dict):
                eq.extend((obj.__dict__, key, value, f"global {glob}.{key} of {home}") for key, value in fields.items())
        for home, glob, by_value, value in self.globals:
            space = getattr(sys.modules.get(home), "__dict__", None)
            if space is not None:
                (eq if by_value else same).append((space, glob, value, f"global {glob} of {home}"))
        paths = [p for p in self.inlined if p or root_hooks]
        hooks = [(getattr(m, h), f"{name(p)}") for p in paths if (m := at(p)) is not None for h in HOOKS
                 if isinstance(getattr(m, h, None), dict)]
        tensors = []
        for path, attr, dtype, device in self.tensors:
            m = at(path)
            if m is None:
                continue
            d = m._parameters if attr in m._parameters else m._buffers if attr in m._buffers else m.__dict__
            tensors.append((d, attr, dtype, device, name(path) + f".{attr}"))
        ranges = [(m.__dict__, attr, largest, f"{name(path)}.{attr}") for path, attr, largest in self.lifted
                  if (m := at(path)) is not None]
        held = [Held(m._buffers, attr, values, f"{name(path)}.{attr}") for path, attr, values in self.folded
                if (m := at(path)) is not None]
        fixed = Fixed(eq, same, hooks, any(p or root_hooks for p in self.hooked), tensors, low, ranges=ranges,
                      held=held)
        fixed.source = (self, module, where, root_hooks)
        return fixed


_KEYS = object()
"""The key of an ``eq`` slot that compares a dict's keys (a module's submodule names)."""


def _fields(obj: Any) -> dict | None:
    """The plain fields of a configuration object (its ``__dict__``'s plain values), else ``None``."""
    fields = getattr(obj, "__dict__", None)
    if not isinstance(fields, dict) or isinstance(obj, (nn.Module, type, types.ModuleType, types.FunctionType)):
        return None
    found = {k: copy.deepcopy(v) for k, v in fields.items() if plain(v)}
    return found or None


@dataclass(eq=False)
class Fixed:
    """The per-call check of what one graph fixed (see the module docstring)."""

    eq: list[tuple[dict, Any, Any, str]]  # (dict, key, value, what it is): compared with ==
    same: list[tuple[dict, str, Any, str]]  # compared by identity
    hooks: list[tuple[dict, str]]  # the inlined modules' hook dicts
    hooked: bool  # an inlined module had hooks: they are checked at every call
    tensors: list[tuple[dict, str, torch.dtype, int, str]]
    #: the conversion's low dtype: a float32 weight in it counts as float32 (the graph casts each weight to what
    #: its op needs; FSDP2's MixedPrecisionPolicy gathers weights low for the forward)
    low: torch.dtype = torch.bfloat16
    _values: list[Any] = field(default_factory=list)
    _objects: list[Any] = field(default_factory=list)
    _hook_ids: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    _metas: list[Any] = field(default_factory=list)
    seen: int = -1  # RemovableHandle.next_id when the hooks last held
    source: tuple = ()  # (Recorded, module, where, root_hooks): what it was bound from
    #: float attributes the graph reads at every call, each a number the low dtype holds at most ``largest``:
    #: a value out of that range was not lifted, and one that leaves it converts again (ops kept float32 for it)
    ranges: list[tuple[dict, str, float, str]] = field(default_factory=list)
    #: buffers whose values the graph holds (:mod:`ampfx.capture.fold`)
    held: list[Held] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"Fixed({len(self.eq) + len(self.same)} values, {len(self.tensors)} tensors, {len(self.hooks)} hook "
                f"dicts)")

    def __deepcopy__(self, memo: dict) -> Fixed:
        """The same check bound to the copy of its module (a copied converted module checks its own copy
        of the model; module dicts are not shared with the copy's modules otherwise)."""
        recorded, module, where, root_hooks = self.source
        return recorded.bind(copy.deepcopy(module, memo), where, root_hooks, self.low)

    def __post_init__(self) -> None:
        self._values = [v for _, _, v, _ in self.eq]
        self._objects = [v for _, _, v, _ in self.same]
        self._hook_ids = ([len(d) for d, _ in self.hooks], [sum(d) for d, _ in self.hooks])
        self._kinds = {self.low: torch.float32}
        self._metas = [(self._kinds.get(dtype, dtype), device) for _, _, dtype, device, _ in self.tensors]
        self.seen = RemovableHandle.next_id
        self._groups = _grouped(self.eq)
        terms = len(self._groups) + len(self.same) + len(self.tensors) + len(self.ranges) + len(self.held)
        self._values_hold = _compile(self) if terms <= COMPILED_SLOTS else self._loop

    def holds(self) -> bool:
        """Does every value the graph fixed still hold? (One generated expression over the slots, then the
        hooks when a hook was registered anywhere since they last held.)"""
        if not self._values_hold():
            return False
        # under torch.compile the hook dicts themselves are read: dynamo guards on what a frame reads, and the
        # process-wide handle counter moves whenever any hook anywhere is registered (a recompile at every step)
        compiling = runtime.is_compiling()
        if self.hooked or compiling or RemovableHandle.next_id != self.seen:
            if [len(d) for d, _ in self.hooks] != self._hook_ids[0] or \
                    [sum(d) for d, _ in self.hooks] != self._hook_ids[1]:
                return False
            if not compiling:
                self.seen = RemovableHandle.next_id
        return True

    def _loop(self) -> bool:
        """:func:`_compile`'s expression as loops over the slots (for a graph with many: one expression of
        thousands of terms takes seconds to compile, the loops cost about 0.1 us a slot)."""
        if not all(list(d) == v if k is _KEYS else d.get(k, _MISSING) == v if get is None
                   else d.keys() >= k and get(d) == v for d, k, v, get in self._groups):
            return False
        if self.same and not all(d.get(k, _MISSING) is v for (d, k, _, _), v in zip(self.same, self._objects)):
            return False
        if self.tensors and [(self._kinds.get(t.dtype, t.dtype), t.get_device()) if (t := d.get(k)) is not None
                             else None for d, k, _, _, _ in self.tensors] != self._metas:
            return False
        if self.ranges and not all(type(v := d.get(k)) in (float, int) and -top <= v <= top
                                   for d, k, top, _ in self.ranges):
            return False
        return all(h.holds() for h in self.held)

    def lowered(self) -> list[str]:
        """The float32 tensors the graph reads that are now in a low dtype other than the conversion's
        (``model.half()`` under a bfloat16 conversion): the ops ampfx keeps float32 cannot take them."""
        low = (torch.float16, torch.bfloat16)
        return [f"{what} ({str(t.dtype).replace('torch.', '')})" for d, k, dtype, _, what in self.tensors
                if dtype == torch.float32 and (t := d.get(k)) is not None and t.dtype in low and t.dtype != self.low]

    def changes(self) -> list[str]:
        """What no longer holds, one line each (the slow path, after :meth:`holds` failed)."""
        out = []
        for d, k, value, what in self.eq:
            now = list(d) if k is _KEYS else d.get(k, _MISSING)
            if now != value:
                if k is _KEYS:
                    gone, new = sorted(set(value) - set(now)), sorted(set(now) - set(value))
                    out.append(f"{what} changed: {', '.join([*(f'{g} deleted' for g in gone), *(f'{n} added' for n in new)])}")
                elif k in ("training", "_ampfx_training"):
                    out.append(f"{what.removesuffix(' mode')} is in {'train' if now else 'eval'} mode, the graph was "
                               f"converted with it in {'train' if value else 'eval'} mode")
                elif now is _MISSING:
                    out.append(f"{what} was deleted, the graph was converted with {_short(value)}")
                else:
                    out.append(f"{what} is {_short(now)}, the graph was converted with {_short(value)}")
        for (d, k, _, what), value in zip(self.same, self._objects):
            if d.get(k, _MISSING) is not value:
                out.append(f"{what} was set on the module" if k == "forward" and value is _MISSING else
                           f"{what} was replaced by another object ({_short(d.get(k))})")
        for (d, k, dtype, device, what), meta in zip(self.tensors, self._metas):
            t = d.get(k)
            if t is None:
                out.append(f"{what} is None, the graph was converted with a tensor")
            elif (self._kinds.get(t.dtype, t.dtype), t.get_device()) != meta:
                out.append(f"{what} is {str(t.dtype).replace('torch.', '')} on {t.device}, the graph was converted "
                           f"with {str(dtype).replace('torch.', '')} on {_device(device)}")
        for d, k, top, what in self.ranges:
            v = d.get(k)
            if not (type(v) in (float, int) and -top <= v <= top):
                out.append(f"{what} is {_short(v)}: the graph reads it at every call as a number the low dtype holds "
                           f"(at most {top:g})")
        out.extend(h.change() for h in self.held if not h.holds())
        for (d, what), n, total in zip(self.hooks, *self._hook_ids):
            if len(d) != n or sum(d) != total:
                out.append(f"hooks of {what} changed since conversion (the graph traced its forward, so hooks "
                           "registered or removed since are not in it)")
        return list(dict.fromkeys(out))


class Held:
    """A buffer whose values a graph holds (:mod:`ampfx.capture.fold`): :meth:`holds` while the buffer at
    ``d[key]`` has ``values``. The buffer is remembered, and stamped (:mod:`ampfx.runtime.written`), once its values were seen
    to be the graph's: a call compares identities, and the values only after a write (an optimizer's,
    ``load_state_dict``'s, DDP's broadcast, one through ``.data``) or a new tensor.

    >>> buffers = {"stride": torch.tensor([2, 2])}
    >>> held = Held(buffers, "stride", [2, 2], "model.stride")
    >>> held.holds(), buffers["stride"].fill_(2) is not None, held.holds()
    (True, True, True)
    >>> buffers["stride"][0] = 3
    >>> held.holds(), held.change()
    (False, 'model.stride is [3, 2], the graph was converted with its values [2, 2]')
    >>> buffers["stride"][0] = 2
    >>> held.holds()
    True
    >>> buffers["stride"].data[0] = 5             # through .data: no version counter moves
    >>> held.holds()
    False
    """

    def __init__(self, d: dict, key: str, values: Any, what: str) -> None:
        self.d, self.key, self.values, self.what = d, key, values, what
        self.tensor: torch.Tensor | None = None
        self.version = -1
        self.mark: int | None = None

    def holds(self) -> bool:
        t = self.d.get(self.key)
        if t is self.tensor and t is not None:
            if runtime.is_compiling():  # dynamo guards the buffer's version
                if not t.is_inference() and t._version == self.version:
                    return True
            elif written.unwritten(t, self.mark):  # writes through .data too
                return True
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.tolist() != self.values:
            return False
        self.tensor, self.version = t, (-1 if t.is_inference() else t._version)
        self.mark = None if runtime.is_compiling() else written.stamp(t)
        return True

    def change(self) -> str:
        t = self.d.get(self.key)
        now = t.tolist() if isinstance(t, torch.Tensor) and not t.is_floating_point() else _short(t)
        return f"{self.what} is {now}, the graph was converted with its values {self.values}"


COMPILED_SLOTS = 512
"""Up to this many terms (:func:`_grouped`) a :class:`Fixed` checks its slots in one generated expression
(:func:`_compile`)."""


_PLAIN_MAPPINGS = (dict, types.MappingProxyType)
"""The dicts :func:`_grouped` reads a key at a time with ``itemgetter``: no ``__missing__`` (a ``defaultdict`` would
make a deleted key anew)."""


def _grouped(eq: list[tuple[dict, Any, Any, str]]) -> list[tuple[dict, Any, Any, Any]]:
    """``eq``'s slots as terms ``(dict, key or keys, value or values, getter)``: the slots of one dict whose keys
    were present as one term, its keys' values read at once (``operator.itemgetter``, compared as a tuple: one
    C call for a configuration object's hundred fields, where a term a field cost about 0.1 us each); the others
    (the keys of a dict, a key that was absent) one term each, getter ``None``.

    >>> d = {"a": 1, "b": 2}
    >>> terms = _grouped([(d, "a", 1, ""), (d, "b", 2, ""), (d, "c", _MISSING, "")])
    >>> [(sorted(key) if get else key, get(d) if get else None) for _, key, _, get in terms]
    [(['a', 'b'], (1, 2)), ('c', None)]
    """
    by_dict: dict[int, list[tuple[dict, Any, Any, str]]] = {}
    single = []
    for slot in eq:
        d, k, v, _ = slot
        if k is _KEYS or v is _MISSING or type(d) not in _PLAIN_MAPPINGS:
            single.append((d, k, v, None))
        else:
            by_dict.setdefault(id(d), []).append(slot)
    out = []
    for slots in by_dict.values():
        if len(slots) == 1:
            d, k, v, _ = slots[0]
            out.append((d, k, v, None))
            continue
        keys = tuple(k for _, k, _, _ in slots)
        out.append((slots[0][0], frozenset(keys), tuple(v for _, _, v, _ in slots), operator.itemgetter(*keys)))
    return out + single


def _same_values(d: dict, get: Any, values: tuple) -> Any:
    """A check of no arguments: do ``d``'s keys that ``get`` reads hold ``values`` (a key gone: no)?"""
    def same() -> bool:
        try:
            return get(d) == values
        except KeyError:
            return False
    return same


def _compile(fixed: Fixed) -> Any:
    """A function of no arguments that is ``True`` when every slot of ``fixed`` (values, identities, tensors'
    dtype and device, lifted floats' range) holds: one ``and`` of straight comparisons, each slot's dict, key
    and value bound by name (a loop over the slots costs several times more per call)."""
    names: dict[str, Any] = {"M": _MISSING, "NUM": (float, int)}
    terms = []
    for i, (d, k, v, get) in enumerate(fixed._groups):
        names[f"d{i}"], names[f"k{i}"], names[f"v{i}"] = d, k, v
        names[f"g{i}"] = _same_values(d, get, v) if get is not None else None
        terms.append(f"list(d{i}) == v{i}" if k is _KEYS else f"d{i}.get(k{i}, M) == v{i}" if get is None
                     else f"g{i}()")
    for i, (d, k, v, _) in enumerate(fixed.same):
        names[f"s{i}"], names[f"sk{i}"], names[f"o{i}"] = d, k, v
        terms.append(f"s{i}.get(sk{i}, M) is o{i}")
    for i, ((d, k, _, device, _), (kind, _)) in enumerate(zip(fixed.tensors, fixed._metas)):
        allowed = {dtype for dtype in (torch.float32, fixed.low) if kind == torch.float32} or {kind}
        names[f"t{i}"], names[f"tk{i}"], names[f"dt{i}"], names[f"dv{i}"] = d, k, frozenset(allowed), device
        terms.append(f"(x := t{i}.get(tk{i})) is not None and x.dtype in dt{i} and x.get_device() == dv{i}")
    for i, (d, k, top, _) in enumerate(fixed.ranges):
        names[f"r{i}"], names[f"rk{i}"], names[f"top{i}"] = d, k, top
        terms.append(f"type(y := r{i}.get(rk{i})) in NUM and -top{i} <= y <= top{i}")
    for i, h in enumerate(fixed.held):
        names[f"h{i}"] = h
        terms.append(f"h{i}.holds()")
    source = (f"def make({', '.join(names)}):\n"
              f"    def values_hold():\n        return {' and '.join(terms) or 'True'}\n"
              f"    return values_hold\n")
    space: dict[str, Any] = {}
    exec(compile(source, "<ampfx.runtime.fixed>", "exec"), space)  # noqa: S102 - code made from slot indices only
    return space["make"](**names)


def _device(index: int) -> str:
    return "cpu" if index < 0 else f"cuda:{index}"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor {str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

"""What a captured graph fixed of the model's Python, read at conversion (:func:`record`): for every module
whose ``forward`` the graph traced through, its training flag (where its class reads ``training``), the
attributes its class's code names (read from the bytecode), the globals that code reads, whether it has hooks,
and the dtype and device of each parameter and buffer the graph reads. The record it makes
(:class:`ampfx.runtime.fixed.Recorded`) is bound to the model and checked at every call by
:mod:`ampfx.runtime.fixed` (whose example makes, binds and checks one); this module only reads code and modules,
at conversion.
"""
from __future__ import annotations

import builtins
import copy
import dis
import inspect
import sys
import types
from typing import Any, Iterator

import torch
import torch.nn as nn

from ..runtime.fixed import HOOKS, MAX_DEPTH, Recorded, _fields, _MISSING, _snapshot, plain
from ..state import TORCH_KEYS


_SKIP_GLOBALS = ("torch", "builtins", "typing", "math", "numpy", "functools", "collections", "abc", "enum",
                 "warnings", "logging", "inspect", "dataclasses", "einops", "operator", "itertools")
"""Packages whose functions are not scanned for globals: torch's own code, the standard library's, numpy's."""


def _code_names(code: types.CodeType) -> Iterator[str]:
    """Every name ``code`` (and the code nested in it) mentions: attributes and globals alike."""
    yield from code.co_names
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_names(c)


def _global_names(code: types.CodeType) -> Iterator[str]:
    """The names ``code`` (and the code nested in it) loads as globals (``self.conv`` is an attribute, not
    the module-level function ``conv``)."""
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield ins.argval
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _global_names(c)


def _function(obj: Any) -> types.FunctionType | None:
    """The plain function behind a method, property, static or class method (decorators unwrapped)."""
    if isinstance(obj, property):
        obj = obj.fget
    elif isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    try:
        obj = inspect.unwrap(obj)
    except ValueError:
        return None
    return obj if isinstance(obj, types.FunctionType) else None


def _class_attr(cls: type, name: str) -> tuple[type, Any] | None:
    """``(defining class, value)`` of ``name`` in ``cls``'s classes below ``nn.Module``, else ``None``."""
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            return None
        if name in vars(klass):
            return klass, vars(klass)[name]
    return None


def _functions(cls: type) -> Iterator[types.FunctionType]:
    """The functions of ``cls`` its ``forward`` reaches: ``forward`` (and ``__call__`` if the class has its
    own), then every method or property of the class that code names, and so on (bookkeeping a training loop
    calls, such as ``on_optimizer_step``, is not the forward's)."""
    todo = ["forward", "__call__", "_call_impl"]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        found = _class_attr(cls, name)
        fn = _function(found[1]) if found is not None else None
        if fn is None or found[0].__module__.startswith("torch.fx"):
            continue
        yield fn
        todo.extend(_code_names(fn.__code__))


_NAMES: dict[type, frozenset[str]] = {}


def read_names(cls: type) -> frozenset[str]:
    """Every name the code ``cls``'s ``forward`` reaches mentions (attributes it may read), from the bytecode;
    cached per class.

    >>> "eps" in read_names(nn.LayerNorm), "in_features" in read_names(nn.Linear)
    (True, False)
    """
    if cls not in _NAMES:
        _NAMES[cls] = frozenset(n for fn in _functions(cls) for n in _code_names(fn.__code__))
    return _NAMES[cls]


_GLOBALS: dict[type, tuple[tuple[str, str], ...]] = {}


def _own(fn: Any) -> bool:
    module = getattr(fn, "__module__", None) or ""
    return module.split(".")[0] not in _SKIP_GLOBALS


def reached(cls: type) -> list[types.FunctionType]:
    """The code ``cls``'s forward runs: its own functions (:func:`_functions`) and the functions outside torch
    and the standard library they call by global name, :data:`MAX_DEPTH` calls deep."""
    todo = [(fn, 0) for fn in _functions(cls)]
    seen: dict[int, types.FunctionType] = {}
    while todo:
        fn, depth = todo.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        if depth >= MAX_DEPTH or not _own(fn):
            continue
        space = fn.__globals__
        for name in set(_global_names(fn.__code__)):
            value = space.get(name)
            if isinstance(value, types.FunctionType) and _own(value):
                todo.append((value, depth + 1))
    return list(seen.values())


_READS_TRAINING: dict[type, bool] = {}


def _reads(code: types.CodeType, name: str) -> bool:
    return name in code.co_names or any(_reads(c, name) for c in code.co_consts if isinstance(c, types.CodeType))


def reads_training(cls: type) -> bool:
    """Does any method of ``cls`` (or of its bases below ``nn.Module``), or a function its forward calls by
    global name, read ``training``? Read from the bytecode, so it also works for classes defined in
    notebooks and ``exec``. Cached per class."""
    if cls not in _READS_TRAINING:
        _READS_TRAINING[cls] = any(
            _reads(inspect.unwrap(fn).__code__, "training")  # unwrap: decorated forwards (HF's) hide their code
            for klass in cls.__mro__ if klass not in (nn.Module, object)
            for fn in vars(klass).values() if hasattr(inspect.unwrap(fn), "__code__")) or any(
            _reads(fn.__code__, "training") for fn in reached(cls))
    return _READS_TRAINING[cls]


def global_reads(cls: type) -> tuple[tuple[str, str], ...]:
    """``(module name, global name)`` of every global the code ``cls``'s forward reaches (:func:`reached`,
    outside torch and the standard library) reads that a change could make it compute something else: plain
    values (compared by value), the module's own functions and objects (by identity; an object's plain fields
    by value too). Modules, classes, and torch's or the standard library's functions are not checked.
    Cached per class."""
    if cls not in _GLOBALS:
        found: dict[tuple[str, str], None] = {}
        for fn in reached(cls):
            if not _own(fn):
                continue
            space, home = fn.__globals__, fn.__globals__.get("__name__", "")
            for name in set(_global_names(fn.__code__)):
                value = space.get(name, _MISSING)
                if value is _MISSING or name.startswith("__") or isinstance(value, (type, types.ModuleType)):
                    continue
                if plain(value) or (_own(value) and (isinstance(value, types.FunctionType)
                                                     or not callable(value))):
                    found[(home, name)] = None
        _GLOBALS[cls] = tuple(found)
    return _GLOBALS[cls]


def record(root: nn.Module, inlined: tuple[str, ...], tensors: tuple[str, ...],
           lifted: frozenset[tuple[str, str]] = frozenset(), largest: float = float("inf"),
           seen: frozenset[tuple[str, str]] = frozenset(),
           folded: tuple[tuple[str, str, Any], ...] = ()) -> Recorded:
    """What a graph of ``root`` fixed: for the modules at ``inlined`` (paths in ``root``, '' for itself,
    whose forwards the graph traced through), their flags, the attributes and globals their code reads and
    whether they have hooks; for the parameters and buffers at ``tensors`` (``get_attr`` targets), dtype
    and device. ``lifted`` attributes are read by the graph at every call (:mod:`ampfx.capture.lift`): not
    fixed. ``seen``: attributes the traced code was seen reading (torch.fx), leaves' too (a parent's
    ``if self.drop.p > 0``), and inlined modules' that their code does not name (read by a helper it calls
    through an object: ``CHECKS[kind](self)``). ``folded``: ``(path, buffer name, values)`` of the buffers whose values the
    graph holds (:mod:`ampfx.capture.fold`)."""
    flags, attributes, configs, hooked, globs, classes, objects = [], [], [], [], {}, [], []
    read = set(tensors)  # tensor attributes the graph reads at every call (get_attr): only their dtype matters
    for path in inlined:
        m = root.get_submodule(path) if path else root
        cls = type(m)
        if reads_training(cls):
            flags.append((path, m.training))
        names = read_names(cls)
        for attr in names - m.__dict__.keys():  # a class-level default an instance attribute may shadow later
            found = _class_attr(cls, attr)
            if found is not None and plain(found[1]) and not attr.startswith("__"):
                attributes.append((path, attr, False, _MISSING))
                classes.append((found[0], attr, copy.deepcopy(found[1])))
        for attr, value in m.__dict__.items():
            if attr in TORCH_KEYS or attr == "training" or attr not in names or attr.startswith("_ampfx"):
                continue
            if isinstance(value, nn.Module) or (f"{path}.{attr}" if path else attr) in read or (path, attr) in lifted:
                continue  # a submodule held as an attribute (its own entry, if inlined), a tensor read live
            by_value, snap = _snapshot(value)
            attributes.append((path, attr, by_value, snap))
            fields = None if by_value else _fields(value)
            if fields is not None:
                configs.append((path, attr, fields))
        if any(getattr(m, h, None) for h in HOOKS):
            hooked.append(path)
        for home, glob in global_reads(cls):
            value = getattr(sys.modules.get(home), glob, _MISSING)
            if value is not _MISSING and home != builtins.__name__:
                globs[(home, glob)] = _snapshot(value)
                fields = None if plain(value) or callable(value) else _fields(value)
                if fields is not None:
                    objects.append((home, glob, fields))
    done = {(path, attr) for path, attr, _, _ in attributes}
    for path, attr in sorted(seen):
        if (path, attr) in done or (path, attr) in lifted:
            continue  # recorded above (the attributes an inlined module's code names)
        try:
            m = root.get_submodule(path) if path else root
        except AttributeError:
            continue
        if attr in m.__dict__ and plain(m.__dict__[attr]):
            attributes.append((path, attr, True, copy.deepcopy(m.__dict__[attr])))
    metas = []
    for target in tensors:
        owner, _, attr = target.rpartition(".")
        try:
            m = root.get_submodule(owner) if owner else root
        except AttributeError:
            continue
        t = m._parameters[attr] if attr in m._parameters else m._buffers.get(attr, m.__dict__.get(attr))
        if isinstance(t, torch.Tensor):
            metas.append((owner, attr, t.dtype, t.get_device()))
    return Recorded(tuple(flags), tuple(attributes), tuple(configs), tuple(hooked), tuple(inlined),
                    tuple((h, g, bv, s) for (h, g), (bv, s) in globs.items()), tuple(metas), tuple(root._modules),
                    tuple((path, attr, largest) for path, attr in sorted(lifted)), tuple(classes), tuple(objects),
                    tuple(folded))

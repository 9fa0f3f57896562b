"""A converted graph's torch ops called through their C++ handles, and its nested attributes read through the
module dicts.

``torch.fx`` writes a captured graph's op as ``torch.ops.aten.mm.default(x, y)``: four attribute reads and
``OpOverload.__call__``, a Python frame, before the op's C++ handle (``OpOverload._op``) runs. That is
``OpOverload.__call__``'s whole work for an op without a Python dispatcher, and it costs about 0.5 us of the
2 us such a call takes on a small tensor (torch 2.14, one CPU thread); an exported graph calls every op so, and a
converted BERT's forward runs hundreds of them a step.

:func:`forward` has fx generate the graph's code a second time with each such op standing as a global of its own
(fx's code generation names globals for what is not torch's: one name per op, kept apart by fx's namespace), and
binds each of those names to the op's handle: no text of the code is rewritten. :func:`either` runs that code
except under ``torch.compile``, which traces the code fx wrote first (dynamo knows ``torch.ops`` calls, not the
handles). The graph itself is not changed: its nodes, the decision log, pickles and ``gm.code`` keep naming the
ops. Calls through the handle go through torch's dispatcher as before (``__torch_function__`` and dispatch modes see
the same ``OpOverload``). :class:`~ampfx.runtime.graph_module.AmpGraphModule` does it each time its code is
generated (``recompile``: after conversion, when inference copies rename reads, in a copy, in a loaded pickle).

fx writes each read of a nested parameter, buffer or module as a ``getattr`` chain from the root:
``getattr(getattr(getattr(self.features, "1").block, "0"), "0").weight``. Each level is a failed attribute lookup
and then ``nn.Module.__getattr__``'s Python (about 1 us on a slow CPU, 0.6 ms a call for MobileNet-V3-small's 108
reads), where the model's own modules read their parameters one level deep. The same code reads them through the
module dicts instead (:func:`_readers`: ``self._modules["features"]._modules["1"]...._parameters["weight"]``), at
every call, so whatever replaces a parameter, a buffer or a module shows through as through ``getattr``; a name not
where it was (a parameter deleted, a parametrization) is read by ``getattr``.

>>> import torch, torch.fx as fx
>>> g = fx.Graph(); x = g.placeholder("x")
>>> _ = g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
>>> gm = fx.GraphModule(torch.nn.Module(), g)
>>> fast = forward(gm)
>>> fast(gm, torch.tensor([-1.0, 2.0]))
tensor([0., 2.])
>>> "ampfx_op_aten_relu_default(" in fast.__ampfx_source__, "torch.ops.aten.relu.default(" in gm.code
(True, True)
"""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.graph_module import _forward_from_src

from . import is_compiling

__all__ = ["either", "forward"]


def _handle(op: Any) -> Callable | None:
    """The C++ handle ``OpOverload.__call__`` would call for ``op``, or ``None`` where that call does more (an op with
    a Python dispatcher object, a TorchBind op) or ``op`` is no op overload."""
    if type(op) is not torch._ops.OpOverload or getattr(op, "_pyobj_dispatcher", None) is not None:
        return None
    return getattr(op, "_op", None)


def _grad_enabled(enable_grad: bool, wrapped: Callable, *args: Any, **kwargs: Any) -> Any:
    """``torch.ops.higher_order.wrap_with_set_grad_enabled`` run as its ``__call__`` runs it (grad mode set around the
    call), without the ``torch._dynamo.disable`` wrapper that call makes anew each time (about 200 us on a slow CPU:
    an exported ``with torch.no_grad()`` region, a rotary embedding's, cost 3x its module); restored on an error too."""
    before = torch.is_grad_enabled()
    torch._C._set_grad_enabled(enable_grad)
    try:
        return _body(wrapped)(*args, **kwargs)
    finally:
        torch._C._set_grad_enabled(before)


def _autocast(device_type: str, dtype: Any, enabled: bool, cache_enabled: Any, wrapped: Callable, *args: Any,
              **kwargs: Any) -> Any:
    """``torch.ops.higher_order.wrap_with_autocast`` run as its ``__call__`` runs it, without the dynamo wrapper."""
    with torch.autocast(device_type, dtype, enabled, cache_enabled):
        return _body(wrapped)(*args, **kwargs)


def _body(wrapped: Any) -> Any:
    """A region's body, an fx graph module an export made, with its own code's ops bound to their handles too (once,
    at its first run: a copy of the converted module copies its bodies as plain graph modules)."""
    cls = type(wrapped)
    if "_ampfx_lowered" not in cls.__dict__ and isinstance(wrapped, fx.GraphModule):
        cls._ampfx_lowered = True
        fast = forward(wrapped)
        if fast is not None:
            cls.forward = either(cls.forward, fast)
    return wrapped


@functools.cache
def plain_ops() -> dict[Any, Callable]:
    """Higher-order ops an export writes for a region of the forward (``with torch.no_grad()``, ``with torch.autocast``)
    whose ``__call__`` wraps a function in ``torch._dynamo.disable`` at each call and then runs it plainly: the plain
    run each stands for in the fast code (under ``torch.compile`` the code fx wrote runs, the op itself). Looked up at
    first need: ``torch.ops.higher_order`` loads torch's higher-order ops."""
    return {getattr(torch.ops.higher_order, name): run for name, run in
            (("wrap_with_set_grad_enabled", _grad_enabled), ("wrap_with_autocast", _autocast))
            if hasattr(torch.ops.higher_order, name)}


class _Slot:
    """An op as fx's code generation sees it while :func:`forward` runs it: not torch's (so fx names a global for
    it, ``ampfx_op_<namespace>_<op>_<overload>``), the handle to bind that global to."""

    def __init__(self, op: Any, handle: Callable) -> None:
        self.__module__ = "ampfx_op"
        self.__name__ = f"{op.namespace}_{op._opname}_{op._overloadname}" if isinstance(op, torch._ops.OpOverload) \
            else f"plain_{op._name}"
        self.handle, self.op = handle, op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # never run: its global is bound to the handle
        return self.op(*args, **kwargs)


class _Read:
    """A ``get_attr`` of a nested attribute as fx's code generation sees it while :func:`forward` runs it: a call
    of no argument with a global of its own (``ampfx_op_read_<path>``), bound to one of :func:`_readers`' functions."""

    def __init__(self, index: int, target: str, reader: Callable) -> None:
        self.__module__ = "ampfx_op"
        self.__name__ = f"read_{index}_" + "".join(c if c.isalnum() else "_" for c in target)
        self.handle = reader

    def __call__(self) -> Any:  # never run: its global is bound to the reader
        return self.handle()


def _readers(gm: fx.GraphModule, targets: set[str]) -> dict[str, Callable]:
    """For each ``target`` of ``gm`` (``"features.1.block.0.weight"``, ``"weight"``), a function reading it through
    the module dicts (``_modules`` at each level, then the dict of ``_parameters`` / ``_buffers`` / ``_modules`` that
    holds the last name now): what ``nn.Module.__getattr__`` does at each level, without its failed attribute
    lookup first (about 1 us a level on a slow CPU). A name of ``gm``'s own that no dict holds is read from the
    instance dict its class's ``__getattr__`` falls back to (:func:`_fallback`: a converted module's model module's
    attributes, ``self.eps``, cost an exception there, 3-7 us a read). None for a path that does not read so now,
    that passes a module whose ``__getattr__`` is its own, or that ``gm``'s class or instance dict would answer
    first. A read that finds no entry where it looks (a parameter deleted or parametrized, an attribute that is no
    child) takes fx's own path, the ``getattr`` chain. ``gm`` is held weakly: the functions are bound into its own
    class's ``forward``. All are compiled as one source."""
    lines, scope = [], {"ref": weakref.ref(gm)}
    names = {}
    for i, target in enumerate(sorted(targets)):
        *path, leaf = target.split(".")
        if not path and (leaf in gm.__dict__ or inspect.getattr_static(type(gm), leaf, None) is not None):
            continue  # found before any __getattr__: a read as fast as the dicts'
        try:
            along = _along(gm, path)
        except (KeyError, AttributeError, TypeError):
            continue
        last = along[-1]
        store = next((kind for kind in ("_parameters", "_buffers", "_modules")
                      if isinstance(getattr(last, kind, None), dict) and leaf in getattr(last, kind)), None)
        if not all(_plain_getattr(m) for m in along):
            continue
        walk = "".join(f"._modules[{name!r}]" for name in path)
        if store is not None:
            read = f"root{walk}.{store}[{leaf!r}]"
        elif not path and leaf in getattr(_fallback(gm), "__dict__", {}):
            read = f"root.__dict__[{leaf!r}] if {leaf!r} in root.__dict__ else root.__dict__[{_fallback_name(gm)!r}]" \
                   f".__dict__[{leaf!r}]"
        else:
            continue
        scope[f"_slow{i}"] = functools.partial(_getattr_chain, names=(*path, leaf))
        lines.append(f"def read{i}():\n    root = ref()\n    try:\n        return {read}\n"
                     f"    except (KeyError, AttributeError, TypeError):\n        return _slow{i}(root)\n")
        names[target] = f"read{i}"
    if names:  # code of names read from the graph's own targets, each a literal
        exec(compile("".join(lines), "<ampfx read>", "exec"), scope)  # noqa: S102
    return {target: scope[name] for target, name in names.items()}


def _fallback_name(gm: nn.Module) -> str | None:
    """The key of ``gm``'s instance dict holding the object whose own instance dict ``gm``'s class's ``__getattr__``
    reads after ``nn.Module``'s lookup fails (``_ampfx_falls_back_to`` on that ``__getattr__``), if it says so."""
    return getattr(getattr(type(gm), "__getattr__", None), "_ampfx_falls_back_to", None)


def _fallback(gm: nn.Module) -> Any:
    """The object :func:`_fallback_name` names, or None."""
    name = _fallback_name(gm)
    return gm.__dict__.get(name) if name is not None else None


def _calling(read: Callable) -> Callable:
    """A ``call_module`` node's call: the module its reader (:func:`_readers`) reads, called with the node's arguments."""

    def read_and_call(*args: Any, **kwargs: Any) -> Any:
        return read()(*args, **kwargs)

    return read_and_call


def _getattr_chain(root: Any, names: tuple[str, ...]) -> Any:
    """fx's own read of a nested attribute."""
    for name in names:
        root = getattr(root, name)
    return root


def _along(gm: fx.GraphModule, path: list[str]) -> list[Any]:
    """The modules a path passes through, ``gm`` first (the converted tree's own children where it keeps some:
    ``_modules`` is a property of those)."""
    seen, node = [gm], gm
    for name in path:
        node = node._modules[name]
        seen.append(node)
    return seen


def _plain_getattr(m: Any) -> bool:
    """Does ``m``'s ``__getattr__`` find children in its ``_modules`` first: ``nn.Module``'s, or ampfx's own module
    classes', which only add a fallback after it?"""
    found = getattr(type(m), "__getattr__", None)
    return found is nn.Module.__getattr__ or getattr(found, "_ampfx_modules_first", False)


def forward(gm: fx.GraphModule) -> Callable | None:
    """The function fx generates for ``gm``'s graph, with each op overload a call of its C++ handle and each
    nested attribute read through the module dicts (:func:`_readers`); ``None`` when the graph has neither, or while
    fx enriches the profiler's metadata (``torch.fx.experimental._config.enrich_profiler_metadata``: fx's own code
    runs, with the annotations it adds). fx generates it from a copy of the graph whose op nodes' targets are
    :class:`_Slot` s and whose nested ``get_attr`` nodes are calls of :class:`_Read` s (the graph itself is never
    changed: another thread may be pickling or copying it), and each one's global is bound to its handle or reader."""
    if _enriched():
        return None
    graph = gm.graph
    plain = plain_ops() if any(isinstance(n.target, torch._ops.HigherOrderOperator) for n in graph.nodes) else {}
    handles = {target: plain.get(target) or _handle(target)
               for target in {n.target for n in graph.nodes if n.op == "call_function"}}
    handles = {target: handle for target, handle in handles.items() if handle is not None}
    readers = _readers(gm, {n.target for n in graph.nodes
                            if n.op == "get_attr" or (n.op == "call_module" and "." in n.target)})
    if not handles and not readers:
        return None
    copy = fx.Graph(tracer_cls=graph._tracer_cls)
    out = copy.graph_copy(graph, {}, return_output_node=True)
    copy._codegen = graph._codegen
    if out is not None:
        value, node = out
        copy.output(value, type_expr=getattr(node, "type", None))
    slots = {target: _Slot(target, handle) for target, handle in handles.items()}
    reads = {target: _Read(i, target, reader) for i, (target, reader) in enumerate(sorted(readers.items()))}
    calls = {}
    for node in copy.nodes:
        if node.op == "call_function" and node.target in slots:
            node.target = slots[node.target]
        elif node.op == "get_attr" and node.target in reads:
            node.op, node.target = "call_function", reads[node.target]
        elif node.op == "call_module" and node.target in reads:  # the module read so, then called as fx calls it
            if node.target not in calls:
                calls[node.target] = _Read(len(reads) + len(calls), node.target, _calling(readers[node.target]))
            node.op, node.target = "call_function", calls[node.target]
    code = copy.python_code(root_module="self")
    bound = {name: value.handle if isinstance(value, (_Slot, _Read)) else value for name, value in code.globals.items()}
    fn = _forward_from_src(code.src, bound, getattr(graph, "_co_fields", None))
    fn.__ampfx_source__ = code.src
    if readers:
        fn.__ampfx_owner__ = weakref.ref(gm)  # the module its reads walk from
    return fn


def _enriched() -> bool:
    """Does fx annotate generated code for the profiler (then its own code is what runs)?"""
    config = getattr(getattr(torch.fx, "experimental", None), "_config", None)
    return bool(getattr(config, "enrich_profiler_metadata", False))


def either(plain: Callable, fast: Callable) -> Callable:
    """A graph module's ``forward``: ``fast`` (:func:`forward`'s), or ``plain`` (fx's) under ``torch.compile`` and
    fx tracing (their tracers see attribute reads through ``getattr``), and for a module other than the one ``fast``
    reads (a module of another class inheriting this ``forward``)."""
    owner = getattr(fast, "__ampfx_owner__", None)
    tracing = torch.fx._symbolic_trace.is_fx_tracing

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if is_compiling() or tracing() or (owner is not None and owner() is not self):
            return plain(self, *args, **kwargs)
        return fast(self, *args, **kwargs)

    functools.update_wrapper(forward, plain)
    forward.__signature__ = inspect.signature(plain)
    forward._ampfx_plain = plain
    return forward

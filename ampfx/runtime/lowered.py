"""A converted graph's torch ops called through their C++ handles.

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
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.graph_module import _forward_from_src

from . import is_compiling

__all__ = ["either", "forward"]


def _handle(op: Any) -> Callable | None:
    """The C++ handle ``OpOverload.__call__`` would call for ``op``, or ``None`` where that call does more (an op with
    a Python dispatcher object, a TorchBind op) or ``op`` is no op overload."""
    if type(op) is not torch._ops.OpOverload or getattr(op, "_pyobj_dispatcher", None) is not None:
        return None
    return getattr(op, "_op", None)


class _Slot:
    """An op as fx's code generation sees it while :func:`forward` runs it: not torch's (so fx names a global for
    it, ``ampfx_op_<namespace>_<op>_<overload>``), the handle to bind that global to."""

    def __init__(self, op: torch._ops.OpOverload, handle: Callable) -> None:
        self.__module__ = "ampfx_op"
        self.__name__ = f"{op.namespace}_{op._opname}_{op._overloadname}"
        self.handle, self.op = handle, op

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # never run: its global is bound to the handle
        return self.op(*args, **kwargs)


def forward(gm: fx.GraphModule) -> Callable | None:
    """The function fx generates for ``gm``'s graph, with each op overload a call of its C++ handle; ``None`` when
    the graph calls none, or while fx enriches the profiler's metadata (``torch.fx.experimental._config
    .enrich_profiler_metadata``: fx's own code runs, with the annotations it adds). fx generates it from a copy of
    the graph whose op nodes' targets are :class:`_Slot` s (the graph itself is never changed: another thread may
    be pickling or copying it), and each slot's global is bound to its handle."""
    if _enriched():
        return None
    graph = gm.graph
    handles = {target: _handle(target) for target in {n.target for n in graph.nodes if n.op == "call_function"}}
    handles = {target: handle for target, handle in handles.items() if handle is not None}
    if not handles:
        return None
    copy = fx.Graph(tracer_cls=graph._tracer_cls)
    out = copy.graph_copy(graph, {}, return_output_node=True)
    copy._codegen = graph._codegen
    if out is not None:
        value, node = out
        copy.output(value, type_expr=getattr(node, "type", None))
    slots = {target: _Slot(target, handle) for target, handle in handles.items()}
    for node in copy.nodes:
        if node.op == "call_function" and node.target in slots:
            node.target = slots[node.target]
    code = copy.python_code(root_module="self")
    bound = {name: value.handle if isinstance(value, _Slot) else value for name, value in code.globals.items()}
    fn = _forward_from_src(code.src, bound, getattr(graph, "_co_fields", None))
    fn.__ampfx_source__ = code.src
    return fn


def _enriched() -> bool:
    """Does fx annotate generated code for the profiler (then its own code is what runs)?"""
    config = getattr(getattr(torch.fx, "experimental", None), "_config", None)
    return bool(getattr(config, "enrich_profiler_metadata", False))


def either(plain: Callable, fast: Callable) -> Callable:
    """A graph module's ``forward``: ``fast`` (:func:`forward`'s), or ``plain`` (fx's) under ``torch.compile``."""

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return plain(self, *args, **kwargs)
        return fast(self, *args, **kwargs)

    functools.update_wrapper(forward, plain)
    forward.__signature__ = inspect.signature(plain)
    forward._ampfx_plain = plain
    return forward

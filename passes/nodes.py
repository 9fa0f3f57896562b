"""Facts about a node of a captured graph that every pass reads: what it writes and views, what the tables key
it by, whether it may carry a float, its dtype before conversion, what a cast or factory produces. No pass
decides here; each pass imports these from this module rather than from another pass.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from .. import ops
from ..meta import numel, out_infos, record
from ..ops import Category, Result, custom_ops
from ..report.records import CastInfo, Decision, Rule
from ..runtime import CASTABLE


def view_group(node: fx.Node, is_view: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """``node``, the tensor it views (up through nodes ``is_view`` accepts) and every view of that: the
    nodes an in-place write to any one of them changes."""
    base = node
    while is_view(base) and isinstance(base.args[0], fx.Node):
        base = base.args[0]
    group, stack = set(), [base]
    while stack:
        n = stack.pop()
        if n not in group:
            group.add(n)
            stack.extend(u for u in n.users if is_view(u))
    return group


def elements(n: fx.Node, symbolic: Callable[[Any], Any]) -> int:
    """Elements of ``n``'s first output; a symbolic count as ``symbolic(count)`` gives it (its least value, its value
    at the example inputs), 1 where that or the output is unknown.

    >>> g = fx.Graph(); x = g.placeholder("x")
    >>> elements(x, lambda count: None)
    1
    """
    infos = out_infos(n)
    if not infos:
        return 1
    count = numel(infos[0])
    if isinstance(count, int):
        return count
    at = symbolic(count)
    return int(at) if at is not None else 1


def joined(members: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each of ``members`` (in graph order) with the member standing for its group: members joined through their
    inputs, directly (union-find).

    >>> g = fx.Graph(); x = g.placeholder("x"); a = g.call_function(torch.relu, (x,))
    >>> b = g.call_function(torch.neg, (a,)); c = g.call_function(torch.neg, (x,))
    >>> groups = joined([a, b, c]); groups[a] is groups[b], groups[a] is groups[c]
    (True, False)
    """
    parent = {n: n for n in members}

    def root(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        for p in n.all_input_nodes:
            if p in parent:
                parent[root(p)] = root(n)
    return {n: root(n) for n in members}


def is_inplace(node: fx.Node, gm: fx.GraphModule) -> bool:
    """``x.add_(y)``, ``F.relu(x, inplace=True)``, ``nn.ReLU(inplace=True)``, ``x[i] = v``,
    ``torch.div(a, b, out=t)`` (writes ``t``: a cast copy of ``t`` would take the write instead)."""
    if isinstance(node.kwargs.get("out"), fx.Node):
        return True
    if node.op == "call_method":
        name = str(node.target)
        return ops.is_inplace_name(name)
    if node.op == "call_function":
        if node.kwargs.get("inplace") is True:
            return True
        if isinstance(node.target, torch._ops.OpOverload):  # ATen ops (torch.export): their schema says
            return ops.writes_first_argument(node.target) or custom_ops.writes_inputs(node.target)
        name = getattr(node.target, "__name__", "")
        return ops.is_inplace_operator(node.target) or custom_ops.writes_inputs(node.target) or (
            ops.is_inplace_name(name) and node.target not in (torch._assert,))
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(node.target)), "inplace", False) is True
    return False


def written(node: fx.Node) -> Any:
    """What an in-place ``node`` writes: its ``out=`` tensor, else its first argument.

    >>> g = fx.Graph(); a, t = g.placeholder("a"), g.placeholder("t")
    >>> written(g.call_function(torch.add, (a, 1.0), {"out": t})).name, written(g.call_method("add_", (a, 1.0))).name
    ('t', 'a')
    """
    return node.kwargs.get("out", node.args[0] if node.args else None)


def op_key(node: fx.Node, gm: fx.GraphModule) -> Any:
    """What the tables are keyed by: the callable, the method name or the module type."""
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target)))
    return node.target


def carries_float(node: fx.Node, decided: dict[fx.Node, Decision]) -> bool:
    """Might this node's value hold a float32/16/bf16 tensor? Exact with shapes;
    otherwise everything not known to be non-float might."""
    infos = out_infos(node)
    if infos is not None:
        return any(i.dtype in CASTABLE for i in infos)
    d = decided.get(node)
    if d is None:
        return True
    if d.kind in ("placeholder", "get_attr"):
        return d.out is not None
    if d.rule == Rule.NON_FLOAT:
        return False
    entry = ops.ENTRIES.get(d.op)
    if entry is not None and entry.select and entry.result is Result.NONFLOAT:
        return selects_float(node, entry)
    return not (d.category is Category.PASS and entry is not None and entry.result is Result.NONFLOAT)


def other_float(dtype: Any) -> bool:
    """A float or complex dtype ampfx never converts (float64, complex64, ...): values in it
    pass through :func:`ampfx.runtime.cast` unchanged, so ops on them run as written.

    >>> other_float(torch.float64), other_float(torch.complex64), other_float(torch.float32), other_float(torch.int64)
    (True, True, False, False)
    """
    return isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex) and dtype not in CASTABLE


DYNAMIC = "dynamic"
"""A value whose dtype ampfx knows only at run time (``x.to(y)``, a factory without example inputs)."""


def selects_float(node: fx.Node, entry: ops.OpEntry) -> bool:
    """Does a selection whose result is non-float by default (``getattr``: ``x.shape``) return a
    float tensor here (``torch.topk(x, k).values``)? Shapes say exactly; without them, the
    attribute's name (``OpEntry.float_attrs``).

    >>> g = fx.Graph(); t = g.placeholder("t")
    >>> e = ops.ENTRIES["getattr"]
    >>> selects_float(g.call_function(getattr, (t, "values")), e), selects_float(g.call_function(getattr, (t, "shape")), e)
    (True, False)
    """
    infos = out_infos(node)
    if infos is not None:
        return any(i.dtype in CASTABLE for i in infos)
    return len(node.args) > 1 and node.args[1] in entry.float_attrs


def original_dtype(n: fx.Node) -> torch.dtype:
    """The float dtype ``n`` produced before conversion (float32 when unknown)."""
    infos = out_infos(n)
    floats = [i.dtype for i in infos or () if i.dtype in CASTABLE]
    return floats[0] if floats else torch.float32


def attr_of(gm: fx.GraphModule, target: str) -> Any:
    """The object a ``get_attr`` target names (``"layer1.0.conv1.weight"``)."""
    return operator.attrgetter(target)(gm)


def dtype_like(n: fx.Node, entry: ops.OpEntry) -> bool:
    """Is ``n`` a spelling of ``entry`` whose result takes its first argument's dtype (``OpEntry.dtype_like``)?"""
    target = n.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
        target = f"aten::{packet.__name__}"
    try:
        return target in entry.dtype_like
    except TypeError:  # an unhashable target
        return False


def pass_result(n: fx.Node, d: Decision, out: dict[fx.Node, object]) -> object:
    """The dtype a PASS node (explicit cast, factory, table gather) produces, given ``out``, the dtypes
    of the values before it (:data:`DYNAMIC`: known only at run time)."""
    entry = ops.ENTRIES.get(d.op)
    infos = out_infos(n)
    meta_dtype = None
    if infos is not None:
        floats = [i.dtype for i in infos if i.dtype in CASTABLE]
        meta_dtype = floats[0] if floats else None
        if not floats:
            return None
    kind = entry.result if entry is not None else None
    if d.rule is Rule.NON_FLOAT or kind is Result.NONFLOAT:
        return None
    if kind is Result.FP32:
        return torch.float32
    first = out.get(n.args[0]) if n.args and isinstance(n.args[0], fx.Node) else None
    if kind is Result.CAST:
        spelling = str(n.target)
        fixed = dict(entry.cast_to)  # x.half(): a fixed dtype
        if spelling in fixed:
            return fixed[spelling]
        for a in (*n.args[1:], *n.kwargs.values()):
            if isinstance(a, torch.dtype):
                return a if a in CASTABLE or other_float(a) else None
            if isinstance(a, fx.Node):  # x.type_as(y) takes y's dtype; x.to(y) the dtype y holds
                return out.get(a, DYNAMIC) if spelling in entry.cast_like or out.get(a) in CASTABLE else DYNAMIC
        return first  # .to(device), .cpu(): same dtype
    if entry is not None and dtype_like(n, entry) and "dtype" not in n.kwargs:
        return first if first is not None else DYNAMIC  # zeros_like(x), x.new_zeros(n): x's dtype, as converted
    if meta_dtype is not None and not any(isinstance(a, fx.Node) for a in n.kwargs.values()):
        return meta_dtype  # factories: dtype fixed by constant arguments
    return DYNAMIC


def linear_shaped(node: fx.Node) -> bool:
    """Is ``node`` a function call shaped as ``linear(x, w[, b])``?"""
    return node.op == "call_function" and 2 <= len(node.args) <= 3 and set(node.kwargs) <= {"bias"}


def is_linear_call(node: fx.Node) -> bool:
    """Is ``node`` a weight GEMM FP8 runs (``OpEntry.fp8``) called as a function: ``linear(x, w[, b])``?"""
    name = ops.lookup_name(node.target) if node.op == "call_function" else None
    return name in ops.ENTRIES and ops.ENTRIES[name].fp8 and linear_shaped(node)


def uncast(arg: Any) -> Any:
    """The value an operand reads before the casts ampfx inserted (a padded one too)."""
    while isinstance(arg, fx.Node) and isinstance(record(arg), CastInfo) and arg.args:
        arg = arg.args[0]
    return arg


def operand_shape(arg: Any, gm: fx.GraphModule) -> tuple | None:
    """An operand's sizes before conversion: a parameter's own, or from shape propagation, through the casts ampfx
    inserted (a padded one too); ``None`` where unknown."""
    src = uncast(arg)
    if not isinstance(src, fx.Node):
        return None
    if src.op == "get_attr":
        obj = attr_of(gm, str(src.target))
        return tuple(obj.shape) if isinstance(obj, torch.Tensor) else None
    infos = out_infos(src)
    return tuple(infos[0].shape) if infos else None

"""Reporting only: the dtype ``torch.autocast`` would compute each node in, so that the report can say
where ampfx differs from autocast and why. It decides nothing.

:func:`annotate_autocast`, the pipeline's first step, runs on the captured graph before the passes insert casts. It walks the graph as the
model would run under ``torch.autocast(ctx.device, dtype=ctx.policy.dtype)``: graph inputs, parameters and
buffers keep their dtype (float32 without example inputs); an op autocast lists runs as its list says
(:mod:`ampfx.ops.autocast_lists`: the low dtype, float32, or the widest input); every other op gives what its
inputs give it under type promotion (0-dim tensors do not decide against tensors with dimensions), a
normalisation its data input's dtype, an explicit cast its target. Non-float values get ``None``; what
cannot be known (an opaque user leaf or function, a module kept eager, a recurrent module, an op
whose ATen kernel depends on its arguments) gets :data:`UNKNOWN`, and so do float values computed from it
by unlisted ops. Devices without a table (``mps``...) leave every node at ``None``. :func:`stamp_autocast`, after
the passes, copies the results into ``Decision.autocast``.

Before::

    linear = torch._C._nn.linear(x, w, b)        # x: float32[8, 4]
    softmax = torch.nn.functional.softmax(linear, dim=-1)
    add = softmax + x

After (meta only; on CPU under bfloat16)::

    linear.meta['ampfx_autocast'] == torch.bfloat16     # lower_precision_fp
    softmax.meta['ampfx_autocast'] == torch.bfloat16    # not listed on CPU: follows its input
    add.meta['ampfx_autocast'] == torch.float32         # bfloat16 + float32 promotes
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from .. import ops
from ..ops import autocast_lists
from ..ops.autocast_lists import Cast
from ..meta import AUTOCAST, AUTOCAST_HANDS, RECORD, out_infos, record, user_float32
from ..report.records import Decision, Rule
from .nodes import DYNAMIC, attr_of, op_key, pass_result, selects_float
from .context import PassContext

UNKNOWN = "unknown"
"""``Decision.autocast`` of a node whose dtype under autocast ampfx cannot know."""

_TORCH_RULES = ("torch.", "operator.", "builtins.", "math.", "ampfx.")
"""Qualified names of functions whose dtype rules are torch's (any other function called whole is opaque)."""


def annotate_autocast(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Write ``node.meta[AUTOCAST]`` on every node (see the module docstring)."""
    if ctx.device not in autocast_lists.devices():
        return
    found: dict[fx.Node, Any] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "call_module" and str(node.target) in ctx.kept:
            node.meta[AUTOCAST_HANDS] = _one(found.get(a) for a in tree_leaves((node.args, node.kwargs))
                                             if isinstance(a, fx.Node))
        found[node] = _value(node, gm, ctx, found)
        node.meta[AUTOCAST] = found[node]


def returns_under_autocast(gm: fx.GraphModule, ctx: PassContext) -> Any:
    """Annotate ``gm`` (:func:`annotate_autocast`) and return the one dtype ``torch.autocast`` gives its
    float outputs (:data:`UNKNOWN` where they differ or cannot be known; ``None``: no float output)."""
    annotate_autocast(gm, ctx)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return _one(n.meta.get(AUTOCAST) for n in tree_leaves(output.args) if isinstance(n, fx.Node))


def _one(dtypes: Any) -> Any:
    """The one dtype among ``dtypes`` (``None`` entries aside), :data:`UNKNOWN` if several, ``None`` if none."""
    found = set(dtypes) - {None}
    return found.pop() if len(found) == 1 else (UNKNOWN if found else None)


def stamp_autocast(gm: fx.GraphModule, ctx: PassContext | None = None) -> None:
    """Copy ``node.meta[AUTOCAST]`` into each node's Decision (run after the passes; casts get nothing)."""
    for node in gm.graph.nodes:
        d = record(node)
        if isinstance(d, Decision) and AUTOCAST in node.meta:
            node.meta[RECORD] = dataclasses.replace(d, autocast=node.meta[AUTOCAST])


def _value(node: fx.Node, gm: fx.GraphModule, ctx: PassContext, found: dict[fx.Node, Any]) -> Any:
    """The dtype autocast gives ``node``'s value (``None``: no float data; :data:`UNKNOWN`)."""
    if node.op == "placeholder":  # a kept module's inputs: what autocast would hand them
        infos = out_infos(node)
        own = torch.float32 if infos is None else _first_float(i.dtype for i in infos)
        return ctx.autocast_arrive if own is not None and ctx.autocast_arrive is not None else own
    if node.op == "call_module" and str(node.target) in ctx.kept_ends:  # what its own graph does under autocast
        table = dict(ctx.kept_ends[str(node.target)].autocast)
        handed = node.meta.get(AUTOCAST_HANDS)
        return table.get(handed, UNKNOWN) if handed is not None else next(iter(table.values()), UNKNOWN)
    if node.op == "get_attr":
        val = attr_of(gm, str(node.target))
        return val.dtype if isinstance(val, torch.Tensor) and val.dtype.is_floating_point else None
    infos = out_infos(node)
    if infos is not None and _first_float(i.dtype for i in infos) is None:
        return None
    kind = None if user_float32(node) else _kind(node, gm, ctx)
    if kind == UNKNOWN:
        return UNKNOWN
    return _apply(kind, node, gm, ctx.policy.dtype, found)


def _first_float(dtypes: Any) -> torch.dtype | None:
    return next((d for d in dtypes if d.is_floating_point), None)


def _kind(node: fx.Node, gm: fx.GraphModule, ctx: PassContext) -> Cast | str | None:
    """The autocast list entry ``node`` runs under (``None``: none; :data:`UNKNOWN`: cannot be known)."""
    device, target = ctx.device, node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):  # torch.ops.<ns>.<op>[.<overload>]
        exact = isinstance(target, torch._ops.OpOverload)  # torch.export's: that overload's entry
        packet = target.overloadpacket if exact else target
        if packet._qualified_op_name.split("::")[0] != autocast_lists.ATEN:
            return UNKNOWN  # a custom op: no autocast list names it, its dtype rule is its own
        return autocast_lists.kind_of_aten(device, packet.__name__, target._overloadname if exact else None)
    if node.op == "call_module":
        return UNKNOWN if str(target) in ctx.eager_leaves or str(target) in ctx.kept else _module_kind(gm.get_submodule(str(target)), device)
    if node.op == "call_function" and not ops.qualified_name(target).startswith(_TORCH_RULES):
        return UNKNOWN  # a function of the model's (or another library's) kept whole
    name = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
    canonical = ops.lookup_name(op_key(node, gm))
    if autocast_lists.is_aten(name):  # torch.matmul, F.softmax, x.exp(): the ATen op of the same name
        return _aten_kind(device, name, known=canonical is not None)
    return None if canonical is None else _op_kind(device, canonical)


def _aten_kind(device: str, name: str, known: bool) -> Cast | str | None:
    """The kind of ATen op ``name`` called from Python; a router by the ops it picks. An unlisted composite
    op ampfx has no entry for may run a listed op inside (``chain_matmul`` runs ``mm``): unknown. (Those
    ampfx has an entry for are run under autocast by the tests, which found :data:`DECOMPOSED`.)"""
    routed = autocast_lists.ROUTERS.get(name)
    if routed is not None:
        kinds = {autocast_lists.kind_of_aten(device, r) for r in routed}
        return kinds.pop() if len(kinds) == 1 else UNKNOWN
    kind = autocast_lists.kind_of_aten(device, name)
    if kind is None and not known and autocast_lists.is_composite(name):
        return UNKNOWN
    return kind


def _module_kind(module: torch.nn.Module, device: str) -> Cast | str | None:
    """A leaf module's kind through its canonical op name; a module type torch does not define is opaque."""
    canonical = ops.lookup_name(type(module))
    if canonical is None or not type(module).__module__.startswith("torch."):
        return UNKNOWN
    return _op_kind(device, canonical)


def _op_kind(device: str, canonical: str) -> Cast | str | None:
    if canonical in autocast_lists.COMPOSITE:
        return UNKNOWN
    kind = autocast_lists.kind_of_op(device, canonical)
    return UNKNOWN if kind == autocast_lists.AMBIGUOUS else kind


def _inputs(node: fx.Node, gm: fx.GraphModule, found: dict[fx.Node, Any]) -> list[tuple[Any, bool]]:
    """``(dtype under autocast, is 0-dim)`` of each tensor input, a leaf module's own tensors last."""
    out = []
    for a in tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node):
            out.append((found.get(a), _zero_dim(a, gm)))
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        out += [(t.dtype, t.dim() == 0) for t in (*module.parameters(), *module.buffers())]
    return out


def _zero_dim(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Is ``node``'s value a 0-dim tensor? Shapes say; without them, a parameter or buffer's own tensor does."""
    infos = out_infos(node)
    if infos is not None:
        return bool(infos) and len(infos[0].shape) == 0
    val = attr_of(gm, str(node.target)) if node.op == "get_attr" else None
    return isinstance(val, torch.Tensor) and val.dim() == 0


def _apply(kind: Cast | None, node: fx.Node, gm: fx.GraphModule, low: torch.dtype,
           found: dict[fx.Node, Any]) -> Any:
    """What ``kind`` does to the node's inputs, then :func:`_natural` on what it hands the op."""
    inputs = _inputs(node, gm, found)
    eligible = [d for d, _ in inputs if _eligible(d)]
    unknown = any(d == UNKNOWN for d, _ in inputs)
    explicit = _explicit_dtype(node)
    if kind is Cast.LOWER and (eligible or unknown):
        return low
    if kind in (Cast.FP32_SET_OPT_DTYPE, Cast.FP32_APPEND_DTYPE):
        first = inputs[0][0] if inputs else None
        if _eligible(first) or first == UNKNOWN:
            return explicit if isinstance(explicit, torch.dtype) else torch.float32
    if kind is Cast.FP32 and (eligible or unknown):
        inputs = [(torch.float32 if _eligible(d) or d == UNKNOWN else d, z) for d, z in inputs]
    if kind is Cast.PROMOTE and eligible and not unknown:
        widest = functools.reduce(torch.promote_types, eligible)
        inputs = [(widest if _eligible(d) else d, z) for d, z in inputs]
    return _natural(node, gm, inputs, found)


def _explicit_dtype(node: fx.Node) -> Any:
    """The ``dtype`` argument of a call, by keyword or, for an ATen overload (torch.export's graphs pass
    ``aten.softmax.int(x, -1, torch.float32)``), by its position in the op's schema."""
    if "dtype" in node.kwargs or not isinstance(node.target, torch._ops.OpOverload):
        return node.kwargs.get("dtype")
    names = [a.name for a in node.target._schema.arguments]
    return node.args[names.index("dtype")] if "dtype" in names[:len(node.args)] else None


def _eligible(d: Any) -> bool:
    """Does autocast cast a tensor of dtype ``d`` (a float dtype other than float64)?"""
    return isinstance(d, torch.dtype) and d.is_floating_point and d != torch.float64


def _natural(node: fx.Node, gm: fx.GraphModule, inputs: list[tuple[Any, bool]], found: dict[fx.Node, Any]) -> Any:
    """The dtype the op gives the dtypes it is handed, as it does outside autocast."""
    explicit = _explicit_dtype(node)
    if isinstance(explicit, torch.dtype):
        return explicit if explicit.is_floating_point else None
    name = ops.lookup_name(op_key(node, gm)) if node.op != "call_module" else ops.lookup_name(
        type(gm.get_submodule(str(node.target))))
    entry = ops.ENTRIES.get(name) if name is not None else None
    first = found.get(node.args[0]) if node.args and isinstance(node.args[0], fx.Node) else None
    if entry is not None and entry.select:  # x[i], topk(...).values: keeps the container's dtype
        if _later_output(node, gm):
            return UNKNOWN
        return first if entry.result is not ops.Result.NONFLOAT or selects_float(node, entry) else None
    if entry is not None and entry.category is ops.Category.PASS:
        got = pass_result(node, types.SimpleNamespace(op=name, rule=Rule.TABLE), found)
        return UNKNOWN if got == DYNAMIC else got
    floats = [(d, z) for d, z in inputs if d == UNKNOWN or (isinstance(d, torch.dtype) and d.is_floating_point)]
    if entry is not None and entry.fp32_args and floats:  # mixed-dtype norms: the data input's dtype
        return floats[0][0]
    if any(d == UNKNOWN for d, _ in floats):
        return UNKNOWN
    if not floats:
        infos = out_infos(node)
        return _first_float(i.dtype for i in infos) if infos else None
    return promoted([d for d, z in floats if not z] or [d for d, _ in floats])


def _later_output(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Is ``node`` an output other than the first of an op whose first output alone autocast's
    dtype is known for (``attn(q, k, v)[1]``, the attention weights)?"""
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node) or source.op not in ("call_function", "call_method", "call_module"):
        return False
    return ops.lookup_name(op_key(source, gm)) in autocast_lists.FIRST_OUTPUT and node.args[1:2] != (0,)


def promoted(dtypes: list[torch.dtype]) -> torch.dtype:
    """PyTorch's type promotion of float tensors of one dimension category.

    >>> promoted([torch.bfloat16, torch.float32]), promoted([torch.float16, torch.bfloat16])
    (torch.float32, torch.float32)
    """
    return functools.reduce(torch.promote_types, dtypes)

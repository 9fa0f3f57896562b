"""Pass: insert the casts the decisions call for. Reads ``node.meta['ampfx']``
and rewrites; decides nothing new.

- one cast per (value, dtype), shared by every consumer that needs it, placed
  before the first of them; never a cast of a cast (casts are always of the
  original value);
- parameters are never changed: they are cast after ``get_attr``, so the
  optimizer keeps updating float32 masters;
- ops with their own accumulation-dtype argument get it instead of a cast
  (``softmax(x, dim, dtype=torch.float32)``);
- slots the tables pin to float32 (batch-norm statistics, affine
  parameters) and integer slots are not cast to the low dtype;
- an ALLOW leaf module runs through :func:`ampfx.runtime.call_module_low`
  with low-precision copies of its parameters (another library's leaf through
  that library's runner, e.g. :func:`ampfx.libraries.dgl.call_dgl_low`);
- in-place ops get no casts (a cast copy would take the mutation);
- a low-precision ``linear`` whose consumers all want float32 leaves its bias
  out and adds it after the float32 cast (``Decision.bias_after``, decided by
  :mod:`ampfx.passes.writes`): the bias is never cast (two casts fewer per
  step, forward and backward) and is added in float32;
- a float32 op that writes the low dtype (``cost:write-low``) reads its low
  input as it is, and a float32 copy left out (``cost:no-float32-copy``) becomes
  ``runtime.cast(x, low)``, which returns ``x`` (both decided by
  :mod:`ampfx.passes.writes`);
- graph outputs return in the dtype they had before conversion.

Before (a bfloat16 ``linear`` whose one consumer, a softmax, computes in float32)::

    linear = torch._C._nn.linear(x, fc_weight, fc_bias)
    softmax = torch.nn.functional.softmax(linear, dim=-1)

After (the bias is split off and added in float32 after the output's cast)::

    x_bf16 = ampfx_runtime_cast(x, torch.bfloat16)
    fc_weight_bf16 = ampfx_runtime_cast(fc_weight, torch.bfloat16)
    linear = torch._C._nn.linear(x_bf16, fc_weight_bf16)
    linear_fp32 = ampfx_runtime_cast(linear, torch.float32)
    linear_bias = linear_fp32 + fc_bias
    softmax = torch.nn.functional.softmax(linear_bias, dim=-1, dtype=None)

A softmax of a low value that is not split off this way reads it with
``dtype=torch.float32`` instead of a cast.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from .. import libraries, ops, runtime
from ..meta import LEAF_PARAM_CASTS, RECORD, decision, record
from ..ops import Category
from ..report.records import COMPUTE, CastInfo, Decision, Rule, dtype_name
from ..runtime import CASTABLE
from .context import PassContext
from .nodes import attr_of, original_dtype, view_group, written
from .cast_model import accumulates, fp32_slot_inputs, out_of, promoted_inputs, slot_dtype


class _Casts:
    """The cast cache: (value, dtype, mutation epoch) -> cast node."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self.cache: dict[tuple[fx.Node, torch.dtype, int], fx.Node] = {}
        self.fixed: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}  # values with a bespoke conversion
        self.epochs: dict[fx.Node, int] = {}  # bumped when a value (or a view of it) is mutated in place

    def mutated(self, node: fx.Node) -> None:
        """``node`` was changed in place: casts of it, of the tensor it views and
        of that tensor's other views made before now are not reused after."""
        for n in view_group(node, _is_view):
            self.epochs[n] = self.epochs.get(n, 0) + 1

    def get(self, value: fx.Node, dtype: torch.dtype, consumer: fx.Node, why: str) -> fx.Node:
        src = decision(value).out if isinstance(record(value), Decision) else None
        if src is None or src == dtype or (isinstance(src, torch.dtype) and src not in CASTABLE):
            return value  # float64 and complex values pass runtime.cast unchanged: no cast to record
        if (value, dtype) in self.fixed:
            return self.fixed[(value, dtype)]
        is_param = value.op == "get_attr" and isinstance(attr_of(self.gm, str(value.target)), torch.nn.Parameter)
        key = (value, dtype, 0 if is_param else self.epochs.get(value, 0))
        cast = self.cache.get(key)
        if cast is None:
            with self.gm.graph.inserting_before(consumer):
                cast = self.gm.graph.create_node("call_function", runtime.cast, (value, dtype), {},
                                                 name=f"{value.name}_{dtype_name(dtype, short=True)}")
            cast.meta[RECORD] = CastInfo(node=cast.name, value=value.name, source=src, to=dtype, consumers=(),
                                       weight=value.op == "get_attr", reason=why)
            self.cache[key] = cast
        info: CastInfo = decision(cast)
        if consumer.name not in info.consumers:
            cast.meta[RECORD] = dataclasses.replace(info, consumers=info.consumers + (consumer.name,))
        return cast


def _is_view(node: fx.Node) -> bool:
    """May ``node`` share storage with its first argument (``OpEntry.view``)?"""
    d = record(node)
    return (isinstance(d, Decision) and ops.is_view(d.op) and bool(node.args)
            and isinstance(node.args[0], fx.Node))


def _add_bias_after(node: fx.Node, bias: fx.Node, casts: "_Casts") -> None:
    """``linear(x, w)`` -> ``cast(linear(x, w), float32) + bias`` (the ``add`` is ampfx's own node)."""
    graph = casts.gm.graph
    with graph.inserting_after(node):
        y32 = graph.create_node("call_function", runtime.cast, (node, torch.float32), {}, name=f"{node.name}_fp32")
    with graph.inserting_after(y32):
        out = graph.create_node("call_function", operator.add, (y32, bias), {}, name=f"{node.name}_bias")
    d: Decision = decision(node)
    y32.meta[RECORD] = CastInfo(node=y32.name, value=node.name, source=d.dtype, to=torch.float32,
                              consumers=(out.name,), reason="consumers of this linear want float32")
    out.meta[RECORD] = Decision(node=out.name, op="add", target="_operator.add", module=d.module,
                              category=Category.INFER, dtype=torch.float32, rule=Rule.BIAS_FP32, kind="call_function",
                              reason=f"bias of {node.name} added after its float32 cast (the bias is never cast)",
                              out=torch.float32)
    casts.fixed[(node, torch.float32)] = out


def _take_bias(node: fx.Node) -> fx.Node:
    """Take the bias out of a GEMM whose bias is added after its float32 cast (``Decision.bias_after``)."""
    args = list(node.args)
    bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
    node.args = tuple(args[:2])
    node.kwargs = {k: v for k, v in node.kwargs.items() if k != "bias"}
    return bias


def _reads_low(node: fx.Node, entry: ops.OpEntry | None, want: torch.dtype, kwargs: dict, casts: "_Casts") -> int:
    """1 if the float32 ``node`` reads its low first input as it is: accumulating through its own
    ``dtype=`` argument (set in ``kwargs``), or writing the low dtype (rule ``cost:write-low``); else 0."""
    if not accumulates(node, entry, want, out_of, casts.fixed):
        return 0
    if decision(node).rule is not Rule.WRITE_LOW:
        kwargs[entry.accum_dtype] = torch.float32  # the op accumulates and returns float32 itself
    return 1


def _leave_out_copy(node: fx.Node) -> None:
    """The model's float32 copy of a low value that every user reads low (rule ``cost:no-float32-copy``)
    becomes ``runtime.cast(x, low)``, which returns ``x``."""
    d: Decision = decision(node)
    graph = node.graph
    with graph.inserting_after(node):
        new = graph.call_function(runtime.cast, (node.args[0], d.out))
    new.meta = dict(node.meta)
    new.meta[RECORD] = dataclasses.replace(d, node=new.name)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


INSIDE_WORDS = {"buffer": "running statistics", "parameter": "affine parameters", "value": "float32 inputs"}
"""How the report names the float32 tensors in an op's pinned slots (``OpEntry.fp32_args``: the norms')."""


def _fp32_inside(node: fx.Node, entry: ops.OpEntry | None, gm: fx.GraphModule, ctx: PassContext,
                 leaf_params_low: bool) -> tuple[str, ...]:
    """What stays float32 inside a low-precision ``node`` whose entry pins slots to float32
    (the norms): the tensors in its pinned slots
    (or, for a leaf module such as ``nn.BatchNorm2d``, its float32 buffers and, unless it
    runs with low parameter copies, its parameters), and the kernel's accumulation.

    E.g. ``("running statistics: bn.running_mean, bn.running_var", "affine parameters: bn.weight,
    bn.bias", "accumulation")`` for a bfloat16 batch norm.
    """
    if entry is None or not entry.fp32_args:
        return ()
    found: dict[str, list[str]] = {}
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        for name, t in module.named_buffers(recurse=False):
            if t is not None and t.dtype == torch.float32:
                found.setdefault("buffer", []).append(f"{ctx.prefix}{node.target}.{name}")
        for name, t in module.named_parameters(recurse=False):
            if t.dtype == torch.float32 and not leaf_params_low:
                found.setdefault("parameter", []).append(f"{ctx.prefix}{node.target}.{name}")
    for value in fp32_slot_inputs(node, entry) if node.op != "call_module" else ():
        held = attr_of(gm, str(value.target)) if value.op == "get_attr" else None
        kind = ("value" if not isinstance(held, torch.Tensor) else
                "parameter" if isinstance(held, torch.nn.Parameter) else "buffer")
        found.setdefault(kind, []).append(ctx.prefix + str(value.target) if held is not None else value.name)
    parts = [f"{INSIDE_WORDS[k]}: {', '.join(found[k])}" for k in INSIDE_WORDS if k in found]
    return tuple(parts) + (("accumulation",) if entry.fp32_accumulation else ())


def _note_inside(node: fx.Node, entry: ops.OpEntry | None, gm: fx.GraphModule, ctx: PassContext) -> None:
    """Record on a low-precision node what stays float32 inside it (:func:`_fp32_inside`)."""
    d: Decision = decision(node)
    if d.dtype != ctx.policy.dtype:
        return
    inside = _fp32_inside(node, entry, gm, ctx, node.op == "call_module" and d.category is Category.ALLOW)
    if inside:
        node.meta[RECORD] = dataclasses.replace(d, fp32_inside=inside,
                                                reason=f"{d.reason}; float32 inside: {'; '.join(inside)}")


def _map_slot(arg: Any, slot: int | str, node: fx.Node, entry: ops.OpEntry | None, want: torch.dtype,
              casts: _Casts) -> Any:
    dtype = slot_dtype(slot, entry, want)
    if dtype is None:
        return arg
    why = (f"{node.name} pins this slot to float32" if dtype != want
           else f"{node.name} computes in {dtype_name(dtype)}")
    return fx.map_arg(arg, lambda n: casts.get(n, dtype, node, why))


def _cast_into_out(node: fx.Node, dtype: torch.dtype, casts: "_Casts") -> None:
    """An op writing into its ``out=`` tensor computes in that tensor's dtype (``torch.mm`` refuses any
    other; elementwise ops would round to it anyway): its other float inputs are cast to it, the
    tensor it writes never (a cast copy would take the write)."""
    why = f"{node.name} writes a {dtype_name(dtype)} tensor (out=)"
    node.args = fx.map_arg(node.args, lambda n: casts.get(n, dtype, node, why))
    node.kwargs = {k: v if k == "out" else fx.map_arg(v, lambda n: casts.get(n, dtype, node, why))
                   for k, v in node.kwargs.items()}


def _cast_outputs(node: fx.Node, ctx: PassContext, casts: "_Casts") -> None:
    """Outputs return in their original dtype (``keep_output_dtype``); a kept module's float32 outputs
    in the dtype its caller's graph chose for its boundary (``ctx.arrive``)."""
    if ctx.arrive is not None:
        node.args = fx.map_arg(node.args, lambda n: casts.get(
            n, ctx.arrive if original_dtype(n) == torch.float32 else original_dtype(n), node,
            f"a kept module returns {dtype_name(ctx.arrive)} to its caller"))
    elif ctx.keeps_output_dtype:
        node.args = fx.map_arg(node.args, lambda n: casts.get(n, original_dtype(n), node,
                                                              "outputs keep their original dtype"))


def insert_casts(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Rewrite ``gm.graph`` so every op sees its inputs in its decided dtype."""
    graph = gm.graph
    casts = _Casts(gm)
    leaf_params = 0
    for node in list(graph.nodes):
        d = record(node)
        if not isinstance(d, Decision):
            continue
        if d.kind == "output":
            _cast_outputs(node, ctx, casts); continue  # noqa: E702
        if d.kind not in COMPUTE:
            continue
        if d.inplace:
            if "out" in node.kwargs and d.dtype in CASTABLE:  # torch.mm(a, b, out=t) computes in t's dtype
                _cast_into_out(node, d.dtype, casts)
            if isinstance(target := written(node), fx.Node):
                casts.mutated(target)  # casts made before this mutation are not reused after it
            continue
        if d.category is Category.PASS and d.rule is Rule.NO_FLOAT32_COPY:
            _leave_out_copy(node); continue  # noqa: E702 - the model's float32 copy of a low value, read only low
        if d.category is Category.PASS or d.dtype not in CASTABLE or d.rule is Rule.SELECT:
            continue  # None: left as written; float64/complex (rule other-float): runs as written
        entry = ops.ENTRIES.get(d.op)
        want = d.dtype
        split = _take_bias(node) if d.bias_after else None
        args = list(node.args)
        kwargs = dict(node.kwargs)
        start = _reads_low(node, entry, want, kwargs, casts)
        promoted = promoted_inputs(node, entry, want, out_of, casts.fixed)
        for i in range(start, len(args)):
            if args[i] in promoted:
                continue  # the kernel upcasts it (exactly) beside a float32 tensor
            args[i] = _map_slot(args[i], i, node, entry, want, casts)
        for k in list(kwargs):
            if k != (entry.accum_dtype if entry else None):
                kwargs[k] = _map_slot(kwargs[k], k, node, entry, want, casts)
        node.args, node.kwargs = tuple(args), kwargs
        _note_inside(node, entry, gm, ctx)
        if split is not None:
            _add_bias_after(node, split, casts)
        if (node.op == "call_module" and want in (torch.float16, torch.bfloat16) and d.category is Category.ALLOW
                and d.rule is not Rule.KEPT):  # a kept module's call runs its own converted graph
            leaf_params += _run_low(gm, node, d, want)
        elif (node.op == "call_module" and want == torch.float32 and d.rule not in (Rule.KEPT, Rule.EAGER)
              and _owns_float(gm.get_submodule(str(node.target)))):
            _run_float32(graph, node)
    gm.meta[LEAF_PARAM_CASTS] = leaf_params


def _run_low(gm: fx.GraphModule, node: fx.Node, d: Decision, want: torch.dtype) -> int:
    """A low-precision leaf module runs through :func:`ampfx.runtime.call_module_low` (another library's
    leaf: its own runner), with low-precision copies of its parameters; returns how many it has."""
    graph, module = gm.graph, gm.get_submodule(str(node.target))
    run_low = libraries.runner(module) or runtime.call_module_low  # DGL leaves: their own runner
    with graph.inserting_before(node):
        ref = graph.get_attr(str(node.target))
        ref.meta[RECORD] = Decision(node=ref.name, op="module", target=str(node.target), module=d.module,
                                    category=Category.PASS, dtype=None, rule=Rule.STRUCTURE,
                                    reason="the leaf module, run with low-precision parameter copies",
                                    kind="get_attr")
        new = graph.create_node("call_function", run_low, (ref, want, *node.args),
                                dict(node.kwargs), name=f"{node.name}_low")
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return sum(1 for p in module.parameters() if p.dtype in CASTABLE)


def _owns_float(module: torch.nn.Module) -> bool:
    return any(p.dtype in CASTABLE for p in module.parameters())


def _run_float32(graph: fx.Graph, node: fx.Node) -> None:
    """A float32 leaf module with float parameters runs through :func:`ampfx.runtime.call_module_float32`:
    as it is, or with float32 copies of parameters that arrive low (FSDP2's ``MixedPrecisionPolicy``)."""
    with graph.inserting_before(node):
        ref = graph.get_attr(str(node.target))
        ref.meta[RECORD] = dataclasses.replace(record(node), node=ref.name, op="module", kind="get_attr",
                                               category=Category.PASS, dtype=None, rule=Rule.STRUCTURE,
                                               reason="the leaf module, run in float32 (parameters that arrive "
                                                      "low are copied to float32)")
        new = graph.create_node("call_function", runtime.call_module_float32, (ref, *node.args), dict(node.kwargs))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    name = node.name
    graph.erase_node(node)
    new.name = name  # the records name it as before

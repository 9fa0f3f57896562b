"""Pass: FP8 GEMMs where they pay, each GEMM node with its FP8 decision (``fp8=``; no-op without it).

On top of the low-precision plan, every GEMM node (an op of the allow list) gets an
:class:`~ampfx.report.records.Fp8Decision`: which of its three GEMMs run in FP8 (output, input gradient,
weight gradient), by which :class:`~ampfx.report.records.Fp8Rule`, and why. The rules, first match wins:

1. ``fp8:op``: only linear layers (``F.linear``, an inlined ``nn.Linear``, ``aten.linear``) run in FP8;
   products of activations, convolutions, fused attention and leaf modules stay in the low dtype;
2. ``fp8:not-low``: a linear the plan keeps float32 stays float32;
3. ``fp8:module``: inside a module of ``fp8_skip_modules``;
4. ``fp8:shape``: K and N must be multiples of 16 (``torch._scaled_mm``), and known;
5. ``fp8:forced``: inside a module of ``fp8_modules``: FP8 (over the rules below);
6. ``fp8:position``: the model's first or last ``nn.Linear`` (:attr:`~ampfx.policy.Resolved.linear_ends`; none
   where the model has no ``nn.Linear``, and under the compile backend, whose graphs hold parameters, not the
   model's modules);
7. ``fp8:router``: its output reaches a top-k or an arg-max within a few ops (an MoE's router);
8. ``fp8:sensitive``: with ``calibrate=`` batches, its FP8 output differed from its low-dtype output by more than
   ``fp8_error_threshold`` on them (:class:`~ampfx.passes.calibrate.Fp8Stats`; every decision carries what
   calibration saw: the amax of the GEMM's operands, the error, the input's values lost to zero);
9. ``fp8:cost``: on the target device (``fp8_roofline``) quantising costs more than FP8 saves
   (:meth:`ampfx.policy.fp8.Roofline.pays`; M from the example inputs, else taken as large);
10. ``fp8``: FP8.

An FP8 linear calls :func:`ampfx.runtime.fp8.linear_fp8` with the recipe, on the input and bias the plan casts
for it and the weight's float32 master (quantised once, instead of cast to the low dtype first).

Before (``fp8="tensorwise"``, K=N=4096 on the example inputs)::

    w_bf16 = ampfx_runtime_cast(w, torch.bfloat16)
    linear = torch._C._nn.linear(x_bf16, w_bf16, b_bf16)

After::

    linear = ampfx_runtime_fp8_linear_fp8(x_bf16, w, b_bf16, 'tensorwise')

Under delayed scaling the call also reads the layer's amax history, an attribute of the graph module
(``self._ampfx_fp8_amax_linear``, an :class:`~ampfx.runtime.fp8.AmaxHistory`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import sympy
import torch
import torch.fx as fx

from .. import meta, ops, runtime
from ..meta import RECORD, out_infos, record
from ..ops import Category
from ..policy import fp8 as vocabulary
from ..policy.decide import matched_at
from ..report.records import COMPUTE, CastInfo, Decision, Fp8Decision, Fp8Rule, dtype_name
from ..runtime.fp8 import AmaxHistory, linear_fp8
from . import gemm_cost, nodes
from .nodes import operand_shape
from .context import PassContext

MULTIPLE = 16
"""K and N of an FP8 GEMM are multiples of this (``torch._scaled_mm``'s requirement)."""

_HOPS = 4
"""A linear whose output reaches an op that chooses among its entries (``OpEntry.chooses``) within this many ops
is a router."""


def decide_fp8(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Give every GEMM node its FP8 decision and run the FP8 ones through :func:`linear_fp8` (see the module
    docstring); nothing without ``fp8=``."""
    recipe = vocabulary.recipe(ctx.policy.fp8)
    if recipe is None:
        return
    spec = recipe.name if vocabulary.RECIPES.get(recipe.name) == recipe else recipe.spec
    for node in [n for n in gm.graph.nodes if isinstance(record(n), Decision) and n.op in COMPUTE
                 and record(n).op in ops.ENTRIES and ops.ENTRIES[record(n).op].category is Category.ALLOW]:
        d = record(node)
        rule, reason, sizes = _rule(node, d, gm, ctx)
        on = rule in (Fp8Rule.FP8, Fp8Rule.FORCED)
        node.meta[RECORD] = dataclasses.replace(d, fp8=Fp8Decision(
            recipe=recipe.name, rule=rule, reason=reason, output=on, input_grad=on,
            weight_grad=on and not recipe.weight_grad_high_precision, flops=_flops(node, gm, sizes), **_seen(node)))
        if on:
            x, w, b = (list(node.args) + [node.kwargs.get("bias")])[:3]
            node.target, node.args, node.kwargs = linear_fp8, (x, _master(w), b, spec, *_history(gm, node, recipe)), {}
            _drop_unused_cast(gm, w)


def _history(gm: fx.GraphModule, node: fx.Node, recipe: vocabulary.Recipe) -> tuple[fx.Node, ...]:
    """Under delayed scaling (``Recipe.amax_history``), the node reading the layer's
    :class:`~ampfx.runtime.fp8.AmaxHistory`, an attribute of the graph module made here; nothing otherwise."""
    if not recipe.amax_history:
        return ()
    name = f"_ampfx_fp8_amax_{node.name}"
    setattr(gm, name, AmaxHistory(recipe.amax_history))
    with gm.graph.inserting_before(node):  # (Graph.get_attr warns of an attribute that is no module or tensor)
        return (gm.graph.create_node("get_attr", name),)


def _seen(node: fx.Node) -> dict[str, float | None]:
    """What calibration saw of the node's GEMM (:class:`~ampfx.passes.calibrate.Fp8Stats`, the largest output
    gradient from its :class:`~ampfx.passes.calibrate.Stats`), as :class:`Fp8Decision` fields; none without it."""
    seen = meta.fp8_calib(node)
    if seen is None:
        return {}
    grads = meta.calib(node)
    return {"amax_input": seen.amax_input, "amax_weight": seen.amax_weight, "error": seen.error,
            "underflow": seen.underflow, "saturated": seen.saturated,
            "amax_grad": grads.max_grad if grads is not None else None}


def _master(weight: Any) -> Any:
    """The weight an FP8 linear quantises: the float32 master where the plan casts a weight for it (one rounding,
    to FP8, instead of two), else what the plan reads."""
    info = record(weight) if isinstance(weight, fx.Node) else None
    if isinstance(info, CastInfo) and info.weight and weight.target is runtime.cast:
        return weight.args[0]
    return weight


def _drop_unused_cast(gm: fx.GraphModule, weight: Any) -> None:
    """A weight's cast no FP8 linear reads any more: gone when nothing reads it, else its record names the readers
    left."""
    info = record(weight) if isinstance(weight, fx.Node) else None
    if not (isinstance(info, CastInfo) and weight.target is runtime.cast):
        return
    if not weight.users:
        gm.graph.erase_node(weight)
    else:
        weight.meta[RECORD] = dataclasses.replace(info, consumers=tuple(u.name for u in weight.users))


def _rule(node: fx.Node, d: Decision, gm: fx.GraphModule, ctx: PassContext) -> tuple[Fp8Rule, str, dict]:
    """The rule, its reason and the GEMM's sizes (``{"M": .., "N": .., "K": ..}``, ``None`` where unknown)."""
    sizes = _sizes(node, gm)
    if not _is_linear(node, d):
        return Fp8Rule.OP, f"{d.op}: FP8 runs linear layers only", sizes
    if d.dtype != ctx.policy.dtype:
        return Fp8Rule.NOT_LOW, f"computes in {str(d.dtype).replace('torch.', '')} ({d.rule})", sizes
    skipped = matched_at(ctx.resolved.fp8_skipped, d.module)
    if skipped:
        return Fp8Rule.SKIPPED, f"{d.module}: {skipped[1]}", sizes
    k, n = sizes["K"], sizes["N"]
    if k is None or n is None:
        return Fp8Rule.SHAPE, "K or N unknown: the FP8 kernel needs multiples of 16", sizes
    if k % MULTIPLE or n % MULTIPLE:
        return Fp8Rule.SHAPE, f"K={k}, N={n}: the FP8 kernel needs multiples of {MULTIPLE}", sizes
    forced = matched_at(ctx.resolved.fp8_forced, d.module)
    if forced:
        return Fp8Rule.FORCED, f"{d.module}: {forced[1]}", sizes
    if d.module in (ctx.resolved.linear_ends or ()):
        which = "first" if d.module == ctx.resolved.linear_ends[0] else "last"
        return Fp8Rule.POSITION, f"{d.module} is the model's {which} linear layer", sizes
    route = _routes(node)
    if route is not None:
        return Fp8Rule.ROUTER, f"its output reaches {route}: it chooses experts", sizes
    seen, threshold = meta.fp8_calib(node), ctx.policy.fp8_error_threshold
    if seen is not None and threshold and seen.error > threshold:
        return Fp8Rule.SENSITIVE, (f"its FP8 output differed from its {dtype_name(d.dtype)} output by {seen.error:.3g} "
                                   f"(relative) on the calibration batches, over fp8_error_threshold {threshold:g}"
                                   + (f" ({seen.underflow:.0%} of its input's values quantise to zero)"
                                      if seen.underflow >= 0.01 else "")), sizes
    roofline = vocabulary.roofline(ctx.policy.fp8_roofline)
    if roofline is not None:
        pays, why = roofline.pays(sizes["M"], n)
        if not pays:
            return Fp8Rule.COST, why, sizes
        return Fp8Rule.FP8, why, sizes
    return Fp8Rule.FP8, f"K={k}, N={n}: fp8_roofline='none' (every size)", sizes


def _is_linear(node: fx.Node, d: Decision) -> bool:
    """A weight GEMM FP8 runs (``OpEntry.fp8``) as a function of the graph: ``linear(x, w[, b])``."""
    return ops.ENTRIES[d.op].fp8 and nodes.linear_shaped(node)


def _routes(node: fx.Node) -> str | None:
    """The op a few hops after ``node``, before any other GEMM, that chooses among its outputs (``topk``), else
    ``None``."""
    frontier, seen = [node], {node}
    for _ in range(_HOPS):
        nxt = []
        for n in frontier:
            for user in n.users:
                d = record(user)
                entry = ops.ENTRIES.get(d.op) if isinstance(d, Decision) else None
                if entry is not None and entry.chooses:
                    return d.op
                if entry is not None and entry.category is Category.ALLOW:
                    continue  # past another GEMM: its choice, not this one's
                if user not in seen:
                    seen.add(user)
                    nxt.append(user)
        frontier = nxt
    return None


def _int(size: Any) -> int | None:
    """A size as an int, ``None`` where symbolic."""
    if isinstance(size, int):
        return size
    value = sympy.sympify(size)
    return int(value) if value.is_number else None


def _sizes(node: fx.Node, gm: fx.GraphModule) -> dict[str, int | None]:
    """M, N, K of a GEMM node: for a linear from its input and weight, for other matrix products (``OpEntry.gemm``
    layouts) from the first operand (K, its last size) and the output (N, M its other sizes multiplied); ``None``
    where unknown, and for convolutions, attention and einsum (no layout)."""
    if ops.ENTRIES[record(node).op].gemm is None:
        return {"M": None, "N": None, "K": None}
    args = [a for a in node.args if isinstance(a, fx.Node)]
    first = operand_shape(node.args[0], gm) if node.args and isinstance(node.args[0], fx.Node) else None
    out = out_infos(node)
    out_shape = tuple(out[0].shape) if out else None
    layout = ops.ENTRIES[record(node).op].gemm
    if _is_linear(node, record(node)) and len(args) >= 2:
        weight = operand_shape(node.args[1], gm)
        if weight is None or len(weight) != 2:
            return {"M": None, "N": None, "K": None}
        lead = [_int(s) for s in first[:-1]] if first else [None]
        m = math.prod(lead) if None not in lead else None
        return {"M": m, "N": _int(weight[0]), "K": _int(weight[1])}
    operand = _FIRST_OPERAND.get(layout, 0)  # addmm's first operand is the bias
    if operand and len(node.args) > operand and isinstance(node.args[operand], fx.Node):
        first = operand_shape(node.args[operand], gm)
    if not first or not out_shape:
        return {"M": None, "N": None, "K": None}
    dims = [_int(s) for s in out_shape]
    k, n = _int(first[-1]), dims[-1]
    m = math.prod(dims[:-1]) if None not in dims[:-1] else None
    return {"M": m, "N": n, "K": k}


_FIRST_OPERAND = {"addmm": 1}
"""Where a GEMM layout (``OpEntry.gemm``) has its first multiplied operand, where it is not the first argument."""


def _flops(node: fx.Node, gm: fx.GraphModule, sizes: dict[str, int | None]) -> int | None:
    """The forward GEMM's floating-point operations (``2 M N K``) as the one counter counts them
    (:func:`ampfx.passes.gemm_cost.flops`), for matrix products (those with sizes); ``None`` where a size is unknown
    or symbolic."""
    if None in (sizes["M"], sizes["N"], sizes["K"]):
        return None
    count = gemm_cost.flops(node, gm)
    return _int(count) if count is not None else None

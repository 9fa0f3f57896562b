"""Pass: decide reductions by how many elements they reduce.

A sum of many values risks float16's range (max 65504) and loses low bits;
a sum of a few does not. For the ops whose table entry is a ``reduction``
(``sum, mean, var, std, norm, prod, cumsum, logsumexp``) still decided by the
op table (a list edit or a module rule wins over this pass), with ``N`` the
number of elements reduced into each output:

- ``N <= policy.reduction_threshold``: INFER, it follows its inputs;
- ``N > threshold``: DENY, float32 accumulation and output (the op's own
  ``dtype=`` argument where it has one). Under bfloat16, ops whose entry has
  ``fp32_accumulation`` (``sum`` and ``mean``) stay INFER (bfloat16 has
  float32's range and the kernel accumulates in float32), and the record says so;
- ``N`` unknown (no ``example_inputs``, or a symbolic size whose range
  straddles the threshold): DENY with the reason "size unknown";
- a reduction that would follow its inputs but has no kernel in the low dtype on
  the device (``torch.cdist`` in bfloat16 on CPU; tried on its own arguments'
  shapes, shrunk: :func:`ampfx.ops.probes.missing_kernel`): DENY, rule ``probe``.

Symbolic sizes are sympy expressions; a bound holds for every value of the
symbol (``s0*512`` with ``s0 >= 2`` is at least 1024).

Before: ``sum_1 = x.sum()``, Decision(category=DENY, rule='table') under fp16, x is float16[8, 16]
After:  Decision(category=INFER, rule='shape:small-reduction',
        reason='sum over 128 elements <= threshold 65,536: follows its inputs')
"""
from __future__ import annotations

import dataclasses
from typing import Any

import sympy
import torch
import torch.fx as fx

from .. import ops
from ..ops import probes
from ..meta import RECORD, numel, out_infos, record
from ..ops import Category
from ..report.records import Decision, Rule
from .context import PassContext


def _fmt(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) else str(n)


def reduced_count(node: fx.Node) -> int | sympy.Expr | None:
    """Elements reduced into each output element, or ``None`` if unknown."""
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    ins = out_infos(src) if src is not None else None
    outs = out_infos(node)
    if not ins or not outs:
        return None
    shape_in = ins[0].shape
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    ratio = sympy.simplify(sympy.sympify(numel(ins[0])) / sympy.sympify(numel(outs[0])))
    if ratio == 1 and isinstance(dim, int) and -len(shape_in) <= dim < len(shape_in):
        ratio = sympy.sympify(shape_in[dim])  # cumsum, normalize: reduce along dim, keep the shape
    if ratio.is_number:
        return int(ratio)
    return ratio


def decide_reductions(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Refine table decisions of reductions by their size (see module docstring)."""
    threshold = ctx.policy.reduction_threshold
    low = ctx.policy.dtype
    for node in gm.graph.nodes:
        d = record(node)
        entry = ops.ENTRIES.get(d.op) if isinstance(d, Decision) else None
        if entry is None or not entry.reduction or d.rule is not Rule.TABLE:
            continue
        if d.category not in (Category.INFER, Category.DENY):
            continue
        n = reduced_count(node) if ctx.has_shapes else None
        what = f"{d.op} over {_fmt(n)} elements"
        if n is None:
            why = "no example_inputs" if not ctx.has_shapes else "shape not known"
            d = dataclasses.replace(d, category=Category.DENY, dtype=torch.float32, rule=Rule.SHAPE_SIZE_UNKNOWN,
                                    reason=f"{d.op}: size unknown ({why}): float32 accumulation and output")
        else:
            lower, upper = ctx.symbols.bounds(n)
            if upper <= threshold:
                d = dataclasses.replace(d, category=Category.INFER, dtype=None, rule=Rule.SHAPE_SMALL_REDUCTION,
                                        reason=f"{what} <= threshold {threshold:,}: follows its inputs")
            elif lower > threshold and low == torch.bfloat16 and entry.fp32_accumulation:
                d = dataclasses.replace(d, category=Category.INFER, dtype=None, rule=Rule.SHAPE_LARGE_REDUCTION,
                                        reason=f"{what} > threshold {threshold:,}, but bfloat16 has float32's range "
                                               "and the kernel accumulates in float32: follows its inputs")
            elif lower > threshold:
                d = dataclasses.replace(d, category=Category.DENY, dtype=torch.float32,
                                        rule=Rule.SHAPE_LARGE_REDUCTION,
                                        reason=f"{what} > threshold {threshold:,}: float32 accumulation"
                                               + (" (float16 max 65504)" if low == torch.float16 else ""))
            else:
                d = dataclasses.replace(d, category=Category.DENY, dtype=torch.float32, rule=Rule.SHAPE_SIZE_UNKNOWN,
                                        reason=f"{what} (between {_fmt(lower)} and {_fmt(upper)}): size unknown "
                                               f"against threshold {threshold:,}: float32 accumulation")
        if d.category is Category.INFER and ctx.policy.probe and (err := probes.missing_kernel(node, low, ctx.device)):
            d = dataclasses.replace(d, category=Category.DENY, dtype=torch.float32, rule=Rule.PROBE,
                                    reason=f"{d.reason.split(': follows')[0]}, but {d.op} has no working "
                                           f"{str(low).replace('torch.', '')} kernel on {ctx.device} (tried on its "
                                           f"own arguments, shrunk: {err}): float32")
        node.meta[RECORD] = d

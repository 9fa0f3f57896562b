"""Pass: keep float32 the GEMMs too small for the low dtype to pay on the device.

A low-precision GEMM is faster than a float32 one only past a size: below it the call's fixed cost (on CPUs,
oneDNN's bfloat16 path costs about 30 us a call where a small float32 GEMM takes a few) and the casts around it
cost more than the arithmetic saved. For each GEMM node the op table puts on the allow list (a list edit or a
module rule wins over this pass) whose forward floating-point operations are known from the example inputs,
with ``F`` those operations and ``T`` the break-even (``Policy.gemm_min_flops``, or the device's:
:func:`ampfx.ops.gemm_cost.threshold`):

- ``F < T``: DENY, float32, rule ``cost:small-gemm``; float32 flows on through the infer and clear ops after it
  as for any float32 node, so a run of small layers has no casts between them;
- ``F >= T``, ``F`` unknown (no ``example_inputs``, a symbolic size whose range reaches ``T``, an op whose
  operations are not counted here: einsum, ``mv``, ``bilinear``), ``T == 0``, or a linear ``fp8_modules`` names
  (FP8 rides on the low dtype): unchanged.

``F`` is counted on the example inputs' sizes and fixed with the plan: give example inputs of the size the model
trains on (a GEMM under the break-even at batch 2 may be far above it at batch 512), or ``dynamic_dims``, under
which a GEMM whose count grows with a dynamic size is never kept float32 by this rule (its range is unbounded).

``F`` counts the forward's multiply-adds twice (:data:`COUNTS`): ``2 * numel(output) * K`` with ``K`` the
contracted size (a linear's or a product's last input size, a convolution's input channels per group times its
kernel size; a transposed convolution from its input), attention ``2 * L * S * (E + Ev)`` per batch and head,
``nn.MultiheadAttention`` its projections and attention, a recurrent module (``nn.LSTM``, ``nn.GRU``, a cell)
``2`` times its steps and rows times its weight matrices' sizes.

Before: ``linear = F.linear(x, w, b)`` on x float32[32, 64], w float32[64, 64]: Decision(category=ALLOW,
        rule='table')
After:  Decision(category=DENY, dtype=float32, rule='cost:small-gemm', reason='linear: 262,144 FLOPs a call,
        under 16,777,216, the break-even of bfloat16 GEMMs on cpu: float32 is faster and needs no casts (counted on
        the example inputs' sizes)')
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import sympy
import torch
import torch.fx as fx

from .. import ops
from ..meta import RECORD, numel, out_infos, record
from ..ops import Category, gemm_cost
from ..report.records import Decision, Rule
from .context import PassContext
from ..policy.decide import matched_at
from .nodes import attr_of, operand_shape


def _prod(sizes: Any) -> Any:
    return math.prod(sympy.sympify(s) for s in sizes)


def _arg(node: fx.Node, i: int, *names: str) -> Any:
    """Argument ``i`` of a call, or the first of ``names`` given by keyword."""
    if len(node.args) > i:
        return node.args[i]
    return next((node.kwargs[n] for n in names if n in node.kwargs), None)


def _shape(node: fx.Node, gm: fx.GraphModule, i: int, *names: str) -> tuple | None:
    arg = _arg(node, i, *names)
    return operand_shape(arg, gm) if isinstance(arg, fx.Node) else None


def _module(node: fx.Node, gm: fx.GraphModule) -> Any:
    return attr_of(gm, str(node.target)) if node.op == "call_module" else None


def _weight(node: fx.Node, gm: fx.GraphModule) -> tuple | None:
    """A linear's or convolution's weight sizes: its module's weight, or its second argument."""
    module = _module(node, gm)
    if module is not None:
        weight = getattr(module, "weight", None)
        return tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
    return _shape(node, gm, 1, "weight")


def _linear(node: fx.Node, gm: fx.GraphModule, out: Any) -> Any:
    """``2 * numel(out) * K``, K the weight's in-features (weight[N, K])."""
    w = _weight(node, gm)
    return 2 * sympy.sympify(numel(out)) * w[-1] if w and len(w) == 2 else None


def _conv(node: fx.Node, gm: fx.GraphModule, out: Any, transposed: bool = False) -> Any:
    """A convolution: ``2 * numel(out) * C_in / groups * kernel`` (weight[C_out, C_in / groups, *kernel]); a
    transposed one multiplies each input element by ``C_out / groups * kernel`` (weight[C_in, C_out / groups,
    *kernel]): ``2 * numel(input) * prod(weight[1:])``."""
    w = _weight(node, gm)
    if not w or len(w) < 3:
        return None
    if not transposed:
        return 2 * sympy.sympify(numel(out)) * _prod(w[1:])
    x = _shape(node, gm, 0, "input")
    return 2 * _prod(x) * _prod(w[1:]) if x else None


def _convolution(node: fx.Node, gm: fx.GraphModule, out: Any) -> Any:
    """ATen's ``convolution(input, weight, bias, stride, padding, dilation, transposed, ...)``."""
    transposed = _arg(node, 6, "transposed")
    return _conv(node, gm, out, transposed) if isinstance(transposed, bool) else None


def _product(first: int, *names: str) -> Any:
    """A matrix product whose first multiplied operand is argument ``first`` (``names`` by keyword):
    ``2 * numel(out) * K``, K that operand's last size."""
    def count(node: fx.Node, gm: fx.GraphModule, out: Any) -> Any:
        if node.op == "call_module":
            return None
        a = _shape(node, gm, first, *names)
        return 2 * sympy.sympify(numel(out)) * a[-1] if a else None
    return count


def _attention(node: fx.Node, gm: fx.GraphModule, out: Any) -> Any:
    """``scaled_dot_product_attention(query, key, value)``: ``2 * L * S * (E + Ev)`` per batch and head."""
    if node.op == "call_module":
        return None
    q, k, v = (_shape(node, gm, i, name) for i, name in enumerate(("query", "key", "value")))
    if not (q and k and v and len(k) >= 2):
        return None
    return 2 * _prod(q[:-1]) * k[-2] * (sympy.sympify(q[-1]) + v[-1])


def _attention_module(node: fx.Node, gm: fx.GraphModule, out: Any) -> Any:
    """``nn.MultiheadAttention(query, key, value)``: its projections (each weight once per token it reads) and
    the two products of attention (``2 * 2 * L * S * E`` per batch)."""
    module = _module(node, gm)
    e = getattr(module, "embed_dim", None)
    q, k, v = (_shape(node, gm, i, name) for i, name in enumerate(("query", "key", "value")))
    if not isinstance(e, int) or not (q and k and v) or q[-1] != e:
        return None
    first = bool(getattr(module, "batch_first", False)) and len(k) == 3
    s = k[1] if first else k[0]
    rows = {name: _prod(shape[:-1]) for name, shape in (("q", q), ("k", k), ("v", v))}
    out_w = module.out_proj.weight.numel()
    if getattr(module, "in_proj_weight", None) is not None:
        projections = rows["q"] * e * e + rows["k"] * e * e + rows["v"] * e * e
    else:
        projections = (rows["q"] * module.q_proj_weight.numel() + rows["k"] * module.k_proj_weight.numel()
                       + rows["v"] * module.v_proj_weight.numel())
    return 2 * (projections + rows["q"] * out_w) + 4 * rows["q"] * s * e


def _recurrent(node: fx.Node, gm: fx.GraphModule, out: Any) -> Any:
    """A recurrent module (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``, a cell): ``2 * steps * rows * sum(numel(W))`` over
    its input-to-hidden, hidden-to-hidden and projection matrices (every layer and direction), steps times rows
    being its input's size without the feature dimension."""
    module = _module(node, gm)
    x = _shape(node, gm, 0, "input")
    size = getattr(module, "input_size", None)
    if module is None or not x or not isinstance(size, int) or x[-1] != size:
        return None
    weights = sum(p.numel() for name, p in module.named_parameters(recurse=False)
                  if name.startswith(("weight_ih", "weight_hh", "weight_hr")))
    return 2 * _prod(x[:-1]) * weights if weights else None


COUNTS = {"linear": _linear, "matmul": _product(0, "input"), "addmm": _product(1, "mat1", "batch1"), "conv": _conv,
          "conv_transpose": lambda node, gm, out: _conv(node, gm, out, transposed=True),
          "convolution": _convolution, "attention": _attention, "attention_module": _attention_module,
          "rnn": _recurrent}
"""How a GEMM node's forward operations are counted, by its op's layout (``OpEntry.gemm``, else
``OpEntry.flops``): each ``count(node, gm, out)``, ``out`` the metadata of its first output."""


def flops(node: fx.Node, gm: fx.GraphModule) -> Any:
    """The forward floating-point operations of a GEMM node (an int or a sympy expression), ``None`` where
    unknown (see the module docstring)."""
    entry = ops.ENTRIES[record(node).op]
    count = COUNTS.get(entry.gemm or entry.flops)
    out = out_infos(node)
    return count(node, gm, out[0]) if count is not None and out else None


def keep_small_gemms(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Keep float32 the GEMM nodes below the device's break-even (see the module docstring)."""
    threshold, where = gemm_cost.threshold(ctx.policy.gemm_min_flops, ctx.device, ctx.policy.fp8)
    if not threshold or not ctx.has_shapes:
        return
    low = str(ctx.policy.dtype).replace("torch.", "")
    for node in gm.graph.nodes:
        d = record(node)
        if not (isinstance(d, Decision) and d.category is Category.ALLOW and d.rule is Rule.TABLE):
            continue
        if node.op not in ("call_function", "call_method", "call_module") or d.op not in ops.ENTRIES:
            continue
        if matched_at(ctx.resolved.fp8_forced, d.module):
            continue  # fp8_modules asks for FP8 here, which rides on the low dtype
        f = flops(node, gm)
        if f is None:
            continue
        upper = ctx.symbols.bounds(sympy.sympify(f))[1]
        if upper >= threshold:
            continue
        count = f"{int(f):,}" if sympy.sympify(f).is_number else f"{f} (at most {int(upper):,})"
        node.meta[RECORD] = dataclasses.replace(
            d, category=Category.DENY, dtype=torch.float32, rule=Rule.COST_SMALL_GEMM,
            reason=f"{d.op}: {count} FLOPs a call, under {threshold:,}, the break-even of {low} GEMMs {where}: "
                   "float32 is faster and needs no casts (counted on the example inputs' sizes)")

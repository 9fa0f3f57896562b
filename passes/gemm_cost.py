"""Pass: keep float32 the GEMMs too small for the low dtype to pay on the device.

A low-precision GEMM is faster than a float32 one only past a size. Two costs come first: the call's own (on
CPUs, oneDNN's bfloat16 call costs about 30 us where a small float32 GEMM takes a few), and casting its weight,
forward and back, which the arithmetic saved repays only when the weight is used for enough rows. For each GEMM
node the op table puts on the allow list (a list edit or a module rule wins over this pass) whose work is known
from the example inputs (:func:`work`: ``F`` forward operations, ``W`` weight elements cast), against the
break-even ``(T, R)`` (``Policy.gemm_min_flops``, ``Policy.gemm_min_rows``, else the device's:
:func:`ampfx.ops.device_cost.limits`):

- ``F < T``, or a weight used for fewer rows than ``R`` (``F / 2W < R``): DENY, float32, rule
  ``cost:small-gemm``, the reason says which; float32 flows on through the infer and clear ops after it as for
  any float32 node, so a run of small layers has no casts between them;
- a convolution against the convolutions' break-even (measured on their own sizes, where the table has them);
- a GEMM kept float32 by its size alone that pays against the break-even **between low neighbours** (measured
  where the device's table has it: its input and gradient arriving low, float32 would cast them and its output)
  records so (``node.meta['ampfx_between_low']``: its decision before, its condition there, the reason): painting
  gives it the low dtype back where its neighbours are low (:mod:`ampfx.passes.between_low`);
- where the device's low dtype was measured slower at every size (``BreakEven.never``): every such GEMM node,
  counted or not, DENY, float32, rule ``cost:low-slower``;
- otherwise, where the work is unknown (no ``example_inputs``, an op not counted here: einsum, ``mv``,
  ``bilinear``), where a check's break-even is 0 (none; a given ``gemm_min_flops=0`` turns both off), or for a
  linear ``fp8_modules`` names (FP8 rides on the low dtype): unchanged.

**Sizes.** The work is counted at the example inputs' sizes (symbolic sizes of ``dynamic_dims`` at their
example values), and each node counted records its condition (``node.meta['ampfx_cost_scale']``): the factor of
the example inputs' elements from which it pays, as a GEMM's work grows with the rows it is called on (batch,
tokens, pixels). The graph's call-time guard (:class:`ampfx.runtime.guards.Scale`) plans the graph again for a
call whose inputs cross one of those factors (bucketed by them, each plan kept; within ``reconvert_limit``), so a
model converted on a small batch and trained on a large one gets the large batch's plan.

``F`` counts the forward's multiply-adds twice (:data:`COUNTS`): ``2 * numel(output) * K`` with ``K`` the
contracted size (a linear's or a product's last input size, a convolution's input channels per group times its
kernel size; a transposed convolution from its input), attention ``2 * L * S * (E + Ev)`` per batch and head,
``nn.MultiheadAttention`` its projections and attention, a recurrent module (``nn.LSTM``, ``nn.GRU``, a cell)
``2`` times its rows times its weight matrices' sizes (every step's rows where one fused kernel runs the sequence,
one step's where its GEMMs run a step at a time). ``W`` is the weight's elements (a linear's,
a convolution's, a product's parameter operand's, the attention module's projections', the recurrent matrices');
the rows count only the operations that read the weight (not attention's own products); products of two
activations have no weight and are decided by ``F`` alone.

Before: ``linear = F.linear(x, w, b)`` on x float32[32, 64], w float32[64, 64]: Decision(category=ALLOW,
        rule='table')
After:  Decision(category=DENY, dtype=float32, rule='cost:small-gemm', reason='linear: 262,144 FLOPs a call,
        under 16,777,216, the break-even of bfloat16 GEMMs on cpu (datasheet): float32 is faster and needs no casts
        (counted at the example inputs' sizes; a call with 64x their elements or more is planned again)')
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import sympy
import torch
import torch.fx as fx

from .. import ops
from ..meta import BETWEEN_LOW, COST_SCALE, RECORD, BetweenLow, numel, out_infos, record
from ..ops import Category, device_cost, gemm_cost
from ..policy.decide import matched_at
from ..report.records import Decision, Rule
from .context import PassContext
from .nodes import attr_of, operand_shape, uncast


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


class Work(NamedTuple):
    """What one call of a GEMM node does: its forward's floating-point operations, how many weight elements it
    casts (``None``: no weight, a product of two activations), and of those operations the ones that read the
    weight (``None``: all of them; attention's own products read none)."""

    flops: Any
    weights: Any = None
    weight_flops: Any = None

    @property
    def rows(self) -> Any:
        """How many rows each weight element is used for in one call (``None`` without a weight)."""
        if not self.weights:
            return None
        used = self.flops if self.weight_flops is None else self.weight_flops
        return sympy.cancel(sympy.sympify(used) / (2 * sympy.sympify(self.weights)))


def _linear(node: fx.Node, gm: fx.GraphModule, out: Any) -> Work | None:
    """``2 * numel(out) * K``, K the weight's in-features (weight[N, K])."""
    w = _weight(node, gm)
    return Work(2 * sympy.sympify(numel(out)) * w[-1], _prod(w)) if w and len(w) == 2 else None


def _conv(node: fx.Node, gm: fx.GraphModule, out: Any, transposed: bool = False) -> Work | None:
    """A convolution: ``2 * numel(out) * C_in / groups * kernel`` (weight[C_out, C_in / groups, *kernel]); a
    transposed one multiplies each input element by ``C_out / groups * kernel`` (weight[C_in, C_out / groups,
    *kernel]): ``2 * numel(input) * prod(weight[1:])``."""
    w = _weight(node, gm)
    if not w or len(w) < 3:
        return None
    if not transposed:
        return Work(2 * sympy.sympify(numel(out)) * _prod(w[1:]), _prod(w))
    x = _shape(node, gm, 0, "input")
    return Work(2 * _prod(x) * _prod(w[1:]), _prod(w)) if x else None


def _convolution(node: fx.Node, gm: fx.GraphModule, out: Any) -> Work | None:
    """ATen's ``convolution(input, weight, bias, stride, padding, dilation, transposed, ...)``."""
    transposed = _arg(node, 6, "transposed")
    return _conv(node, gm, out, transposed) if isinstance(transposed, bool) else None


def _parameter(arg: Any, gm: fx.GraphModule) -> Any:
    """The elements of ``arg`` where it is a parameter or buffer the graph reads (through the casts ampfx
    inserted), else ``None``: a product of two activations has no weight."""
    src = uncast(arg)
    if not (isinstance(src, fx.Node) and src.op == "get_attr"):
        return None
    obj = attr_of(gm, str(src.target))
    return obj.numel() if isinstance(obj, torch.Tensor) else None


def _product(first: int, *names: str) -> Any:
    """A matrix product whose first multiplied operand is argument ``first`` (``names`` by keyword, the second
    operand right after it): ``2 * numel(out) * K``, K that operand's last size; its weight, the second operand
    where that is a parameter (``x @ W``, Hugging Face's ``Conv1D``: ``addmm(b, x, W)``)."""
    def count(node: fx.Node, gm: fx.GraphModule, out: Any) -> Work | None:
        if node.op == "call_module":
            return None
        a = _shape(node, gm, first, *names)
        if not a:
            return None
        second = _arg(node, first + 1, "other", "mat2", "batch2")
        return Work(2 * sympy.sympify(numel(out)) * a[-1], _parameter(second, gm))
    return count


def _attention(node: fx.Node, gm: fx.GraphModule, out: Any) -> Work | None:
    """``scaled_dot_product_attention(query, key, value)``: ``2 * L * S * (E + Ev)`` per batch and head; no
    weight."""
    if node.op == "call_module":
        return None
    q, k, v = (_shape(node, gm, i, name) for i, name in enumerate(("query", "key", "value")))
    if not (q and k and v and len(k) >= 2):
        return None
    return Work(2 * _prod(q[:-1]) * k[-2] * (sympy.sympify(q[-1]) + v[-1]))


def _attention_module(node: fx.Node, gm: fx.GraphModule, out: Any) -> Work | None:
    """``nn.MultiheadAttention(query, key, value)``: its projections (each weight once per token it reads) and
    the two products of attention (``2 * 2 * L * S * E`` per batch); its weights, the projections'."""
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
        sizes = (e * e, e * e, e * e)
    else:
        sizes = (module.q_proj_weight.numel(), module.k_proj_weight.numel(), module.v_proj_weight.numel())
    projections = 2 * (rows["q"] * sizes[0] + rows["k"] * sizes[1] + rows["v"] * sizes[2] + rows["q"] * out_w)
    return Work(projections + 4 * rows["q"] * s * e, sum(sizes) + out_w, projections)


def _recurrent(node: fx.Node, gm: fx.GraphModule, out: Any) -> Work | None:
    """A recurrent module (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``, a cell): ``2 * rows * sum(numel(W))`` over its
    input-to-hidden, hidden-to-hidden and projection matrices (every layer and direction). Where one fused kernel
    runs the whole sequence (cuDNN on a GPU; oneDNN's LSTM on a CPU) ``rows`` is every step's batch together;
    elsewhere (a GRU or an RNN on a CPU, a cell) its GEMMs run a step at a time, the hidden state of a step being
    the input of the next, and ``rows`` is **one step's** batch: many small GEMMs do not pay low where one large
    one would."""
    module = _module(node, gm)
    x = _shape(node, gm, 0, "input")
    size = getattr(module, "input_size", None)
    if module is None or not x or not isinstance(size, int) or x[-1] != size:
        return None
    weights = sum(p.numel() for name, p in module.named_parameters(recurse=False)
                  if name.startswith(("weight_ih", "weight_hh", "weight_hr")))
    if not weights:
        return None
    if isinstance(module, torch.nn.RNNBase) and _fused(module):
        rows = _prod(x[:-1])
    elif isinstance(module, torch.nn.RNNBase):  # (steps, batch, features), batch first, or unbatched (steps, features)
        rows = 1 if len(x) == 2 else x[0] if getattr(module, "batch_first", False) else x[1]
    else:  # a cell: (batch, features) or (features,)
        rows = x[0] if len(x) == 2 else 1
    return Work(2 * rows * weights, weights)


def _fused(module: torch.nn.Module) -> bool:
    """Does one kernel run ``module``'s whole sequence: cuDNN on a GPU, oneDNN's LSTM on a CPU (torch's own CPU
    GRU and RNN loop over the steps)?"""
    device = next((p.device.type for p in module.parameters()), "cpu")
    return device == "cuda" or (device == "cpu" and isinstance(module, torch.nn.LSTM)
                                and torch.backends.mkldnn.is_available())


COUNTS = {"linear": _linear, "matmul": _product(0, "input"), "addmm": _product(1, "mat1", "batch1"), "conv": _conv,
          "conv_transpose": lambda node, gm, out: _conv(node, gm, out, transposed=True),
          "convolution": _convolution, "attention": _attention, "attention_module": _attention_module,
          "rnn": _recurrent}
"""How a GEMM node's forward operations are counted, by its op's layout (``OpEntry.gemm``, else
``OpEntry.flops``): each ``count(node, gm, out)``, ``out`` the metadata of its first output."""


def work(node: fx.Node, gm: fx.GraphModule) -> Work | None:
    """What one call of a GEMM node does (its counts ints or sympy expressions), ``None`` where unknown (see the
    module docstring)."""
    entry = ops.ENTRIES[record(node).op]
    count = COUNTS.get(entry.gemm or entry.flops)
    out = out_infos(node)
    return count(node, gm, out[0]) if count is not None and out else None


def flops(node: fx.Node, gm: fx.GraphModule) -> Any:
    """The forward floating-point operations of a GEMM node, ``None`` where unknown."""
    done = work(node, gm)
    return None if done is None else done.flops


def _shown(value: Any, upper: Any) -> str:
    """A count as the reason writes it: the number (rounded to one decimal where not whole), or the expression and
    its value at the example inputs."""
    value = sympy.sympify(value)
    if not value.is_number:
        try:
            return f"{value} (= {_shown(int(upper), upper)} here)"
        except (TypeError, ValueError, OverflowError, AttributeError):  # unbounded (torch's int_oo)
            return str(value)
    return f"{int(value):,}" if value == int(value) else f"{float(value):,.1f}"


def _at(value: Any, ctx: PassContext) -> Any:
    """A count at the example inputs' sizes (symbolic sizes at their example values), else its upper bound over
    every value its symbols may take."""
    at = ctx.symbols.at_example(value)
    return at if at is not None else ctx.symbols.bounds(sympy.sympify(value))[1]


def _need(done: Work, limits: gemm_cost.BreakEven, ctx: PassContext) -> float | None:
    """The factor of the example inputs' elements from which the node pays low (a GEMM's work grows with its
    input's rows: batch, tokens, pixels): ``None`` where its work at the example is unknown or unbounded."""
    try:
        flops = float(_at(done.flops, ctx))
        rows = None if done.rows is None else float(_at(done.rows, ctx))
    except (TypeError, ValueError, OverflowError):  # unbounded (torch's int_oo)
        return None
    if not math.isfinite(flops) or flops <= 0 or (rows is not None and not math.isfinite(rows)):
        return None
    need = limits.flops / flops if limits.flops else 0.0
    if limits.rows and rows:
        need = max(need, limits.rows / rows)
    return need


def _why(d: Decision, done: Work, limits: gemm_cost.BreakEven, ctx: PassContext, where: dict[str, str],
         need: float) -> str | None:
    """Why the node stays float32 (its operations, or the rows its weight is used for, under the break-even at the
    example inputs' sizes), ``None`` where it pays low."""
    if need <= 1:
        return None
    low = str(ctx.policy.dtype).replace("torch.", "")
    again = (f"counted at the example inputs' sizes; a call with {need:.3g}x their elements or more is planned "
             "again")
    flops = _at(done.flops, ctx)
    if limits.flops and flops < limits.flops:
        return (f"{d.op}: {_shown(done.flops, flops)} FLOPs a call, under {limits.flops:,}, the break-even of {low} "
                f"GEMMs {where['flops']}: float32 is faster and needs no casts ({again})")
    rows = _at(done.rows, ctx)
    weights = sympy.sympify(done.weights)
    return (f"{d.op}: each of its {_shown(weights, _at(weights, ctx))} weight elements used for "
            f"{_shown(done.rows, rows)} rows a call, under {limits.rows:,}, the break-even of {low} GEMMs "
            f"{where['rows']}: casting the weight each way costs more than the arithmetic saved, float32 is faster "
            f"({again})")


def limits_of(ctx: PassContext, conv: bool, between_low: bool = False) -> tuple[gemm_cost.BreakEven, dict[str, str]]:
    """The break-even for this conversion (:func:`ampfx.ops.device_cost.limits`), of convolutions or other GEMMs,
    alone or between low neighbours, and where each figure comes from (for reasons)."""
    return device_cost.limits(ctx.policy.gemm_min_flops, ctx.policy.gemm_min_rows, ctx.device, ctx.policy.fp8,
                              ctx.policy.dtype, conv=conv, between_low=between_low)


def is_conv(op: str) -> bool:
    """Is ``op`` (a decision's op) decided by the convolutions' break-even (:data:`CONVOLUTIONS`)?"""
    entry = ops.ENTRIES[op]
    return (entry.gemm or entry.flops) in CONVOLUTIONS


CONVOLUTIONS = ("conv", "conv_transpose", "convolution")
"""The op layouts (``OpEntry.gemm`` / ``OpEntry.flops``) decided by the convolutions' break-even
(:meth:`ampfx.ops.device_cost.Table.break_even`): their kernels pay low from other sizes than a linear layer's."""


def keep_small_gemms(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Keep float32 the GEMM nodes below the device's break-even, and every one where the low dtype never pays
    (see the module docstring); :mod:`ampfx.passes.between_low` then looks again at those between low neighbours."""
    by_kind = {conv: limits_of(ctx, conv) for conv in (False, True)}
    among = {conv: limits_of(ctx, conv, between_low=True) for conv in (False, True)}
    among = {conv: None if among[conv][0] == by_kind[conv][0] else among[conv] for conv in among}
    if all(be == gemm_cost.NONE or not (ctx.has_shapes or be.never) for be, _ in by_kind.values()):
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
        limits, where = by_kind[is_conv(d.op)]
        if limits.never:
            node.meta[RECORD] = dataclasses.replace(
                d, category=Category.DENY, dtype=torch.float32, rule=Rule.COST_LOW_SLOWER,
                reason=f"{d.op}: {low} GEMMs are slower than float32 at every size {where['flops']}: float32 "
                       "(AMPFX_GEMM_MIN_FLOPS=0 lowers them anyway)")
            continue
        if limits == gemm_cost.NONE or not ctx.has_shapes:
            continue
        done = work(node, gm)
        need = _need(done, limits, ctx) if done is not None else None
        if need is None:
            continue
        if need > 0:
            node.meta[COST_SCALE] = need
        why = _why(d, done, limits, ctx, where, need)
        if why is not None:
            node.meta[RECORD] = dataclasses.replace(d, category=Category.DENY, dtype=torch.float32,
                                                    rule=Rule.COST_SMALL_GEMM, reason=why)
            _between_low(node, d, done, among[is_conv(d.op)], ctx)


def _between_low(node: fx.Node, before: Decision, done: Work,
                 among: tuple[gemm_cost.BreakEven, dict[str, str]] | None, ctx: PassContext) -> None:
    """Record whether ``node``, kept float32 by its size alone, pays between low neighbours (``among``: that
    break-even and where it comes from; ``None`` where none was measured apart)."""
    if among is None:
        return
    limits, where = among
    if limits.never:
        return
    need = _need(done, limits, ctx)
    if need is None or _why(before, done, limits, ctx, where, need) is not None:
        return
    said = f"{_shown(done.flops, _at(done.flops, ctx))} FLOPs a call"
    if limits.rows and done.rows is not None:
        said += f", each weight element used for {_shown(done.rows, _at(done.rows, ctx))} rows"
    conv = is_conv(before.op)
    node.meta[BETWEEN_LOW] = BetweenLow(before, need, f"{said}; {device_cost.describe(limits, conv=conv)} "
                                                      f"between low neighbours ({where['flops']})")

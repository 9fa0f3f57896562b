"""Calibration: decide from the values a model actually produces.

:func:`record` runs the traced float32 graph on a few batches, forward and
backward, and stores per node (``node.meta['ampfx_calib']``) the largest
output and output-gradient magnitude and the fraction of nonzero values
below the low dtype's smallest normal and subnormal. It costs a few training
steps, not a search; buffers (batch-norm statistics) are restored after.

:func:`calibrate` (a pass, after ``classify``) then keeps float32 every node
whose output or gradient would overflow the low dtype with the policy's
safety margin: it becomes DENY (rule ``calibration:overflow``), so float32
also flows forward through the infer/clear ops that would carry the large
values. Nodes losing more than 1% of their gradient values to underflow are
flagged in the reason. A node whose rounding alone moved the output or a
parameter gradient by more than ``Policy.sensitivity_threshold`` in
calibration (``node.meta['ampfx_sensitivity']``, written by
:func:`ampfx.passes.sensitivity.record`) becomes DENY float32 too (rule
``calibration:sensitive``). :func:`loss_scale_advice` turns the gradients into the
NVIDIA guide's static loss-scale choice.

Before: ``linear`` Decision(category=ALLOW, rule='table'), calibration saw max |output| 3.1e+05 under fp16
After:  Decision(category=DENY, dtype=float32, rule='calibration:overflow',
        reason='max |output| 3.1e+05 in calibration exceeds float16's 65504 / margin 2: float32')
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

from ..ops import Category
from .. import meta
from ..inputs import ExampleInputs
from ..report.records import Decision, Rule, dtype_name
from ..policy.fp8 import from_spec
from ..runtime import fp8 as fp8_runtime
from ..state import kept_attributes, kept_buffers, kept_rng
from . import nodes
from .context import PassContext

UNDERFLOW_FLAG = 0.01  # flag nodes losing more than this fraction of gradient values to underflow


@dataclass(frozen=True)
class Stats:
    """What calibration saw at one node (maxima over all batches)."""

    max_out: float = 0.0
    max_grad: float = 0.0
    grad_below_subnormal: float = 0.0  # fraction of nonzero gradient values that would flush to zero
    grad_below_normal: float = 0.0
    out_below_subnormal: float = 0.0


def _fractions(t: torch.Tensor, low: torch.dtype) -> tuple[float, float, float]:
    info = torch.finfo(low)
    a = t.detach().abs().float()
    nonzero = a[a > 0]
    if nonzero.numel() == 0:
        return float(a.max()) if a.numel() else 0.0, 0.0, 0.0
    subnormal = info.smallest_normal * info.eps  # the smallest positive subnormal
    return (float(a.max()), float((nonzero < subnormal).float().mean()),
            float((nonzero < info.smallest_normal).float().mean()))


@dataclass(frozen=True)
class Fp8Stats:
    """What calibration saw of a linear layer's GEMM run in FP8 (``fp8=``; maxima over all batches): the largest
    magnitudes of its input and weight, the relative difference of its FP8 output from its output in the low dtype,
    the share of the input's nonzero values that quantise to zero, and under delayed scaling the share of a batch's
    input values past the largest amax of the batches before it (a call with such values is scaled by its own amax
    rather than the history's; 0 under current scaling)."""

    amax_input: float = 0.0
    amax_weight: float = 0.0
    error: float = 0.0
    underflow: float = 0.0
    saturated: float = 0.0


def _fp8_stats(args: tuple, low: torch.dtype, spec: Any) -> dict[str, float] | None:
    """A linear layer's :class:`Fp8Stats` on one batch: ``args`` ``(x, w[, b])`` as the float32 graph holds them,
    ``spec`` the recipe (:func:`ampfx.runtime.fp8.linear_fp8`'s); ``None`` where they are no float tensors."""
    x, w, b = (list(args) + [None])[:3]
    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (x, w)) or x.numel() == 0:
        return None
    with torch.no_grad():
        xl, bl = x.to(low), (b.to(low) if isinstance(b, torch.Tensor) else None)
        want = torch.nn.functional.linear(xl, w.to(low), bl).float()
        got = fp8_runtime.linear_fp8(xl, w, bl, spec).float()
        recipe = from_spec(spec)
        q, _ = fp8_runtime.quantize(xl.reshape(-1, x.shape[-1]).float(), *recipe.scaling("input"))
        nonzero = xl.reshape(-1, x.shape[-1]) != 0
        lost = ((q.float() == 0) & nonzero).sum() / nonzero.sum().clamp(min=1)
        norm = want.norm()
    error = float((got - want).norm() / norm) if norm > 0 else float((got - want).norm())
    return {"amax_input": float(x.detach().abs().max()), "amax_weight": float(w.detach().abs().max()),
            "error": math.inf if math.isnan(error) else error,  # (max() would keep 0.0 over a nan)
            "underflow": float(lost)}


def record(gm: fx.GraphModule, batches: Iterable[Any], loss_fn: Callable[[Any], torch.Tensor] | None,
           low: torch.dtype, fp8: Any = None) -> int:
    """Run ``gm`` (still float32) on ``batches`` forward and backward; fill
    ``node.meta['ampfx_calib']`` and, with an FP8 recipe ``fp8`` (``Policy.fp8``), each linear layer's
    ``node.meta['ampfx_fp8_calib']``. Returns the number of batches seen."""
    acc: dict[fx.Node, dict[str, float]] = {}
    eight: dict[fx.Node, dict[str, float]] = {}
    spec = None if fp8 is None else (fp8 if isinstance(fp8, str) else fp8.spec)
    delayed = spec is not None and bool(from_spec(spec).amax_history)

    def note(node: fx.Node, key: str, value: float, into: dict = acc) -> None:
        into.setdefault(node, {})[key] = max(into.get(node, {}).get(key, 0.0), value)

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            if spec is not None and nodes.is_linear_call(n):
                args = (*self.map_nodes_to_values(n.args, n), self.map_nodes_to_values(n.kwargs, n).get("bias"))[:3]
                before = eight.get(n, {}).get("amax_input")
                for key, value in (_fp8_stats(args, low, spec) or {}).items():
                    note(n, key, value, eight)
                if delayed and before is not None and n in eight:  # past the batches before: scaled by its own amax
                    note(n, "saturated", float((args[0].detach().abs() > before).float().mean()), eight)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    mx, below_sub, _ = _fractions(t, low)
                    note(n, "max_out", mx)
                    note(n, "out_below_subnormal", below_sub)
                    if t.requires_grad:
                        def hook(g: torch.Tensor, n: fx.Node = n) -> None:
                            gmax, gsub, gnorm = _fractions(g, low)
                            note(n, "max_grad", gmax)
                            note(n, "grad_below_subnormal", gsub)
                            note(n, "grad_below_normal", gnorm)
                        t.register_hook(hook)
            return out

    count = 0
    with kept_buffers(gm, grads=True), kept_attributes(gm, bookkeeping=False), \
            kept_rng(*gm.parameters()):  # dropout draws nothing from the caller's
        for batch in batches:
            out = Recorder(gm).run(*ExampleInputs.of(batch).positional(gm))
            loss = loss_fn(out) if loss_fn is not None else default_loss(out)
            if loss.requires_grad:
                loss.backward()
            count += 1
    for node, values in acc.items():
        node.meta[meta.CALIB] = Stats(**values)
    for node, values in eight.items():
        node.meta[meta.FP8_CALIB] = Fp8Stats(**values)
    return count


def default_loss(out: Any) -> torch.Tensor:
    """The model's own output if it is a scalar (a model that returns its loss), else
    the mean of its float outputs (pass ``calibrate_loss`` for realistic gradients)."""
    floats = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len(floats) == 1 and floats[0].numel() == 1:
        return floats[0]
    return sum(t.float().mean() for t in floats)


def calibrate(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Keep float32 the nodes calibration saw overflow the low dtype, or found precision-sensitive
    (see the module docstring)."""
    low = ctx.policy.dtype
    limit = torch.finfo(low).max / ctx.policy.calibration_margin
    name = dtype_name(low)
    for node in gm.graph.nodes:
        d = meta.record(node)
        between = node.meta.get(meta.BETWEEN_LOW)
        if between is not None and isinstance(d, Decision) and d.rule is Rule.COST_SMALL_GEMM:
            # kept float32 by its size, painting may give it the low dtype back: only if calibration allows it
            if _judged(node, between.before, ctx, limit, name).category is Category.DENY:
                del node.meta[meta.BETWEEN_LOW]
            continue
        if not isinstance(d, Decision) or d.category not in (Category.ALLOW, Category.INFER, Category.CLEAR):
            continue
        node.meta[meta.RECORD] = _judged(node, d, ctx, limit, name)


def _judged(node: fx.Node, d: Decision, ctx: PassContext, limit: float, name: str) -> Decision:
    """``d`` (a node free to be low) as calibration leaves it: float32 where its values overflowed ``limit`` or
    rounding it alone moved the model too much, else as it was (flagged where its gradient underflows)."""
    low = ctx.policy.dtype
    s: Stats | None = meta.calib(node)
    if s is None:
        return _sensitive(d, meta.sensitivity(node), ctx.policy.sensitivity_threshold, name)
    flag = ""
    if s.grad_below_subnormal > UNDERFLOW_FLAG:
        flag = (f"; flagged: {s.grad_below_subnormal:.0%} of its gradient values are below {name}'s smallest "
                "subnormal (they flush to zero without loss scaling)")
    worst = max(("output", s.max_out), ("gradient", s.max_grad), key=lambda kv: kv[1])
    if worst[1] > limit:
        return dataclasses.replace(
            d, category=Category.DENY, dtype=torch.float32, rule=Rule.CALIBRATION_OVERFLOW,
            reason=f"max |{worst[0]}| {worst[1]:.3g} in calibration exceeds {name}'s {torch.finfo(low).max:.0f} "
                   f"/ margin {ctx.policy.calibration_margin:g}: float32" + flag)
    d = _sensitive(d, meta.sensitivity(node), ctx.policy.sensitivity_threshold, name)
    return dataclasses.replace(d, reason=d.reason + flag) if flag else d


def _sensitive(d: Decision, errors: Any, threshold: float | None, name: str) -> Decision:
    """``d`` made DENY float32 (rule ``calibration:sensitive``) when rounding the node alone moved
    the model by more than ``threshold`` in calibration (:mod:`ampfx.passes.sensitivity`)."""
    if errors is None or not threshold or errors.score <= threshold:
        return d
    return dataclasses.replace(
        d, category=Category.DENY, dtype=torch.float32, rule=Rule.CALIBRATION_SENSITIVE,
        reason=f"rounding its result alone to {name} in calibration moves the output by {errors.out_err:.3g} and a "
               f"parameter gradient by {errors.grad_err:.3g} (relative), over sensitivity_threshold {threshold:g}: "
               "float32")


def loss_scale_advice(gm: fx.GraphModule, low: torch.dtype) -> str | None:
    """The NVIDIA guide's procedure from the recorded gradients: the largest
    power-of-two static loss scale that keeps every gradient below the dtype's
    maximum, and what underflows without scaling. ``None`` without calibration."""
    stats = [meta.calib(n) for n in gm.graph.nodes if meta.calib(n) is not None]
    if not stats:
        return None
    if low == torch.bfloat16:
        return "loss scaling: not needed for bfloat16 (float32's exponent range); no GradScaler"
    max_grad = max(s.max_grad for s in stats)
    lost = max(s.grad_below_subnormal for s in stats)
    if max_grad == 0:
        return "loss scaling: no gradients seen in calibration"
    scale = 2.0 ** math.floor(math.log2(torch.finfo(low).max / max_grad))
    need = "use torch.amp.GradScaler" if lost > 0 else "no gradient underflowed; GradScaler optional"
    return (f"loss scaling: largest gradient {max_grad:.3g}; up to {lost:.1%} of a node's gradient values flush to "
            f"zero in {dtype_name(low)} without scaling; largest safe static loss scale 2**{int(math.log2(scale))} "
            f"= {scale:g}; {need}")

"""Pass: decide what each painted node writes where that differs from what it computes in. Reads the
painted decisions and records; rewrites nothing (:mod:`ampfx.passes.casts` carries it out).

Three decisions, made in graph order (each may change what a later node's inputs are):

- a low-precision GEMM with a float32 bias (``OpEntry.split_bias``: ``linear``) whose consumers all want
  float32 adds its bias after its float32 cast (``Decision.bias_after``): the bias is never cast, two
  casts fewer a step;
- a float32 ``writes_low`` op (softmax) of a low value whose consumers all read it low writes the low
  dtype (rule ``cost:write-low``): its low kernel computes in float32 inside and rounds once;
- the model's own float32 copy of a low value (``x.float()``) whose users all read it low is left out
  (rule ``cost:no-float32-copy``): they would get the same values back.

Before (decisions)::   linear[bf16] -> softmax[float32] -> linear_1[bf16]
After::                softmax writes bfloat16 (cost:write-low): no cast between it and linear_1

The predicates it shares with painting and the casts pass (what a float32 op reads as it is:
:func:`~ampfx.passes.cast_model.promoted_inputs`, :func:`~ampfx.passes.cast_model.accumulates`) are the cast
model's (:mod:`ampfx.passes.cast_model`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import ops
from ..ops import Category, probes
from ..meta import RECORD, decision, out_infos, record
from ..report.records import COMPUTE, Decision, Rule, dtype_name
from ..runtime import CASTABLE
from .context import PassContext
from .cast_model import accumulates, out_of, promoted_inputs, slot_dtype
from .nodes import original_dtype


def _wants_fp32(node: fx.Node, ctx: PassContext) -> bool:
    """Does every consumer of ``node`` take it in float32?"""
    for user in node.users:
        d = record(user)
        if not isinstance(d, Decision):
            return False
        if d.kind == "output":
            if not ctx.keeps_output_dtype or original_dtype(node) != torch.float32:
                return False
        elif d.dtype != torch.float32 or d.inplace or d.category is Category.PASS or d.rule is Rule.SELECT:
            return False
    return bool(node.users)


def _bias_after(node: fx.Node, ctx: PassContext) -> bool:
    """Is ``node`` a low-precision op with ``OpEntry.split_bias`` (``linear``) whose float32 bias is best
    added after its float32 cast: every consumer takes it in float32 and some would cast it?"""
    args = node.args
    bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
    if not isinstance(bias, fx.Node) or decision(bias).out != torch.float32 or not _wants_fp32(node, ctx):
        return False
    # float32 consumers that read the low output as it is (type promotion) leave no float32 copy to ride on
    return not all(node in promoted_inputs(u, ops.ENTRIES.get(decision(u).op), decision(u).dtype)
                   for u in node.users)


def _read_low_by_all(node: fx.Node, low: torch.dtype) -> bool:
    """Does every user of ``node`` compute in ``low`` and read ``node`` in a slot cast to ``low``?"""
    for user in node.users:
        u = record(user)
        if (not isinstance(u, Decision) or u.kind not in COMPUTE or u.inplace or u.dtype != low
                or u.category is Category.PASS or u.rule is Rule.SELECT):
            return False
        slots = [i for i, a in enumerate(user.args) if a is node] + [k for k, a in user.kwargs.items() if a is node]
        if not slots or any(slot_dtype(s, ops.ENTRIES.get(u.op), low) != low for s in slots):
            return False  # read in float32 (a pinned slot), or from inside a list
    return bool(node.users)


_PLAIN_CAST_KWARGS = {"dtype", "non_blocking", "memory_format", "layout", "copy"}


def _float32_copy_read_low(node: fx.Node, d: Decision, ctx: PassContext) -> bool:
    """The model's own conversion of a low value to float32 (``x.float()``, ``x.to(torch.float32)``, an
    exported ``x.to(query.dtype)`` that the float32 trace fixed at float32) whose users all read it in
    the low dtype: those users would get back exactly the low value, so the copy is left out (the casts
    pass makes the node ``runtime.cast(x, low)``, which returns ``x``), saving a cast each way. Only where
    ``x`` was float32 in the model (with example inputs), where the conversion returned ``x`` itself:
    leaving it out keeps the model's aliasing (an in-place change of ``x`` after it is seen through it, as
    in the model; the float32 copy ampfx made before hid it)."""
    low = ctx.policy.dtype
    entry = ops.ENTRIES.get(d.op)
    if (entry is None or entry.result is not ops.Result.CAST or d.out != torch.float32 or not node.args
            or not isinstance(node.args[0], fx.Node) or out_of(node.args[0]) != low or d.inplace):
        return False
    rest = [a for a in node.args[1:] if a is not None and a is not False]
    fixed = dict(entry.cast_to).get(str(node.target))
    if any(a != torch.float32 for a in rest) or set(node.kwargs) - _PLAIN_CAST_KWARGS or node.kwargs.get("copy"):
        return False  # a device move, another tensor's dtype, or a copy asked for
    if not (fixed == torch.float32 or torch.float32 in (*rest, node.kwargs.get("dtype"))):
        return False
    # a copy in the model too (its source was not float32 there): an in-place change may follow
    return _read_low_by_all(node, low) and [i.dtype for i in out_infos(node.args[0]) or ()][:1] == [torch.float32]


def _writes_low(node: fx.Node, entry: ops.OpEntry, ctx: PassContext) -> bool:
    """Does a float32 ``writes_low`` op (softmax) of a low value whose consumers all read it in that dtype
    write it? Its low kernel computes in float32 inside and rounds once (:func:`ampfx.ops.probes.rounds_once`),
    the value every consumer would have read after a cast."""
    low = out_of(node.args[0])
    if not entry.writes_low or low != ctx.policy.dtype or not _read_low_by_all(node, low):
        return False
    # (probe=False trusts the table: the CPU and CUDA kernels round once)
    return not ctx.policy.probe or probes.rounds_once(decision(node).op, low, ctx.device)


def decide_writes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Record, in graph order, which GEMMs add their bias after the float32 cast (``Decision.bias_after``),
    which float32 ops write the low dtype (``cost:write-low``) and which float32 copies are left out
    (``cost:no-float32-copy``)."""
    low = ctx.policy.dtype
    split: set[tuple[fx.Node, torch.dtype]] = set()
    for node in gm.graph.nodes:
        d = record(node)
        if not isinstance(d, Decision) or d.kind not in COMPUTE or d.inplace:
            continue
        if d.category is Category.PASS:
            if _float32_copy_read_low(node, d, ctx):
                node.meta[RECORD] = dataclasses.replace(
                    d, out=low, rule=Rule.NO_FLOAT32_COPY,
                    reason=f"{d.reason}; a float32 copy of a {dtype_name(low)} value whose users all read it in "
                           f"{dtype_name(low)}: they would get the same values back, so the copy is left out")
            continue
        if d.dtype not in CASTABLE or d.rule is Rule.SELECT:
            continue
        entry = ops.ENTRIES.get(d.op)
        if (entry is not None and entry.split_bias and node.op == "call_function" and d.dtype == low
                and _bias_after(node, ctx)):
            split.add((node, torch.float32))
            node.meta[RECORD] = dataclasses.replace(d, bias_after=True,
                                                    reason=d.reason + "; bias added in float32 after the cast")
        elif accumulates(node, entry, d.dtype, out_of, split) and _writes_low(node, entry, ctx):
            node.meta[RECORD] = dataclasses.replace(
                d, out=low, rule=Rule.WRITE_LOW,
                reason=f"{d.reason}; its {dtype_name(low)} kernel computes in float32 inside and rounds once "
                       f"(probe), and every consumer reads it in {dtype_name(low)}: it writes {dtype_name(low)}, "
                       f"the same values with no cast, and its output is saved for backward at "
                       f"{dtype_name(low)} size (was {d.rule})")

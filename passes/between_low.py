"""Painting's first step: GEMMs kept float32 by their size alone, decided again where they sit between low neighbours.

The device's break-even (:mod:`ampfx.passes.gemm_cost`) is measured on a GEMM **alone**: its low step casts its
input, its output and the gradients. A GEMM whose neighbours run low pays from smaller sizes: there float32 would cast
its input, its output and both gradients, and the low dtype casts only its weight. Where the device's table measured
that (:meth:`ampfx.ops.device_cost.Table.break_even` with ``between_low``), painting (:func:`ampfx.passes.paint.paint`)
first:

1. joins GEMM nodes into **regions** through the infer and clear ops between them (a norm, an activation, an add, a
   view, a concatenation): painting runs such a region low around its low GEMMs, or float32 around its float32
   ones;
2. in each region with a GEMM that runs low (it pays alone, or is low for another reason: a list edit), takes the
   GEMMs kept float32 by their size alone (``cost:small-gemm``) that pay against the break-even between low neighbours
   (:mod:`ampfx.passes.gemm_cost` recorded which, ``node.meta['ampfx_between_low']``);
3. paints the graph with and without them low, and keeps them low where that casts no more activation elements
   (casts of values that are not parameters, counted as :func:`ampfx.passes.cast_model.needed_casts` would insert
   them): a region whose other values stay float32 anyway (a float32 operand, a norm kept float32) gets no
   benefit from them and keeps them float32, with its reason saying so.

A region whose GEMMs are all small stays float32 together, with no casts inside it. Each GEMM given back records
its condition against the break-even between low neighbours (``node.meta['ampfx_cost_scale']``); the region's low
GEMMs that pay by their size record theirs, so a call at sizes where they no longer pay plans the graph again.

Before: conv2d (pays alone) -> batch_norm -> relu -> conv2d_1 Decision(category=DENY, rule='cost:small-gemm')
After:  conv2d_1 Decision(category=ALLOW, rule='table', reason='...; between low neighbours (conv2d runs low ...)')
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch.fx as fx

from .. import ops
from ..meta import BETWEEN_LOW, COST_SCALE, RECORD, BetweenLow, record
from ..ops import Category
from ..report.records import Decision, Rule
from .cast_model import needed_casts, out_of
from .context import PassContext
from .nodes import elements, joined


Paint = Callable[[fx.GraphModule, PassContext], None]

MAX_TRIALS = 16
"""Regions tried one by one (a painting each); past them, the rest are tried together."""


def lower(gm: fx.GraphModule, ctx: PassContext, paint: Paint) -> None:
    """Give the low dtype back to the GEMMs between low neighbours where that pays (see the module docstring);
    ``paint`` paints the graph (painting's other steps), to count each alternative's casts."""
    nodes = list(gm.graph.nodes)
    kept = [n for n in nodes if BETWEEN_LOW in n.meta and isinstance(record(n), Decision)
            and record(n).rule is Rule.COST_SMALL_GEMM]  # (calibration or tuning may have decided it since)
    if not kept:
        return
    root = _regions(nodes)
    seeds: dict[fx.Node, fx.Node] = {}  # a region -> its first low GEMM
    for n in nodes:
        d = record(n)
        if isinstance(d, Decision) and d.category is Category.ALLOW and n in root and _gemm(d.op):
            seeds.setdefault(root[n], n)
    by_region: dict[fx.Node, dict[fx.Node, Decision]] = {}
    for node in kept:
        seed = seeds.get(root.get(node))
        if seed is not None:
            fact: BetweenLow = node.meta[BETWEEN_LOW]
            by_region.setdefault(root[node], {})[node] = dataclasses.replace(fact.before, reason=(
                f"{fact.before.reason}; between low neighbours ({seed.name} runs low, joined to it through infer "
                f"and clear ops): {fact.why}"))
    if not by_region:
        return
    records = {n: n.meta.get(RECORD) for n in nodes}
    base = _painted_casts(gm, ctx, records, paint)
    regions = list(by_region.values())
    if len(regions) > MAX_TRIALS:  # the last ones tried together: a painting per trial
        regions[MAX_TRIALS - 1:] = [{n: d for lowered in regions[MAX_TRIALS - 1:] for n, d in lowered.items()}]
    for lowered in regions:
        trial = {**records, **lowered}
        casts = _painted_casts(gm, ctx, trial, paint)
        if casts <= base:
            records, base = trial, casts
            for n in lowered:
                n.meta[COST_SCALE] = n.meta[BETWEEN_LOW].need
        else:
            for n in lowered:
                d = records[n]
                records[n] = dataclasses.replace(d, reason=(
                    f"{d.reason}; between low neighbours it would pay, but lowering it with its region casts "
                    f"{casts - base:,} more activation elements (a value of the region stays float32): float32"))
    _restore(nodes, records)


def _gemm(op: str) -> bool:
    """Is ``op`` (a decision's op) a GEMM whose work the cost model counts?"""
    entry = ops.ENTRIES.get(op)
    return entry is not None and bool(entry.gemm or entry.flops)


def _regions(nodes: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Each GEMM, infer and clear node's region (a node standing for it): nodes joined through their inputs."""
    def member(n: fx.Node) -> bool:
        d = record(n)
        return n.op != "get_attr" and isinstance(d, Decision) and (
            BETWEEN_LOW in n.meta or d.category in (Category.ALLOW, Category.INFER, Category.CLEAR))
    return joined([n for n in nodes if member(n)])


def _painted_casts(gm: fx.GraphModule, ctx: PassContext, records: dict[fx.Node, Any], paint: Paint) -> int:
    """The activation elements the plan ``records`` casts once painted (values that are not parameters: each
    ``(value, dtype)`` once, as the casts pass inserts them); the records are put back after."""
    nodes = list(gm.graph.nodes)
    _restore(nodes, records)
    paint(gm, ctx)
    casts: set = set()
    for n in nodes:
        d = record(n)
        if isinstance(d, Decision):
            casts |= needed_casts(n, d.dtype, out_of, ctx.keeps_output_dtype)
    _restore(nodes, records)
    return sum(elements(value, ctx.symbols.at_example) for value, _ in casts if value.op != "get_attr")


def _restore(nodes: list[fx.Node], records: dict[fx.Node, Any]) -> None:
    for n in nodes:
        if records.get(n) is None:
            n.meta.pop(RECORD, None)
        else:
            n.meta[RECORD] = records[n]

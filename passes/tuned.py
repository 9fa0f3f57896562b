"""Tuned nodes: the nodes :func:`ampfx.tools.tune` chose to keep float32 compute in float32.

``Policy.tuned`` holds ``(key, reason)`` pairs, a key naming a node across the
whole conversion (:attr:`ampfx.report.records.Decision.key`: ``module:node``, or the
node's name at the root). A node whose key is there and which the passes so
far left free to be low (allow, infer or clear) becomes DENY float32, rule
``tune``, with the reason tuning wrote (the metric before and after), and a GEMM
kept float32 by its size is not given the low dtype back between low neighbours
(:mod:`ampfx.passes.between_low`): as
DENY, float32 also flows forward through the infer/clear ops after it, the
same as for a node calibration keeps float32. A node already float32 for
another reason keeps that reason. A key that names no node of the conversion
is an error raised once the whole model is converted
(:func:`ampfx.policy.decide.check_tuned`): the model changed since it was tuned.

Before: ``add_3`` Decision(category=INFER, rule='table'); Policy(tuned=(("add_3", "metric -0.31 -> -0.12"),))
After:  Decision(category=DENY, dtype=float32, rule='tune', reason='metric -0.31 -> -0.12')
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from .. import meta
from ..ops import Category
from ..report.records import Decision, Rule
from .context import PassContext


def keep_tuned(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Keep float32 the nodes ``ctx.policy.tuned`` names (see the module docstring)."""
    reasons = dict(ctx.policy.tuned)
    if not reasons:
        return
    for node in gm.graph.nodes:
        d = meta.record(node)
        if isinstance(d, Decision) and d.key in reasons:
            node.meta.pop(meta.BETWEEN_LOW, None)  # kept float32 by its size: painting gives it no low dtype back
        if not isinstance(d, Decision) or d.category not in (Category.ALLOW, Category.INFER, Category.CLEAR):
            continue
        reason = reasons.get(d.key)
        if reason is not None:
            node.meta[meta.RECORD] = dataclasses.replace(d, category=Category.DENY, dtype=torch.float32,
                                                         rule=Rule.TUNE, reason=reason)

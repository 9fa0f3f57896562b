"""Graph passes, one per file, each a function ``pass_(gm, ctx) -> None`` that
reads and writes ``node.meta``. Internal: the public entry point is
:func:`ampfx.convert`.

Every step that runs on a captured graph, in order, is listed here: first
:data:`ANALYSES` (facts from running the graph on its example inputs; they
run only with example inputs, calibration batches or a ``sensitivity_threshold``,
see :func:`ampfx.rewrite.analyse`), then :data:`PIPELINE`, and, on the converted graph, :data:`COUNTS`, then, after
the report, :data:`LOWERING`; each step under a
:class:`ampfx.observer.Observer` that times it, logs it, records which step set
each node's :class:`~ampfx.report.records.Decision` (``Decision.history``) and, with
``AMPFX_LOG_PATH``, keeps the graph after it. Then one lint and one recompile.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from . import (autocast, boundary, calibrate, casts, classify, dtype_reads, fp8, gemm_cost, gemms, pad, paint,
               reductions, sensitivity, shapes, transforms, tuned, unpack, writes)
from .context import PassContext

ANALYSES: list[tuple[str, Callable[..., Any]]] = [
    ("propagate_shapes", shapes.propagate),  # dtypes and shapes from the example inputs (fake tensors)
    ("record_calibration", calibrate.record),  # value ranges of the float32 model's calibration batches
    ("find_sensitive", sensitivity.record),  # nodes whose rounding alone moves the output (calibration)
]
"""Analyses, in order: they write facts into ``node.meta``; their arguments differ (inputs, batches)."""

PIPELINE: list[Callable[[fx.GraphModule, PassContext], Any]] = [
    autocast.annotate_autocast,  # what torch.autocast would do, on the graph before casts (reporting only)
    unpack.unpack,  # a tensor unpacked into all its rows: one unbind, as eager Python runs it (needs shapes)
    dtype_reads.fold_dtype_reads,  # x.dtype read by the model's code: the model's dtype, a constant (needs shapes)
    classify.classify,  # category per node from the tables, policy, module names, probes
    reductions.decide_reductions,  # reductions by size: small ones follow their inputs, large ones float32
    gemm_cost.keep_small_gemms,  # GEMMs below the device's break-even for the low dtype: float32 (needs shapes)
    calibrate.calibrate,  # nodes calibration saw overflow the low dtype: float32 (no-op without calibrate=)
    tuned.keep_tuned,  # nodes ampfx.tools.tune kept float32 (Policy.tuned): float32 (no-op without them)
    paint.paint,  # small GEMMs between low neighbours, then TF-AMP painting: final dtype per node, in-place fix-ups
    writes.decide_writes,  # what a node writes where not its dtype: bias after the cast, low writes, copies left out
    casts.insert_casts,  # one cast per (value, dtype), accumulation dtypes, output dtypes
    pad.pad,  # GEMM dimensions to multiples of 8, riding on the casts just inserted
    fp8.decide_fp8,  # with fp8=: each GEMM node's FP8 decision, FP8 linears where they pay (no-op without it)
    autocast.stamp_autocast,  # autocast's dtype copied into each node's Decision
    boundary.cast_part_inputs,  # a part's float inputs cast to the dtypes its graph was converted for
]
"""The passes, in order: each ``pass_(gm, ctx)``."""

DECIDING = PIPELINE[PIPELINE.index(unpack.unpack):PIPELINE.index(paint.paint) + 1]
"""The passes that decide dtypes (up to painting): calibration's precision check runs them on a copy of
the graph to find the nodes that would be low (:func:`ampfx.rewrite.planned_low`)."""

COUNTS: list[tuple[str, Callable[..., Any]]] = [
    ("count_gemms", gemms.count_gemms),  # the ATen GEMMs each converted node runs, low or not (fake tensors)
]
"""Analyses of the converted graph (after :data:`PIPELINE`, with example inputs): facts for the report."""

LOWERING: list[tuple[str, Callable[[fx.GraphModule], Any]]] = [
    ("outline_transforms", transforms.outline_transforms),  # each torch.func level one eager call (torch.compile)
]
"""Rewrites after the report is built (its records keep every node the passes decided): how the converted graph
runs, not what it computes. Each ``step(gm)`` returns whether it changed the graph."""

"""Graph passes, one per file, each a function ``pass_(gm, ctx) -> None`` that
reads and writes ``node.meta``. Internal: the public entry point is
:func:`ampfx.convert`.

The order is :data:`PIPELINE`; shapes (``shapes.propagate``) run before it
when example inputs are given.
"""
from __future__ import annotations

from typing import Any, Callable

import torch.fx as fx

from . import calibrate, casts, classify, pad, paint, reductions, tuned, unpack
from .context import PassContext

PIPELINE: list[Callable[[fx.GraphModule, PassContext], Any]] = [
    unpack.unpack,  # a tensor unpacked into all its rows: one unbind, as eager Python runs it (needs shapes)
    classify.classify,  # category per node from the tables, policy, module names, probes
    reductions.reductions,  # reductions by size: small ones follow their inputs, large ones float32
    calibrate.calibrate,  # nodes calibration saw overflow the low dtype: float32 (no-op without calibrate=)
    tuned.tuned,  # nodes ampfx.tune kept float32 (Policy.tuned): float32 (no-op without them)
    paint.paint,  # TF-AMP painting: final dtype per node, in-place fix-ups
    casts.insert_casts,  # one cast per (value, dtype), accumulation dtypes, output dtypes
    pad.pad,  # GEMM dimensions to multiples of 8, riding on the casts just inserted
]

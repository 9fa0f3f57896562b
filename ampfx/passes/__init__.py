"""Graph passes, one per file, each a function ``pass_(gm, ctx) -> None`` that
reads and writes ``node.meta``. Internal: the public entry point is
:func:`ampfx.convert`.

The order is :data:`PIPELINE`; shapes (``shapes.propagate``) run before it
when example inputs are given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.fx as fx

from ..policy import Policy


@dataclass
class PassContext:
    """What the passes share: the policy and facts about this conversion."""

    policy: Policy
    device: str = "cpu"
    prefix: str = ""  # module path of the converted region inside the user's model
    leaves: dict[str, str] = field(default_factory=dict)  # module path -> why it is a leaf
    regions: set[str] = field(default_factory=set)  # leaves that run eager with converted children
    has_shapes: bool = False
    symbols: Any = None  # shapes.Symbols: symbolic sizes and their ranges
    example_inputs: Any = None  # as given to convert (integrations read values: DGL's overflow guard)


from . import calibrate, casts, classify, pad, paint, reductions  # noqa: E402

PIPELINE: list[Callable[[fx.GraphModule, PassContext], Any]] = [
    classify.classify,  # category per node from the tables, policy, module names, probes
    reductions.reductions,  # reductions by size: small ones follow their inputs, large ones float32
    calibrate.calibrate,  # nodes calibration saw overflow the low dtype: float32 (no-op without calibrate=)
    paint.paint,  # TF-AMP painting: final dtype per node, in-place fix-ups
    casts.insert_casts,  # one cast per (value, dtype), accumulation dtypes, output dtypes
    pad.pad,  # GEMM dimensions to multiples of 8, riding on the casts just inserted
]

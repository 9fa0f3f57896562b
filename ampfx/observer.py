"""Watching the steps of one graph's conversion, without editing them (as inductor's
``GraphTransformObserver`` watches its passes).

:class:`Observer` runs each step of :mod:`ampfx.passes` (the analyses, then the pipeline) on one graph:
it times the step, logs it at DEBUG on ``ampfx.observer``, appends ``(step, rule)`` to the
``Decision.history`` of every node whose decision the step set or changed (so "why float32?" has its
history: which pass decided first, which one overrode it), and, when the report will be saved
(``log_path`` / ``AMPFX_LOG_PATH``), keeps the graph's code after the step for the report to write.

>>> import torch, torch.fx as fx
>>> from ampfx.meta import RECORD
>>> from ampfx.report.records import Decision
>>> gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
>>> def paint_it(gm):
...     for n in gm.graph.nodes:
...         n.meta[RECORD] = Decision(n.name, "linear", "linear", "", "allow", torch.bfloat16, "table", "")
>>> seen = Observer("", keep_code=True)
>>> seen.run("paint", paint_it, gm)
>>> [n.meta[RECORD].history for n in gm.graph.nodes][1], [name for name, _ in seen.steps], len(seen.code)
((('paint', 'table'),), ['paint'], 1)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch.fx as fx

from .meta import RECORD, record
from .report.records import Decision

log = logging.getLogger(__name__)


class Observer:
    """The steps run on the graph at ``where`` (its module path, ``""`` for the model's root): their
    timings (``steps``: (name, seconds)) and, with ``keep_code``, the graph's code after each (``code``).
    ``label`` goes before every step's name (``"dry run: "``: steps run on a copy of the graph)."""

    def __init__(self, where: str, keep_code: bool = False, label: str = "") -> None:
        self.where = where
        self.keep_code = keep_code
        self.label = label
        self.steps: list[tuple[str, float]] = []
        self.code: list[tuple[str, str]] = []

    def run(self, name: str, step: Callable[..., Any], gm: fx.GraphModule, *args: Any) -> Any:
        """``step(gm, *args)``, observed (see the module docstring); returns what the step returns."""
        name = self.label + name
        before = {node: record(node) for node in gm.graph.nodes}
        start = time.perf_counter()
        result = step(gm, *args)
        seconds = time.perf_counter() - start
        changed = 0
        for node in gm.graph.nodes:
            d, old = record(node), before.get(node)
            if not isinstance(d, Decision) or d is old:
                continue
            history = old.history if isinstance(old, Decision) and len(old.history) > len(d.history) else d.history
            if not (isinstance(old, Decision) and (old.rule, old.dtype, old.category) == (d.rule, d.dtype, d.category)):
                history = (*history, (name, d.rule.value))
                changed += 1
            if history != d.history:
                node.meta[RECORD] = dataclasses.replace(d, history=history)
        self.steps.append((name, seconds))
        log.debug("ampfx: %s on %s: %.1f ms, %d decisions set or changed", name, self.where or "<root>",
                  seconds * 1e3, changed)
        if self.keep_code:
            self.code.append((name, gm.graph.python_code("self").src))
        return result

"""``ampfx.sensitivity``: which nodes' low precision moves the model most.

For every node a conversion computes in the low dtype, the measure is how far
rounding that node's result alone to the low dtype (its forward value, and the
gradient flowing back into it) moves the output and the parameter gradients of
an otherwise float32 run (:mod:`ampfx.passes.sensitivity`: groups bisected,
about ``2 k log2(n)`` evaluations for ``k`` sensitive nodes among ``n``).

The float32 run is the converted module's own graph with ampfx's casts made
float32 (a cast to the low dtype returns its input; a leaf run with low
parameter copies gets float32 ones), so nodes are named exactly as in its
report: ``records[i].node`` / ``.module`` are ``ampfx_report`` records' names.

>>> import torch, ampfx
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
>>> s = ampfx.sensitivity(net, torch.randn(8, 4), "bf16", threshold=0.0, top=1)
>>> len(s), s.records[0].node in {r.node for r in s.converted.ampfx_report.low()}
(1, True)
"""
from __future__ import annotations

import datetime
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_map

from .. import libraries, runtime
from ..api import convert
from ..errors import ArgumentError
from ..runtime.graph_module import AmpGraphModule
from ..inputs import ExampleInputs
from ..meta import record
from ..passes import sensitivity as sens
from ..policy.names import parse_dtype
from ..policy import SENSITIVITY_THRESHOLD
from ..report.records import COMPUTE, CastInfo, Decision, dtype_name


@dataclass(frozen=True)
class NodeSensitivity:
    """One node whose rounding alone moved the model: its report names and the relative errors
    of the output (``out_err``) and of the worst parameter gradient (``grad_err``)."""

    node: str
    op: str
    module: str
    out_err: float
    grad_err: float

    @property
    def score(self) -> float:
        return max(self.out_err, self.grad_err)


@dataclass(frozen=True)
class SensitivityResult:
    """What :func:`sensitivity` found: ``records`` worst first, the ``evaluations`` it used (the
    float32 reference run included), the ``dtype``, the ``threshold``, how many ``candidates``
    (low-precision nodes) there were, the errors with all of them rounded together (``whole``),
    whether the search finished within its budget (``complete``) and the ``converted`` module
    it measured. Iterating, ``len`` and indexing go over ``records``; ``str`` prints them."""

    records: tuple[NodeSensitivity, ...]
    evaluations: int
    dtype: torch.dtype
    threshold: float
    candidates: int
    whole: sens.Errors | None
    complete: bool
    converted: nn.Module

    def __iter__(self) -> Iterator[NodeSensitivity]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> NodeSensitivity:
        return self.records[i]

    def __str__(self) -> str:
        whole = ("" if self.whole is None else
                 f"; all rounded together: output {self.whole.out_err:.2g}, gradient {self.whole.grad_err:.2g}")
        head = (f"precision sensitivity ({dtype_name(self.dtype)}): {self.candidates} low-precision nodes, "
                f"{self.evaluations} evaluations{'' if self.complete else ' (budget spent, search unfinished)'}, "
                f"threshold {self.threshold:g}{whole}")
        rows = [f"  {r.node} ({r.op}{', ' + r.module if r.module else ''}): output {r.out_err:.2g}, "
                f"gradient {r.grad_err:.2g}" for r in self.records]
        return "\n".join([head, *(rows or ["  no node over the threshold on its own"])])


def sensitivity(model_or_converted: nn.Module, batch: Any, dtype: Any = None, *,
                loss_fn: Callable[[Any], torch.Tensor] | None = None, budget: Any = None, top: int | None = None,
                threshold: float | None = None) -> SensitivityResult:
    """The low-precision nodes whose rounding alone moves the output or a parameter gradient
    by more than ``threshold`` (relative; default ``Policy.sensitivity_threshold``'s; 0 ranks
    every node that moves the model at all), worst first.

    ``model_or_converted`` is an :func:`ampfx.convert` result, or a model, which is converted
    first (``dtype``, default bfloat16, with ``batch`` as its example inputs). ``batch`` is
    one call's inputs, given like ``example_inputs``; ``loss_fn(output)`` makes the loss for the
    gradients (default: the output if it is a scalar, else the mean of the float outputs).
    ``budget`` caps the evaluations (an ``int``) or the wall time (a ``datetime.timedelta``);
    ``top`` stops after that many nodes. The model's buffers, parameters' ``.grad`` and the
    random state are as they were afterwards.
    """
    if not isinstance(model_or_converted, nn.Module):
        raise ArgumentError(f"sensitivity: model_or_converted={type(model_or_converted).__name__}: give an "
                            "nn.Module, or the module ampfx.convert returned")
    limit, top, threshold = _budget(budget), _top(top), _threshold(threshold)
    amp = _converted(model_or_converted, batch, dtype)
    low = amp.ampfx_report.dtype
    graphs = _graphs(amp)
    candidates = [(gm, n) for gm in graphs for n in gm.graph.nodes if _low(record(n), low)]
    params = [p for p in amp.parameters() if p.requires_grad and p.dtype == torch.float32]
    inputs = ExampleInputs.of(batch)

    def run(active: frozenset) -> list[sens.Run]:
        with _Rounded(graphs, low, {n for _, n in active}):
            return [sens.run_once(lambda: inputs.call(amp), amp, params, loss_fn)]

    found = sens.search(sens.evaluator(run), candidates, threshold, limit, top=top)
    records = tuple(NodeSensitivity(record(n).node, record(n).op, record(n).module, e.out_err, e.grad_err)
                    for (_, n), e in found.found)
    return SensitivityResult(records, found.evaluations, low, threshold, len(candidates), found.whole,
                             found.complete, amp)


def _low(d: Any, low: torch.dtype) -> bool:
    return isinstance(d, Decision) and d.kind in COMPUTE and d.dtype == low and d.rule.counted


class _Float32(sens.Rounding):
    """A converted graph run in float32: ampfx's casts and low-precision leaf runs get float32
    where they name the low dtype; the ``active`` nodes' results are rounded to it."""

    def arguments(self, node: fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        module = args[0] if args and isinstance(args[0], nn.Module) else None
        made = isinstance(record(node), CastInfo) or node.target is runtime.call_module_low or (
            module is not None and libraries.runner(module) is node.target)
        if not made:
            return args, kwargs
        return tree_map(lambda a: torch.float32 if a is self.low else a, (args, kwargs))


class _Rounded:
    """While open, each graph module in ``graphs`` runs as :class:`_Float32` with ``active`` rounded."""

    def __init__(self, graphs: Sequence[AmpGraphModule], low: torch.dtype, active: set[fx.Node]) -> None:
        self.graphs, self.low, self.active = graphs, low, active

    def __enter__(self) -> None:
        for gm in self.graphs:
            gm.__dict__["forward"] = functools.partial(self._forward, gm)

    def __exit__(self, *exc: Any) -> None:
        for gm in self.graphs:
            gm.__dict__.pop("forward", None)

    def _forward(self, gm: AmpGraphModule, *args: Any, **kwargs: Any) -> Any:
        bound = ExampleInputs(args, kwargs).bind(functools.partial(type(gm).forward, gm))
        values = list(bound.args) + list(bound.kwargs.values())
        return _Float32(gm, self.low, self.active & set(gm.graph.nodes)).run(*values)


def _graphs(amp: nn.Module) -> list[AmpGraphModule]:
    """The graph modules that run when ``amp`` is called in its present training modes."""
    found = []
    for m in amp.modules():
        if isinstance(m, AmpGraphModule):
            target = m.mode_module(m.training)
            if isinstance(target, AmpGraphModule) and target not in found:
                found.append(target)
    return found


def _converted(model: nn.Module, batch: Any, dtype: Any) -> nn.Module:
    """``model`` if :func:`ampfx.convert` made it (train mode, ``dtype`` agreeing), else its conversion."""
    report = getattr(model, "ampfx_report", None)
    if report is None:
        return convert(model, dtype, example_inputs=batch)
    if dtype is not None and parse_dtype(dtype) != report.dtype:
        raise ArgumentError(f"sensitivity: dtype={dtype!r} disagrees with the converted module's "
                            f"{dtype_name(report.dtype)}; leave dtype out, or pass the model itself")
    if report.disabled or not _graphs(model):
        raise ArgumentError("sensitivity: the converted module holds no converted graph (conversion disabled, or "
                            "nothing captured): pass a model ampfx can capture")
    if any(n.startswith("inference mode") for n in report.notes):
        raise ArgumentError("sensitivity: a mode='inference' conversion stores its weights in the low dtype, so it "
                            "has no float32 run to compare with: pass the model, or convert it with mode='train'")
    return model


def _budget(budget: Any) -> sens.Budget:
    if budget is None:
        return sens.Budget()
    if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
        return sens.Budget(evaluations=budget)
    if isinstance(budget, datetime.timedelta) and budget.total_seconds() > 0:
        return sens.Budget(seconds=budget.total_seconds())
    raise ArgumentError(f"sensitivity: budget={budget!r}: give a positive number of evaluations (an int, e.g. 50) "
                        "or a positive datetime.timedelta of wall time, or None for no limit")


def _top(top: Any) -> int | None:
    if top is None or (isinstance(top, int) and not isinstance(top, bool) and top > 0):
        return top
    raise ArgumentError(f"sensitivity: top={top!r}: give a positive int (how many nodes to find), or None")


def _threshold(threshold: Any) -> float:
    if threshold is None:
        return SENSITIVITY_THRESHOLD
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < math.inf:
        raise ArgumentError(f"sensitivity: threshold={threshold!r}: give a relative error >= 0 (0 ranks every "
                            f"node; default {SENSITIVITY_THRESHOLD:g}), or None")
    return float(threshold)

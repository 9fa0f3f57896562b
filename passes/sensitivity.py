"""Precision sensitivity: how far rounding some nodes' results to the low dtype moves the model.

An analysis, not a pipeline pass. A float32 run is the reference; an
*evaluation* reruns it with a group of nodes *rounded*: each one's forward
value becomes ``t.to(low).to(t.dtype)``, and so (that round trip's own
backward) does the gradient flowing back into it, as computing that node in
the low dtype would. Everything else stays float32. Two relative errors
against the reference measure the damage (:class:`Errors`): the output's
(``||y - y32|| / ||y32||`` over its float leaves) and the worst parameter
gradient's (``max_p ||g_p - g32_p|| / ||g32_p||``).

:func:`search` finds the nodes that hurt without evaluating each one: the
group of all candidates first; a group under the threshold is done, one over
it is split in halves, worst group first, down to single nodes. With ``k``
sensitive nodes among ``n`` that takes about ``2 k log2(n)`` evaluations,
within a :class:`Budget` (evaluations and/or seconds). Every evaluation starts
from the same random state and buffers, and leaves both as it found them
(dropout draws the same masks as the reference run; batch-norm statistics
and ``.grad`` are untouched).

:func:`record` runs it on a float32 graph for ``convert(..., calibrate=...)``
and writes each sensitive node's :class:`Errors` to
``node.meta['ampfx_sensitivity']``; the calibrate pass keeps those over
``Policy.sensitivity_threshold`` float32 (rule ``calibration:sensitive``).

Before: ``add`` (a carried sum of magnitude 1e3 plus small increments) painted bfloat16
After:  Errors(out_err=0.12, grad_err=0.0) over threshold 0.1 -> rule 'calibration:sensitive', float32
"""
from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

from .. import meta
from ..inputs import ExampleInputs
from ..state import kept_buffers, kept_rng
from .calibrate import default_loss


GRAD_FLOOR = 1e-2
"""A parameter gradient's error is relative to its float32 norm, or to this fraction of the largest
parameter gradient norm where that is more."""


@dataclass(frozen=True)
class Errors:
    """How far one evaluation moved the model from float32 (relative errors; ``inf`` for inf/NaN).

    >>> Errors(out_err=0.01, grad_err=0.2).score
    0.2
    """

    out_err: float
    grad_err: float = 0.0

    @property
    def score(self) -> float:
        """The larger of the two: what a threshold is compared with."""
        return max(self.out_err, self.grad_err)


@dataclass(frozen=True)
class Budget:
    """At most ``evaluations`` runs (the float32 reference counts as one) and/or ``seconds``
    of wall time; ``None`` = no limit of that kind.

    >>> Budget(evaluations=3).allows(3, started=0.0), Budget().allows(10**6, started=0.0)
    (False, True)
    """

    evaluations: int | None = None
    seconds: float | None = None

    def allows(self, used: int, started: float) -> bool:
        """May another evaluation start, ``used`` made so far since ``started`` (``time.monotonic``)?"""
        if self.evaluations is not None and used >= self.evaluations:
            return False
        return self.seconds is None or time.monotonic() - started < self.seconds


@dataclass(frozen=True)
class Search:
    """What :func:`search` found: ``found`` the items over the threshold on their own, each
    with its :class:`Errors`, worst first; ``whole`` the errors of all candidates rounded
    together (``None`` if the budget allowed no evaluation of them); ``evaluations`` used,
    the reference run included; ``complete`` is False when the budget stopped the search
    before every group over the threshold was split down to single items."""

    found: tuple[tuple[Any, Errors], ...]
    whole: Errors | None
    evaluations: int
    complete: bool


def search(evaluate: Callable[[tuple], Errors], items: Sequence[Any], threshold: float, budget: Budget,
           *, top: int | None = None, spent: int = 1, started: float | None = None) -> Search:
    """Bisect ``items`` for those whose rounding alone scores over ``threshold`` (see the module
    docstring). ``evaluate(group)`` gives the errors of one group; ``spent`` evaluations were
    already made (the reference run); ``top`` stops after that many items are found.

    >>> bad = {3, 11}
    >>> s = search(lambda g: Errors(1.0 if bad & set(g) else 0.0), range(16), 0.5, Budget())
    >>> [item for item, _ in s.found], s.evaluations, s.complete
    ([3, 11], 16, True)
    """
    started = time.monotonic() if started is None else started
    used, order = spent, itertools.count()
    heap: list[tuple[float, int, tuple, Errors]] = []
    found: list[tuple[Any, Errors]] = []
    whole = None
    items = tuple(items)
    complete = budget.allows(used, started) or not items
    if items and complete:
        whole, used = evaluate(items), used + 1
        if whole.score > threshold:
            heap.append((-whole.score, next(order), items, whole))
    while heap and (top is None or len(found) < top):
        _, _, group, errors = heapq.heappop(heap)
        if len(group) == 1:
            found.append((group[0], errors))
            continue
        for half in (group[:len(group) // 2], group[len(group) // 2:]):
            if not budget.allows(used, started):
                return Search(_worst_first(found), whole, used, complete=False)
            e, used = evaluate(half), used + 1
            if e.score > threshold:
                heapq.heappush(heap, (-e.score, next(order), half, e))
    return Search(_worst_first(found), whole, used, complete=complete)


def _worst_first(found: list[tuple[Any, Errors]]) -> tuple[tuple[Any, Errors], ...]:
    return tuple(sorted(found, key=lambda f: -f[1].score))


def round_low(value: Any, low: torch.dtype) -> Any:
    """``value`` with every float32 tensor rounded to ``low`` and back (differentiably: the
    gradient flowing back through it is rounded to ``low`` too); other leaves as they are.

    >>> round_low((torch.tensor([1.001]), 3), torch.bfloat16)
    (tensor([1.]), 3)
    """
    return tree_map(lambda t: t.to(low).to(t.dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32
                    else t, value)


class Rounding(fx.Interpreter):
    """Runs a float32 graph with the results of the ``active`` nodes rounded to ``low``
    (:func:`round_low`). :meth:`arguments` is where a subclass adjusts a node's inputs."""

    def __init__(self, gm: fx.GraphModule, low: torch.dtype, active: Iterable[fx.Node] = ()) -> None:
        super().__init__(gm)
        self.low, self.active = low, frozenset(active)

    def arguments(self, node: fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The arguments ``node`` is called with (as the graph gives them, here)."""
        return args, kwargs

    def run_node(self, n: fx.Node) -> Any:
        with self._set_current_node(n):
            args, kwargs = self.arguments(n, *self.fetch_args_kwargs_from_env(n))
            out = getattr(self, n.op)(n.target, args, kwargs)
        return round_low(out, self.low) if n in self.active else out


def rel(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """``||got - want|| / max(||want||, floor)`` in float32: 0 when equal, ``inf`` when the
    difference is inf/NaN or the denominator is zero and ``got`` differs.

    >>> rel(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])), rel(torch.tensor([1.0]), torch.tensor([2.0]))
    (0.0, 0.5)
    """
    got, want = got.detach().float(), want.detach().float()
    if torch.equal(got, want):
        return 0.0
    diff, norm = float((got - want).norm()), max(float(want.norm()), floor)
    return diff / norm if math.isfinite(diff) and norm > 0 else math.inf


@dataclass(frozen=True)
class Run:
    """One run's float outputs (flattened) and parameter gradients (``None``: no gradient)."""

    outputs: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor | None, ...]

    def errors(self, ref: "Run") -> Errors:
        """This run against the float32 reference ``ref``. A parameter gradient is measured against
        at least :data:`GRAD_FLOOR` of the largest one: a gradient that is zero up to rounding in
        float32 (a bias before a batch norm) has no relative error worth the name."""
        out = max((rel(g, w) for g, w in zip(self.outputs, ref.outputs)), default=0.0)
        norms = [float(w.float().norm()) for w in ref.grads if w is not None]
        floor = GRAD_FLOOR * max(norms, default=0.0)
        grad = max((rel(g if g is not None else torch.zeros_like(w), w, floor)
                    for g, w in zip(self.grads, ref.grads) if w is not None), default=0.0)
        return Errors(out, grad)


def run_once(call: Callable[[], Any], module: torch.nn.Module, params: Sequence[torch.nn.Parameter],
             loss_fn: Callable[[Any], torch.Tensor] | None) -> Run:
    """``call()`` forward and, when its loss has a gradient, backward to ``params`` (``autograd.grad``:
    no ``.grad`` is written), from the random state and buffers it found, which it puts back."""
    with kept_rng(*params), kept_buffers(module), torch.enable_grad():
        out = call()
        outputs = tuple(t.detach() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
        loss = loss_fn(out) if loss_fn is not None else default_loss(out)
        if not (params and isinstance(loss, torch.Tensor) and loss.requires_grad):
            return Run(outputs, ())
        grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    return Run(outputs, tuple(g.detach() if g is not None else None for g in grads))


def evaluator(run: Callable[[frozenset], list[Run]]) -> Callable[[tuple], Errors]:
    """``evaluate(group)`` from ``run(active) -> [Run per batch]``: the reference run is made now;
    each group's errors are the worst over the batches."""
    reference = run(frozenset())

    def evaluate(group: tuple) -> Errors:
        runs = run(frozenset(group))
        errors = [r.errors(ref) for r, ref in zip(runs, reference)]
        return Errors(max(e.out_err for e in errors), max(e.grad_err for e in errors))
    return evaluate


def record(gm: fx.GraphModule, batches: Sequence[Any], loss_fn: Callable[[Any], torch.Tensor] | None,
           low: torch.dtype, candidates: Sequence[fx.Node], threshold: float, budget: Budget) -> Search:
    """Search ``candidates`` of the float32 graph ``gm`` on ``batches`` (see the module docstring)
    and write each node found over ``threshold`` its :class:`Errors` (``meta.SENSITIVITY``)."""
    started = time.monotonic()
    params = [p for p in gm.parameters() if p.requires_grad and p.dtype == torch.float32]
    inputs = [ExampleInputs.of(b).positional(gm) for b in batches]

    def run(active: frozenset) -> list[Run]:
        return [run_once(lambda x=x: Rounding(gm, low, active).run(*x), gm, params, loss_fn) for x in inputs]

    result = search(evaluator(run), candidates, threshold, budget, started=started)
    for node, errors in result.found:
        node.meta[meta.SENSITIVITY] = errors
    return result

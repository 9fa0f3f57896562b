"""``ampfx.tools.tune``: keep float32 the few nodes a metric needs, found in O(log n) metric evaluations.

Convert with the default plan; if ``metric(converted)`` (higher is better) is
within ``tolerance`` of ``metric(model)`` (the float32 model), that is the
answer. Otherwise the low-precision nodes are ordered by precision
sensitivity (:func:`ampfx.sensitivity`: the nodes whose rounding alone moves
the output or a gradient most, first), and the search keeps float32:

1. all candidates (must meet the tolerance, else :class:`TuneError`: no
   choice of nodes can, e.g. the metric is not deterministic);
2. the shortest prefix of that order that meets it (bisection, ``log2 n``
   evaluations);
3. fewer: groups of the prefix are dropped while the metric still meets it,
   halving a group that cannot go (``2 k log2 m`` evaluations for ``k`` needed
   nodes among ``m``).

Each evaluation is a real conversion (``Policy.tuned`` keeps the chosen nodes
float32, rule ``tune``) measured by ``metric``, with the model's buffers,
training flags and the random state put back after it, so every evaluation
sees the same dropout draws and batch-norm statistics; the parameters and their
``.grad`` are put back too, so a metric that trains (an optimizer step, then a
measurement) starts from the same weights each time and leaves the model as it
was. The returned module's records of the kept nodes say ``rule='tune'`` with the metric before and
after; ``result.ampfx_policy`` is the policy to save (``.save(path)``) and load
again (``Policy.from_file`` / ``AMPFX_POLICY_FILE``) without tuning again.

>>> import torch, ampfx
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<...>
>>> class Offset(torch.nn.Module):  # (x @ W + 300) - 300: bfloat16 keeps 1 in 256 of the small part
...     def __init__(self):
...         super().__init__(); self.fc = torch.nn.Linear(8, 8)
...     def forward(self, x):
...         return (self.fc(x) + 300.0) - 300.0
>>> net, x = Offset(), torch.randn(16, 8)
>>> want = net(x).detach()
>>> metric = lambda m: -float((m(x).detach() - want).pow(2).mean())
>>> amp = ampfx.tune(net, "bf16", example_inputs=(x,), metric=metric, tolerance=1e-4, progress=False)
>>> [r.node for r in amp.ampfx_report.records if r.rule == "tune"]
['add']
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import numbers
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from ..api import convert
from ..errors import ENTRY_ERRORS, ArgumentError, TuneError
from .numerics import sensitivity
from ..policy import Policy
from ..request import Asked, build, policy_of
from ..report.records import dtype_name
from ..state import kept_buffers, kept_parameters, kept_rng

CANDIDATES = 32
"""How many nodes the sensitivity search ranks by default; the rest follow in graph order."""


@dataclass(frozen=True)
class Trial:
    """One metric evaluation: the node keys kept float32, the metric, whether it met the target."""

    kept: tuple[str, ...]
    metric: float
    ok: bool


@dataclass(frozen=True)
class TuneResult:
    """What :func:`tune` did: the metric of the float32 model, of the default plan and of the tuned
    plan, the ``tolerance``, the node keys it ``kept`` float32 (``Decision.key``), the metric
    ``evaluations`` (the float32 model's and the default plan's included), the ``candidates``
    (low-precision nodes of the default plan), the sensitivity runs that ordered them, each
    :class:`Trial`, and whether the search finished within its budget (``complete``)."""

    dtype: torch.dtype
    metric_float32: float
    metric_default: float
    metric_tuned: float
    tolerance: float
    kept: tuple[str, ...]
    evaluations: int
    candidates: int
    sensitivity_evaluations: int
    trials: tuple[Trial, ...]
    complete: bool

    def __str__(self) -> str:
        state = "" if self.complete else " (budget spent: the set may not be the smallest)"
        return (f"ampfx.tools.tune ({dtype_name(self.dtype)}): metric float32 {self.metric_float32:.6g}, default plan "
                f"{self.metric_default:.6g}, tuned {self.metric_tuned:.6g} (tolerance {self.tolerance:g}); "
                f"{len(self.kept)} of {self.candidates} low-precision nodes kept float32 in {self.evaluations} metric "
                f"evaluations and {self.sensitivity_evaluations} sensitivity runs{state}"
                + "".join(f"\n  {k}" for k in self.kept))


def tune(model: nn.Module, dtype: Any = None, *, example_inputs: Any, metric: Callable[[nn.Module], Any],
         tolerance: float, budget: Any = None, loss_fn: Callable[[Any], torch.Tensor] | None = None,
         candidates: int = CANDIDATES, progress: bool = True, policy: Policy | None = None,
         environ: Mapping[str, str] | None = None, **policy_options: Any) -> nn.Module:
    """The conversion of ``model`` with the fewest nodes kept float32 that this search finds for
    ``metric(converted) >= metric(model) - tolerance`` (see the module docstring).

    ``metric(module) -> number``: higher is better (minus a validation loss, an accuracy on held
    batches); it is called with the float32 model once and with one conversion per evaluation.
    ``example_inputs``: one call's inputs, for the conversion and the sensitivity order
    (``loss_fn(output)`` makes its loss; default as in :func:`ampfx.sensitivity`). ``budget``: the
    most metric evaluations (an ``int`` >= 3) or wall time (a ``datetime.timedelta``); when it runs
    out, the best plan found that meets the tolerance is returned and the result says so.
    ``candidates``: how many nodes sensitivity ranks. ``progress``: print each evaluation.
    ``policy`` / keyword options / ``environ``: as for :func:`ampfx.convert` (the tuned nodes are
    added to ``policy.tuned``). The result carries ``ampfx_tune`` (:class:`TuneResult`) and
    ``ampfx_policy`` (the :class:`~ampfx.policy.Policy` to save and load again).
    """
    try:
        _check(model, metric, tolerance, candidates)
        evaluations, seconds = _budget(budget)
        base = policy_of("tune", dtype, policy, policy_options)  # the environment is read by each conversion,
        build(model, Asked(None, example_inputs, base), caller="tune", environ=environ)  # and checked here first
    except ENTRY_ERRORS as e:  # the user's mistake, raised from here: the traceback ends at their call
        raise e.with_traceback(None) from None
    return _Search(model, example_inputs, metric, float(tolerance), evaluations, seconds, loss_fn, int(candidates),
                   bool(progress), base, environ, started=time.monotonic()).run()


@dataclass
class _Search:
    model: nn.Module
    inputs: Any
    metric: Callable[[nn.Module], Any]
    tolerance: float
    evaluations: int | None
    seconds: float | None
    loss_fn: Any
    top: int
    progress: bool
    base: Policy
    environ: Mapping[str, str] | None
    started: float = 0.0
    trials: dict[frozenset, Trial] = dataclasses.field(default_factory=dict)
    order: tuple[str, ...] = ()
    target: float = 0.0
    complete: bool = True
    count: int = 0

    # ------------------------------------------------------------------ the search
    def run(self) -> nn.Module:
        m32 = self._measure(self.model, "float32 model")
        if not math.isfinite(m32):
            raise TuneError(f"tune: metric(model) of the float32 model is {m32}: the metric must be finite there")
        self.target = m32 - self.tolerance
        default = self._convert(())
        m0 = self._measure(default, "default plan")
        self.trials[frozenset()] = Trial((), m0, m0 >= self.target)
        if m0 >= self.target:
            return self._finish(default, (), m32, m0, m0, 0, 0)
        found = sensitivity(default, self.inputs, loss_fn=self.loss_fn, threshold=0.0, top=self.top)
        ranked = [_key(r.module, r.node) for r in found]
        rest = [r.key for r in default.ampfx_report.low() if r.key not in ranked]
        self.order = tuple(dict.fromkeys(ranked + rest))
        kept = self._search()
        best = self.trials[frozenset(kept)]
        return self._finish(None, kept, m32, m0, best.metric, len(self.order), found.evaluations)

    def _search(self) -> tuple[str, ...]:
        """Steps 1-3 of the module docstring; the kept keys, in sensitivity order."""
        n = len(self.order)
        if not self._ok(self.order):
            raise TuneError(
                f"tune: even with all {n} low-precision nodes float32 the metric is "
                f"{self.trials[frozenset(self.order)].metric:.6g}, below the float32 model's "
                f"{self.target + self.tolerance:.6g} - tolerance {self.tolerance:g}. No choice of nodes meets it: is "
                "the metric deterministic (same batches, no randomness of its own)? Loosen the tolerance, or keep "
                "modules float32 with fp32_modules.")
        lo, hi = 0, n  # order[:lo] fails, order[:hi] meets the target
        while hi - lo > 1 and self._left():
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._ok(self.order[:mid]) else (mid, hi)
        kept = list(self.order[:hi])
        self.complete = hi - lo <= 1
        groups = [kept[:-1]]
        while groups and self._left():
            group = groups.pop(0)
            trial = [k for k in kept if k not in group]
            if group and self._ok(trial):
                kept = trial
            elif len(group) > 1:
                groups[:0] = [group[:len(group) // 2], group[len(group) // 2:]]
        self.complete = self.complete and not groups
        return tuple(kept)

    def _ok(self, kept: Sequence[str]) -> bool:
        key = frozenset(kept)
        if key not in self.trials:
            value = self._measure(self._convert(tuple(kept)), f"{len(kept)} of {len(self.order)} nodes float32")
            self.trials[key] = Trial(tuple(kept), value, value >= self.target)
        return self.trials[key].ok

    def _left(self) -> bool:
        """Is there budget for one more evaluation?"""
        if self.evaluations is not None and self.count >= self.evaluations:
            return False
        return self.seconds is None or time.monotonic() - self.started < self.seconds

    # ------------------------------------------------------------------ conversions and measurements
    def _convert(self, kept: tuple[str, ...], reasons: Mapping[str, str] | None = None) -> nn.Module:
        extra = tuple((k, (reasons or {}).get(k, "ampfx.tools.tune: trial")) for k in kept)
        policy = dataclasses.replace(self.base, tuned=self.base.tuned + extra)
        return convert(self.model, example_inputs=self.inputs, policy=policy, environ=self.environ)

    def _measure(self, module: nn.Module, what: str) -> float:
        flags = [(m, m.training) for m in (*self.model.modules(), *module.modules())]
        try:
            with kept_buffers(self.model, grads=True), kept_parameters(self.model), kept_rng():
                value = self.metric(module)
        finally:
            for m, training in flags:
                m.training = training
        value = _number(value)
        self.count += 1
        if self.progress:
            _print(self.count, what, value, None if self.count == 1 else self.target)
        return value

    def _finish(self, module: nn.Module | None, kept: tuple[str, ...], m32: float, m0: float, mt: float,
                n: int, runs: int) -> nn.Module:
        reason = (f"ampfx.tools.tune kept this node float32: metric {m0:.6g} with the default plan -> {mt:.6g} with "
                  f"{len(kept)} node(s) float32 (float32 model {m32:.6g}, tolerance {self.tolerance:g})")
        reasons = {k: reason + self._without(k, kept) for k in kept}
        if module is None:
            module = self._convert(kept, reasons)
        result = TuneResult(module.ampfx_report.dtype, m32, m0, mt, self.tolerance, kept, self.count,
                            n, runs, tuple(self.trials.values()), self.complete)
        module.ampfx_report = dataclasses.replace(module.ampfx_report,
                                                  notes=module.ampfx_report.notes + (str(result).split("\n")[0],))
        module.ampfx_tune = result
        module.ampfx_policy = dataclasses.replace(self.base, tuned=self.base.tuned + tuple(reasons.items()))
        return module

    def _without(self, key: str, kept: tuple[str, ...]) -> str:
        """``; without it: <metric>`` when the trial of the kept set less this node was run."""
        trial = self.trials.get(frozenset(kept) - {key})
        return f"; without it: {trial.metric:.6g}" if trial is not None and not trial.ok else ""


def _key(module: str, node: str) -> str:
    """:attr:`ampfx.report.records.Decision.key` from a record's module and node names."""
    return f"{module}:{node}" if module else node


def _number(value: Any) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numbers.Real: numpy's floats too
        raise ArgumentError(f"tune: metric returned {type(value).__name__} {value!r}: return a number (higher is "
                            "better), e.g. -validation_loss or accuracy")
    return float(value) if value == value else -math.inf  # NaN never meets the target


def _print(i: int, what: str, value: float, target: float | None) -> None:
    """One line per evaluation, on stderr: what was kept float32, the metric, whether it meets the target."""
    from rich.console import Console
    mark = "" if target is None else ("[green]meets[/]" if value >= target else "[red]below[/]") + f" {target:.6g}"
    Console(stderr=True).print(f"[bold]ampfx.tools.tune[/] evaluation {i}: {what}: metric {value:.6g} {mark}",
                               highlight=False, soft_wrap=True)


def _check(model: Any, metric: Any, tolerance: Any, candidates: Any) -> None:
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"tune: model={type(model).__name__}: give the nn.Module to convert")
    if not callable(metric):
        raise ArgumentError(f"tune: metric={metric!r}: give a function module -> number, higher is better")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < math.inf:
        raise ArgumentError(f"tune: tolerance={tolerance!r}: give how far below the float32 model's metric the "
                            "tuned metric may be (a number >= 0, in the metric's units)")
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise ArgumentError(f"tune: candidates={candidates!r}: give how many nodes sensitivity ranks (an int >= 1)")


def _budget(budget: Any) -> tuple[int | None, float | None]:
    if budget is None:
        return None, None
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 3:
        return budget, None
    if isinstance(budget, datetime.timedelta) and budget.total_seconds() > 0:
        return None, budget.total_seconds()
    raise ArgumentError(f"tune: budget={budget!r}: give the most metric evaluations (an int >= 3: the float32 model, "
                        "the default plan and the all-float32 check come first) or a datetime.timedelta, or None")



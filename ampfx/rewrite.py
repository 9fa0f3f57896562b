"""Converting one captured graph: analyses, the pass pipeline, its report (the other training mode
is converted by :mod:`ampfx.tree`, as converting the model in that mode would).

:func:`convert_graph` is the part of :func:`ampfx.convert` that runs once per
captured graph (the whole model, or one part of it):

1. **analyses** — :data:`ampfx.passes.ANALYSES`: shapes and dtypes from the example inputs,
   calibration statistics when ``calibrate=`` batches were given, and the precision check of
   calibration; facts land in ``node.meta``;
2. **passes** — :data:`ampfx.passes.PIPELINE` with a frozen
   :class:`~ampfx.passes.context.PassContext`, then lint and one recompile; every step (analyses
   included) runs under an :class:`~ampfx.observer.Observer` (timings, a debug log, each
   ``Decision``'s history, the graph after each step when the report is saved);
3. **counts** — with example inputs, :data:`ampfx.passes.COUNTS` on the converted graph (the ATen
   GEMMs each node runs, and in which dtype);
4. **report** — a :class:`~ampfx.report.Report` built from the records in ``node.meta``.
"""
from __future__ import annotations

import dataclasses
import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .capture import fixing, guarding
from .errors import NotReproduced
from .capture.base import Capture
from .capture.tracer import inlined
from .runtime import arming, reads
from .runtime.entries import GraphPlan
from .runtime.graph_module import MADE, AmpGraphModule, graph_module
from .inputs import ExampleInputs
from .meta import leaf_param_casts, record
from .observer import Observer
from .passes import ANALYSES, COUNTS, DECIDING, LOWERING, PIPELINE, autocast, boundary, calibrate, sensitivity, shapes
from .passes.context import Ends, PassContext, Place
from .policy import Policy, Resolved
from .request import Request
from .report import Report
from .report.records import COMPUTE, CastInfo, Decision, Part
from .policy.module_match import TRACED_PRE_HOOKS
from .state import keep_hooks

NO_SHAPES = Report.__dataclass_fields__["shapes"].default


@dataclass(frozen=True)
class Analysis:
    """Facts about the graph from running it on its inputs (or on fake tensors)."""

    symbols: Any = None
    shape_note: str = NO_SHAPES
    notes: tuple[str, ...] = ()


def convert_graph(work: nn.Module, capture: Capture, inputs: ExampleInputs | None, request: Request,
                  place: Place) -> tuple[AmpGraphModule, Report]:
    """The converted graph module of ``work`` and its report (see the module docstring); ``place``: where its
    graph sits in the model (:class:`~ampfx.passes.context.Place`: its path, its leaves that keep their Python,
    its boundary dtypes, the boundaries of the kept modules it calls). Raises :class:`NotReproduced` when the
    graph does not run on ``inputs``."""
    prefix = place.prefix
    gm = capture.module if capture.module is not None else graph_module(work, capture.graph)
    # torch.fx traces forward alone, and torch.export ran without the module's own hooks (but those it traced in)
    keep_hooks(gm, work, skip=TRACED_PRE_HOOKS if capture.method == "export" else ())
    exported = guarding.exported(capture)  # before the analyses overwrite the placeholders' values
    before = gm.code
    seen = Observer(prefix.rstrip("."), keep_code=request.policy.log.log_path is not None)
    analysis = analyse(gm, inputs, request, root=prefix == "", seen=seen)
    ctx = _context(work, capture, inputs, request, analysis, place)
    precision = find_sensitive(gm, ctx, request, seen) if prefix == "" else []
    run_passes(gm, ctx, seen)
    if inputs is not None:
        seen.run("count_gemms", dict(COUNTS)["count_gemms"], gm, inputs, request.policy.dtype)
    notes = [*capture.notes, *_export_notes(capture, request.policy), *analysis.notes, *precision]
    if capture.fixed_args:
        notes.append("optional arguments fixed at their defaults while tracing (the converted module asserts "
                     f"them): {', '.join(f'{k}={v!r}' for k, v in capture.fixed_args.items())}")
    guard, guard_notes = guarding.attach(gm, work, capture, inputs, request.dynamic_dims if prefix == "" else None,
                                         prefix, exported, request.policy.pad)
    notes += guard_notes
    made = graph_plan(gm, work, capture, request, place, guard)
    report = graph_report(gm, capture, prefix, before, analysis.shape_note, notes, request.policy)
    if any([seen.run(name, step, gm) for name, step in LOWERING]):  # after the report: it keeps every node
        gm.graph.lint()
        gm.recompile()
    arming.plan(gm, dataclasses.replace(made, reads=reads.scan(gm, request.policy.dtype)))  # as the graph runs
    where = prefix.rstrip(".")
    return gm, dataclasses.replace(report, steps=tuple((where, s, t) for s, t in seen.steps),
                                   step_code={where: tuple(seen.code)} if seen.keep_code else {})


def _context(work: nn.Module, capture: Capture, inputs: ExampleInputs | None, request: Request, analysis: Analysis,
             place: Place) -> PassContext:
    """The :class:`PassContext` of ``work``'s captured graph at ``place``."""
    why_kept = dict(request.resolved.keep_matched or ())
    return PassContext(policy=request.policy, resolved=request.resolved, device=device_of(work, inputs),
                       leaves=dict(capture.leaves), symbols=analysis.symbols, place=place,
                       kept={p: why_kept.get(place.prefix + p, "keep_modules") for p in capture.kept})


DRY_RUN = "dry run: "
"""Before the name of each step run on a copy of a graph (the report's steps say so)."""


def kept_ends(work: nn.Module, capture: Capture, inputs: ExampleInputs | None, request: Request,
              prefix: str, seen: Observer | None = None) -> Ends | None:
    """What the kept module ``work`` (at ``prefix``, captured as ``capture``) does at its boundary when its
    caller hands it float32 (:func:`ampfx.passes.boundary.ends`), from its passes up to painting run on a
    copy of its graph (``capture`` is left as it was, for its own conversion); ``None`` where that cannot
    be known before its conversion (constants its capture made, a graph that does not run on ``inputs``).
    Its caller paints its call from it. Each step runs under ``seen``, an observer of dry runs (its steps are
    named ``"dry run: paint"``)."""
    if capture.constants:
        return None
    seen = seen if seen is not None else Observer(prefix.rstrip("."), label=DRY_RUN)
    dry = (graph_module(work, copy.deepcopy(capture.graph)) if capture.module is None
           else fx.GraphModule(capture.module, copy.deepcopy(capture.module.graph)))
    try:
        analysis = analyse(dry, inputs, request, root=False, seen=seen)
    except NotReproduced:
        return None
    inner = frozenset(p for p in capture.leaves if list(work.get_submodule(p).children()))
    ctx = _context(work, capture, inputs, request, analysis, Place(prefix, eager_leaves=inner, arrive=torch.float32))
    under_autocast = tuple((d, autocast.returns_under_autocast(dry, ctx.at(autocast_arrive=d)))
                           for d in (torch.float32, request.policy.dtype))
    for pass_ in DECIDING:
        seen.run(pass_.__name__, pass_, dry, ctx)
    return dataclasses.replace(boundary.ends(dry, ctx), autocast=under_autocast)


def graph_plan(gm: AmpGraphModule, work: nn.Module, capture: Capture, request: Request, place: Place,
               guard: Any) -> GraphPlan:
    """The frozen plan of ``gm``, the converted graph of ``work`` at ``place``: what it needs to stay a faithful
    view of the model after conversion (:mod:`ampfx.runtime.view`: what its graph fixed of ``work``'s Python,
    :func:`ampfx.capture.fixing.record`; where it sits; its boundary dtype; whether it keeps its own copies of
    ``work``'s hooks, torch.export having traced a pruning pre-hook in) and its argument ``guard``; the table of how
    it reads each parameter is the caller's, scanned from the graph as it runs (after lowering)."""
    policy, prefix = request.policy, place.prefix
    targets = tuple(dict.fromkeys(str(n.target) for n in gm.graph.nodes  # constants a capture made are its own
                                  if n.op == "get_attr" and not str(n.target).startswith(MADE)))
    named = request.resolved.below(prefix) if prefix else request.resolved.leaf_names
    recorded = fixing.record(work, inlined(work, capture, policy, named), targets, capture.lifted,
                             torch.finfo(policy.dtype).max, capture.read, capture.folded)
    own_hooks = capture.method == "export" and any(
        isinstance(h, TRACED_PRE_HOOKS) for h in work._forward_pre_hooks.values())
    return GraphPlan(prefix.rstrip("."), place.arrive, policy.dtype, recorded, own_hooks, guard, ())


def analyse(gm: AmpGraphModule, inputs: ExampleInputs | None, request: Request, root: bool,
            seen: Observer) -> Analysis:
    """Shapes from ``inputs``, then calibration (:data:`ampfx.passes.ANALYSES`, observed by ``seen``).
    ``dynamic_dims`` and calibration batches describe the model's own inputs: they apply to the root
    graph only (a part's inputs have other dimensions)."""
    if inputs is None:
        shapes.forget(gm)
        return Analysis()
    steps = dict(ANALYSES)
    try:
        _, note, symbols = seen.run("propagate_shapes", steps["propagate_shapes"], gm, inputs,
                                    request.dynamic_dims if root else None)
    except ValueError as e:
        raise NotReproduced(str(e)) from e
    notes: list[str] = []
    if request.calibrate is not None and root:
        batches, loss_fn = request.calibrate
        count = seen.run("record_calibration", steps["record_calibration"], gm, batches, loss_fn, request.policy.dtype,
                         request.policy.fp8)
        notes.append(f"calibration: {count} batches, forward and backward")
        advice = calibrate.loss_scale_advice(gm, request.policy.dtype)
        if advice:
            notes.append(advice)
    return Analysis(symbols, note, tuple(notes))


SENSITIVITY_BUDGET = sensitivity.Budget(evaluations=256)
"""What the precision check of calibration may spend: with k sensitive nodes among n it needs
about 2 k log2(n) evaluations (each a forward and backward per calibration batch)."""


def find_sensitive(gm: AmpGraphModule, ctx: PassContext, request: Request, seen: Observer) -> list[str]:
    """With ``calibrate=`` batches and a ``sensitivity_threshold``, the nodes the passes would paint
    low are searched for those whose rounding alone hurts (:func:`ampfx.passes.sensitivity.record`
    marks them; the calibrate pass keeps them float32). Returns the report's note."""
    threshold = request.policy.sensitivity_threshold
    if request.calibrate is None or not threshold or not ctx.has_shapes:
        return []
    low = planned_low(gm, ctx, seen)
    candidates = [n for n in gm.graph.nodes if n.name in low]
    batches, loss_fn = request.calibrate
    found = seen.run("find_sensitive", dict(ANALYSES)["find_sensitive"], gm, batches, loss_fn, ctx.policy.dtype,
                     candidates, threshold, SENSITIVITY_BUDGET)
    whole = "" if found.whole is None else (f"; all of them rounded together: output {found.whole.out_err:.2g}, "
                                            f"gradient {found.whole.grad_err:.2g}")
    unfinished = "" if found.complete else f" (stopped at the budget of {SENSITIVITY_BUDGET.evaluations})"
    return [f"calibration: precision sensitivity of {len(candidates)} low-precision nodes in {found.evaluations} "
            f"evaluations{unfinished}: {len(found.found)} over sensitivity_threshold {threshold:g}{whole}"]


def planned_low(gm: AmpGraphModule, ctx: PassContext, seen: Observer | None = None) -> set[str]:
    """Names of the nodes the pipeline would compute in the low dtype: the passes up to painting,
    run on a copy of the graph (``gm`` and its ``node.meta`` are left as they are), each under ``seen``
    (a dry run: ``"dry run: paint"``)."""
    seen = seen if seen is not None else Observer(ctx.prefix.rstrip("."))
    dry = fx.GraphModule(gm, copy.deepcopy(gm.graph))  # node.meta dicts are copied: the passes write the copies
    for pass_ in DECIDING:
        seen.run(f"{DRY_RUN}{pass_.__name__}", pass_, dry, ctx)
    return {n.name for n in dry.graph.nodes if isinstance(record(n), Decision) and record(n).kind in COMPUTE
            and record(n).dtype == ctx.policy.dtype}


def run_passes(gm: AmpGraphModule, ctx: PassContext, seen: Observer | None = None) -> None:
    """The pipeline (:data:`ampfx.passes.PIPELINE`, each step observed by ``seen``), then lint and one
    recompile; fake tensors leave the meta (they keep their ``ShapeEnv`` alive; a graph holding them
    does not pickle): ``tensor_meta``, plain data, stays."""
    seen = seen if seen is not None else Observer(ctx.prefix.rstrip("."))
    for pass_ in PIPELINE:
        seen.run(pass_.__name__, pass_, gm, ctx)
    gm.graph.lint()
    gm.recompile()
    for node in gm.graph.nodes:
        node.meta.pop("val", None)


def device_of(model: nn.Module, inputs: ExampleInputs | None) -> str:
    """The device type conversion decides for: the model's parameters, else its inputs, else CPU."""
    for p in model.parameters():
        return p.device.type
    return (inputs.device() if inputs is not None else None) or "cpu"


def _export_notes(capture: Capture, policy: Policy) -> list[str]:
    if capture.method == "export" and (policy.capture.leaf_modules or any(not isinstance(o, str) for o, _ in policy.user_ops)):
        return ["torch.export traces through leaf_modules and the modules and functions named on a list: on this "
                "exported graph their ops are decided one by one (tracer='fx' keeps them whole)"]
    return []


def _record_name(node: fx.Node) -> str:
    """The name ``node`` has in the report: its record's (a node a pass replaced keeps its record's name)."""
    r = record(node)
    return r.node if isinstance(r, (Decision, CastInfo)) else node.name


def graph_report(gm: AmpGraphModule, capture: Capture, prefix: str, before: str, shape_note: str,
                 notes: list[str], policy: Policy) -> Report:
    """The report of one converted graph, from the records in ``node.meta``."""
    records = tuple(dataclasses.replace(r, inputs=tuple(map(_record_name, n.all_input_nodes)))
                    for n in gm.graph.nodes if isinstance(r := record(n), Decision))
    casts = tuple(r for r in map(record, gm.graph.nodes) if isinstance(r, CastInfo))
    path = prefix.rstrip(".")
    part = Part(path=path, method=capture.method, steps=tuple(capture.steps), leaves=tuple(capture.leaves.items()),
                why=capture.why, functions=tuple(capture.functions.items()))
    return Report(dtype=policy.dtype, records=records, casts=casts, parts=(part,),
                  leaf_param_casts=leaf_param_casts(gm), shapes=shape_note, code_before={path: before},
                  code_after={path: gm.code}, notes=tuple(notes))

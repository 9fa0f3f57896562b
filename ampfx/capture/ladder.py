"""The capture ladder for one module: torch.fx, then torch.export, then a verdict.

Each rung either returns a :class:`~ampfx.capture.base.Capture` saying why it
was accepted, or records its error in the steps and hands over to the next
one. :func:`capture` tries, with ``tracer="auto"``:

1. torch.fx on the whole module (with its own sub-ladder of fixed arguments
   and leaf modules, :func:`ampfx.capture.tracer.trace`); accepted when it
   needed no leaves and reproduces the module's outputs on the example inputs
   (:func:`ampfx.capture.verify.reproduces`), or when no example inputs exist
   to check it with;
2. torch.export (:func:`ampfx.capture.export.capture`): one ATen-level graph;
3. the torch.fx graph with leaves, if it reproduces the module;
4. nothing: :class:`~ampfx.capture.base.Uncaptured`, the module runs its own
   Python and its children are converted (:mod:`ampfx.tree`).

``tracer="fx"`` stops after rung 1, ``tracer="export"`` starts at rung 2.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx
import torch.nn as nn

from ..runtime.graph_module import graph_module
from ..inputs import ExampleInputs
from ..policy import Policy
from ..state import kept_functorch, kept_random
from . import export
from .base import Capture, Uncaptured, copied_graph
from ..errors import ExampleInputsError, RootUntraceable
from .tracer import trace
from .verify import compare, reference


FROZEN_DRAW = ("the model's Python drew a random number while being traced (a layerdrop `if torch.rand(()) < p`) "
               "and its value decided something: the graph would take that draw's branch on every call, so it is "
               "not used")


@dataclass(frozen=True)
class Bounds:
    """The modules a capture keeps whole: ``kept``, paths in the module that stay boundaries (``keep_modules``);
    ``required``, whether one was named (or carries hooks) rather than found by ``"auto"``; ``named``, the leaves
    ``leaf_modules`` names (under any of their names: :attr:`ampfx.policy.Resolved.leaf_names`)."""

    kept: frozenset[str] = frozenset()
    required: bool = False
    named: frozenset[str] = frozenset()


def capture(module: nn.Module, policy: Policy, inputs: ExampleInputs | None, tracer: str, bounds: Bounds = Bounds(),
            sizes: list[int] | None = None, drops: set[str] | None = None) -> Capture | Uncaptured:
    """Capture ``module`` as one graph with ``tracer`` (see the module docstring). The modules at
    ``bounds.kept`` (paths in ``module``) stay boundaries: torch.fx keeps them as leaves, and torch.export,
    which would inline them, is not tried where torch.fx captured the module, nor where a kept module
    was named (``bounds.required``) rather than found by ``"auto"``; the modules at ``bounds.named`` are leaves
    ``leaf_modules`` names; when torch.export does capture it, a note says which modules it inlined. ``sizes`` and ``drops``: :func:`ampfx.capture.export.capture`'s memos;
    torch.export is not tried where ``drops`` already names modules (paths in ``module``, of a class whose
    forward an earlier export in this training mode found it would not repeat), nor where the model's own
    run that checks the torch.fx graph shows a forward doing that (an eval-mode cache filled); those
    modules' paths are added to ``drops``."""
    fx_capture, steps, run = None, [], _ModelRun()
    kept, required, named = bounds.kept, bounds.required, bounds.named
    if tracer != "export" and _graph_as_given(module):
        return Capture(graph=copied_graph(module.graph), method="fx (the graph module's own graph)",
                       why="a graph module calling no submodule, with plain code (as dynamo hands a backend): its own "
                           "graph, not traced again (a trace would run its torch.func calls on proxies)")
    if tracer != "export":
        only_fx = tracer == "fx" or inputs is None
        fx_capture, steps, exportable = _fx_rung(module, policy, inputs, run, check=not only_fx, kept=kept,
                                                      named=named)
        if fx_capture is not None and (only_fx or fx_capture.why):
            return fx_capture
        if only_fx:
            return Uncaptured(tuple(steps))
        if kept and required:  # auto-kept blocks give way to one exported graph (a note says so)
            return _with_leaves(fx_capture, run, [*steps, "auto: torch.export not tried: it would inline the modules "
                                             f"keep_modules keeps as boundaries ({_few(kept)})"])
        if not exportable:
            return _with_leaves(fx_capture, run, [*steps, "auto: a forward sets Python attributes, which torch.export "
                                             "does not repeat either (it puts them back after tracing): not tried"])
        if run.seen:  # the model's own run (verifying the fx graph) changed Python state: export would stop there
            if drops is not None:
                drops.update(run.seen)
            what = "; ".join(f"{p or 'the root module'!r}: {', '.join(w)}" for p, w in sorted(run.seen.items())[:3])
            more = f" and {len(run.seen) - 3} more" if len(run.seen) > 3 else ""
            return _with_leaves(fx_capture, run, [*steps, "auto: torch.export not tried: the model's own run shows "
                                                  f"forwards setting Python state its graph would not repeat ({what}"
                                                  f"{more})"])
        if drops:
            return _with_leaves(fx_capture, run, [*steps, "auto: torch.export not tried: an earlier export in this "
                                             "training mode would drop what modules of the class of "
                                             f"{_few(frozenset(p or '<this module>' for p in drops))} do"])
    try:
        exported = export.capture(module, inputs, policy.capture.export_timeout, sizes, drops)
    except export.ExportFailed as e:
        return _with_leaves(fx_capture, run, [*steps, *e.steps])
    past = export.changes_past_sizes(module, inputs, exported)
    if past is not None:  # a cache the forward grows for longer inputs: the graph would keep the short one
        seen, where = past
        if drops is not None:
            drops.update(seen)
        what = "; ".join(f"{p or 'the root module'!r}: {', '.join(w)}" for p, w in sorted(seen.items())[:3])
        return _with_leaves(fx_capture, run, [*steps, *exported.steps, f"torch.export's graph holds for {where} "
                                              f"only, and past that the model's own run sets Python state a graph "
                                              f"would not repeat ({what}): the graph is not used"])
    notes = (f"keep_modules: torch.export captured this module and inlines modules, so {_few(kept)} are not "
             "module boundaries (hooks registered on them do not fire; FSDP2 cannot shard them one by one); name them "
             "in keep_modules (the module then keeps its Python around them), or use tracer='fx' where it "
             "traces",) if kept else ()
    return dataclasses.replace(exported, steps=(*steps, *exported.steps), why="torch.export captured one graph",
                               notes=(*exported.notes, *notes))


def _graph_as_given(module: nn.Module) -> bool:
    """A graph module whose graph is taken as it is: it calls no submodule (nothing to keep as a leaf or boundary)
    and generates plain code (no pytree signature of its own to carry)."""
    return (isinstance(module, fx.GraphModule) and type(module.graph._codegen) is fx.graph.CodeGen
            and not any(n.op == "call_module" for n in module.graph.nodes))


def _few(paths: frozenset[str], n: int = 4) -> str:
    names = sorted(paths)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


@dataclass
class _ModelRun:
    """What the fx rung's real run of the model leaves for later: the modules it saw change Python state
    a graph would not repeat, and the check of a graph with leaves against that run (``None``: nothing to
    check), made only if that graph is kept (its own run, forward and backward, is half the check's time:
    MaxViT-nano, which exports, converted in 10.6 s instead of 11.7)."""

    seen: dict[str, tuple[str, ...]] = field(default_factory=dict)
    check: Callable[[], str | None] | None = None


def _with_leaves(fx_capture: Capture | None, run: _ModelRun, steps: list[str]) -> Capture | Uncaptured:
    """No single graph: the torch.fx graph with leaves if there is one and it reproduces the module, else none."""
    wrong = run.check() if fx_capture is not None and run.check is not None else None
    if wrong is not None:
        return Uncaptured((*steps, f"auto: {wrong}: the torch.fx graph with leaves is not kept either"))
    if fx_capture is None:
        return Uncaptured(tuple(steps))
    return dataclasses.replace(fx_capture, steps=(*steps, "kept the torch.fx graph with leaves"),
                               why="no single graph (torch.export failed or would drop something); the torch.fx "
                                   "graph with leaves reproduces the model's outputs, gradients and buffer updates "
                                   "on the example inputs")


def _on_rows(module: nn.Module, built: fx.GraphModule, inputs: ExampleInputs, run: _ModelRun) -> bool:
    """Does ``built`` reproduce ``module`` on the first rows of large example inputs (:meth:`ExampleInputs.rows`)?
    A torch.fx graph holds no size (a size is a proxy while tracing: Python that branches on one fails to trace),
    so where it agrees with the model on a cut of the batch it is accepted without the full batch's two runs,
    forward and backward (4096 tokens through seven 1024x4096 linears: 20 s of a conversion's 24 on a 2-core
    CPU). Anything else (the model does not run on the cut, or the two differ there) goes on to the check on the
    full example inputs, which decides."""
    small = inputs.rows()
    if small is None:
        return False
    try:
        want = reference(module, small, run.seen)
    except ExampleInputsError:
        return False
    return want is not None and compare(module, built, small, want) is None


def _fx_rung(module: nn.Module, policy: Policy, inputs: ExampleInputs | None, run: _ModelRun, check: bool,
             kept: frozenset[str] = frozenset(), named: frozenset[str] = frozenset(), into_wrapped: bool = True
             ) -> tuple[Capture | None, list[str], bool]:
    """torch.fx's capture and the steps so far. Without ``check`` the capture is
    accepted as traced (``tracer="fx"``, or no example inputs). With it, its ``why`` is
    set when it reproduces the module without leaves; a capture without ``why`` (it
    needed leaves) is kept only if torch.export fails; a graph that computes something
    else is never returned. The flag: may torch.export be tried next (not when a forward sets
    Python attributes, :attr:`Capture.python_state`). ``run`` gets what the model's real run showed, and
    the check of a graph with leaves, which waits until that graph is needed (:class:`_ModelRun`).

    Where the graph is checked, torch.fx traces into the functions ``torch.fx.wrap`` keeps whole
    (``into_wrapped``): an opaque function runs its GEMMs in float32. One it cannot trace stays whole and
    counts as a leaf does (torch.export, which traces into it, is tried first); a graph traced into them that
    does not reproduce the module is traced again with them whole."""
    try:
        # tracing runs the Python: the Watch puts back what it changes (`self.count += 1` on a real buffer); a
        # random draw is frozen
        with kept_random() as draws, kept_functorch():
            given = inputs.tensor_names(module.forward) if inputs is not None else None
            got = trace(module, policy, given, kept, named, into_wrapped=check and into_wrapped)
    except RootUntraceable as e:
        return None, [*e.steps, *(["auto: torch.fx could not trace this module's forward; trying torch.export"]
                                  if check else [])], True
    if got.dropped:  # seen while tracing, with or without example inputs
        return None, [*got.steps, f"{'auto' if check else 'fx'}: torch.fx would drop what the forward does "
                                  f"({'; '.join(got.dropped)}); "
                                  + ("trying torch.export" if check and not got.python_state
                                     else "the module keeps its Python")], not got.python_state
    if draws.drew or got.free_draws:  # a draw whose value the Python used (ampfx.capture.draws)
        which = f" ({'; '.join(got.free_draws)})" if got.free_draws else ""
        return None, [*got.steps, f"{FROZEN_DRAW}{which}{'; trying torch.export' if check else ''}"], True
    watched = "no grad-mode, autocast or autograd.Function region, buffer or attribute update seen while tracing"
    if not check:
        return dataclasses.replace(got, why=f"traced by torch.fx; {watched} (outputs not checked: tracer='fx' or "
                                            "no example inputs)"), list(got.steps), True
    built = graph_module(module, got.graph)
    if not (got.leaves or got.functions) and _on_rows(module, built, inputs, run):
        return dataclasses.replace(got, why=f"traced by torch.fx; {watched}; reproduces the model's outputs, "
                                            "gradients and buffer updates on the first rows of the example inputs "
                                            "(a torch.fx graph holds no size)", module=built), list(got.steps), True
    want = reference(module, inputs, run.seen)
    if got.leaves or got.functions:  # export comes next; this graph is checked only if it is kept
        run.check = (lambda: compare(module, built, inputs, want)) if want is not None else None
        opaque = [*sorted(got.leaves), *(f"function {f}" for f in got.functions)]
        return got, [*got.steps, f"auto: torch.fx needed leaves ({', '.join(opaque)}); trying "
                                 "torch.export for one graph"], not got.python_state
    wrong = compare(module, built, inputs, want) if want is not None else None
    if wrong is not None and got.traced_into:
        again, steps, exportable = _fx_rung(module, policy, inputs, run, check, kept, named, into_wrapped=False)
        return again, [*got.steps, f"auto: traced into torch.fx.wrap-ped functions, {wrong}; tracing again with "
                                   "them whole", *steps], exportable
    if wrong is None:
        return dataclasses.replace(got, why=f"traced by torch.fx; {watched}; reproduces the model's outputs, "
                                            "gradients and buffer updates on the example inputs", module=built), \
            list(got.steps), True
    return None, [*got.steps, f"auto: {wrong}; trying torch.export"], not got.python_state

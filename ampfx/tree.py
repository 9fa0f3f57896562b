"""Converting a module tree: the capture ladder applied module by module, as a loop.

:func:`convert_tree` keeps a stack of jobs, one per module to convert. A job
whose module captures as one graph (:func:`ampfx.capture.ladder.capture`)
becomes a converted graph module (:func:`ampfx.rewrite.convert_graph`); the
leaves inside it that have children of their own become jobs that keep
their Python and convert their children. A job whose module does not capture
(or whose graph does not run on its inputs) keeps its own Python too, and each
child it calls becomes a job. Containers (``ModuleList``, ``ModuleDict``, or
children never called themselves) are entered and their children converted.

Each job owns a :class:`_Part` of the report, placed in its parent's part in
the order the tree is visited, so the merged report reads top-down.

**The other training mode** is converted as converting the model in that mode
would: a captured module whose graph depends on the mode
(:func:`ampfx.capture.tracer.reads_mode`) runs, whenever it is in that mode, a
conversion of its model module in that mode (this same loop: capture ladder,
verification, modules kept eager), made when first needed: its first call in that mode,
``mode_module``, a pickle (:class:`ampfx.runtime.graph_module.PendingMode`,
:attr:`ampfx.runtime.entries.GraphPlan.other`); a conversion
whose root keeps its Python runs that Python. Inside a module that switches so,
nothing converts a second mode again.
"""
from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from . import libraries, ops, runtime
from .policy import module_match
from .capture import export, ladder
from .capture.base import Capture, Uncaptured
from .capture.tracer import AmpTracer, reads_mode
from .runtime import arming, handing
from .runtime.graph_module import AmpGraphModule, PendingMode
from .inputs import ExampleInputs
from .report import Report
from .report.records import Decision, Part, dtype_name
from .errors import NotReproduced
from .request import Request
from .observer import Observer
from .rewrite import DRY_RUN, convert_graph, device_of, kept_ends
from .passes import boundary, nodes
from .passes.context import Ends, Place
from .meta import AUTOCAST_HANDS, record
from .capture import observe as observing
from .capture.observe import Observation, observe
from .policy import Resolved
from .state import HOOK_DICTS, kept_requires_grad

log = logging.getLogger(__name__)


@dataclass
class _Part:
    """One module's share of the report: its own graph's report, its children's parts, and
    parts it records itself (after its children's, as :meth:`Report.merge` places them)."""

    report: Report | None = None
    children: list[_Part] = field(default_factory=list)
    parts: list[Part] = field(default_factory=list)


@dataclass
class Memo:
    """What one walk of the tree learns while it converts, for the captures after: each module path's
    export size try to start from (a module's other training mode starts where its first export ended:
    :func:`ampfx.capture.export.capture`), and by training mode the classes of modules whose forward
    torch.export found it would not repeat (a cache they fill): an export of a module around one of
    their kind in that mode is not tried again."""

    export_sizes: dict[str, list[int]] = field(default_factory=dict)
    export_drops: dict[bool, set[type]] = field(default_factory=dict)
    captures: dict[str, tuple[nn.Module, bool, Capture]] = field(default_factory=dict)
    """By module path: a kept module's capture its caller made to read its boundary (:func:`_kept_ends`),
    with the module and its training mode then, for that module's own job."""
    dry_runs: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    """By module path: the steps its caller ran on a copy of a kept module's graph to read its boundary (dry
    runs, :func:`ampfx.rewrite.kept_ends`), for that module's own report."""
    computed: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """By module path: the dtypes a converted graph computes its float outputs in (for the children of a
    module that keeps its Python that its outputs are moved to: :func:`_entered`)."""


@dataclass(frozen=True)
class _Job:
    module: nn.Module
    inputs: ExampleInputs | None
    prefix: str  # the module's path in the model, with a trailing dot ('' for the root)
    part: _Part
    place: tuple[nn.Module, str] | None = None  # where the converted module goes; None: it stays where it is
    eager: tuple[str, ...] | None = None  # set: the module keeps its Python (why); its children are converted
    other_mode: bool = True  # False: a module around it converts the other training mode for it
    arrive: torch.dtype | None = None  # a kept module: the dtype its float inputs and outputs cross its boundary in
    autocast_in: Any = None  # a kept module: the dtype torch.autocast would hand its float inputs in (reporting)
    # a child of a module that keeps its Python (observe.Links): whether its float outputs only reach other converted
    # children through moves (it returns them as computed), and the children's outputs its float inputs are moved from
    hands_on: bool = False
    fed_by: frozenset[tuple[str, int]] | None = None  # (module path with a trailing dot, float output index)
    keeps: frozenset[int] = frozenset()  # its float outputs returned in their original dtypes all the same (fanned out)


def convert_tree(root: nn.Module, request: Request) -> tuple[nn.Module, Report]:
    """Convert ``root`` (a private copy of the model) and every module below it that needs it."""
    return _tree(root, request, request.inputs, "", other_mode=True, memo=Memo())


def convert_module(work: nn.Module, request: Request, inputs: ExampleInputs | None, where: str,
                   arrive: torch.dtype | None, training: bool | None = None,
                   memo: Memo | None = None) -> tuple[nn.Module, Report]:
    """Convert ``work`` (a private copy of the model's module at ``where``) on its own, in its current
    training mode only: what a converted graph module makes again at a call when a value its graph fixed
    changed (:class:`ampfx.runtime.view.Reconvert`); ``arrive`` as :attr:`_Job.arrive`. With ``training``,
    ``work`` is converted in that mode, without its own hooks (they fire in the call of the converted module
    it stands in for): a converted module's other training mode, made when first needed
    (:class:`ampfx.runtime.graph_module.PendingMode`), with ``memo``, what the first mode's walk learnt."""
    if training is not None:
        with kept_requires_grad(work):  # the model's own train() (a norm_eval override keeps batch norm frozen)
            work.train(training)
        for hooks in HOOK_DICTS:
            getattr(work, hooks).clear()
    return _tree(work, request, inputs, f"{where}." if where else "", other_mode=False, arrive=arrive,
                 memo=memo if memo is not None else Memo())


def _tree(root: nn.Module, request: Request, inputs: ExampleInputs | None, prefix: str,
          other_mode: bool, *, memo: Memo, **boundary: Any) -> tuple[nn.Module, Report]:
    """:func:`convert_tree` of ``root``, which sits at ``prefix`` in the model and is called with ``inputs``
    (``boundary``: what its caller knows of its boundary, :attr:`_Job.arrive` and the fields after it)."""
    calls = _Observed(root, inputs, request.policy.dtype, prefix)
    top = _Part()
    stack = [_Job(root, inputs, prefix, top, other_mode=other_mode, **boundary)]
    result = root
    while stack:
        job = stack.pop()
        converted, more = (_eager(job, calls, request) if job.eager is not None
                           else _captured(job, calls, request, memo))
        if converted is not None and job.place is None:
            result = converted
        elif converted is not None:
            setattr(*job.place, converted)
        stack.extend(reversed(more))
    return result, _merge(top, request.policy.dtype)


def _capture(work: nn.Module, inputs: ExampleInputs | None, prefix: str, request: Request,
             memo: Memo) -> Capture | Uncaptured:
    """The capture ladder on ``work`` (at ``prefix``, called with ``inputs``), or the capture its caller
    made of it to read its boundary first (:func:`_kept_ends`)."""
    made = memo.captures.pop(prefix, None)
    if made is not None and made[0] is work and made[1] == work.training:
        return made[2]
    kept = kept_below(request.resolved, prefix)
    # a kept module named by the user, or one carrying hooks (torch.export would run them once, while tracing),
    # must stay a boundary: torch.export, which inlines modules, is not tried around it
    required = any(not why.startswith("keep_modules='auto'") or module_match.HOOKED in why
                for p, why in request.resolved.keep_matched or () if p[len(prefix):] in kept and p.startswith(prefix))
    known = memo.export_drops.setdefault(work.training, set())  # classes, in this training mode
    drops = {path for path, m in work.named_modules() if type(m) in known}
    named = request.resolved.below(prefix) if prefix else request.resolved.leaf_names
    capture = ladder.capture(work, request.policy, inputs, request.tracer, ladder.Bounds(kept, required, named),
                             sizes=memo.export_sizes.setdefault(prefix, [0]), drops=drops)
    known.update(type(work.get_submodule(p)) for p in drops)
    return capture


def _kept_ends(work: nn.Module, capture: Capture, job: _Job, calls: _Observed, request: Request,
               memo: Memo) -> dict[str, Ends]:
    """What each kept module ``work``'s graph calls once does at its boundary, read from its own graph
    before ``work``'s is painted (:func:`ampfx.rewrite.kept_ends`); its capture is kept for its own job."""
    found: dict[str, Ends] = {}
    for path in capture.kept:
        module = work.get_submodule(path)
        once = sum(n.op == "call_module" and n.target == path for n in capture.graph.nodes) == 1
        if not once or module_match.keeps_python(module) is not None:
            continue
        prefix = f"{job.prefix}{path}."
        inputs = calls.get(job.prefix + path) if job.inputs is not None else None
        made = _capture(module, inputs, prefix, request, memo)
        if isinstance(made, Uncaptured):
            continue
        memo.captures[prefix] = (module, module.training, made)
        seen = Observer(prefix.rstrip("."), label=DRY_RUN)
        ends = kept_ends(module, made, inputs, request, prefix, seen)
        memo.dry_runs[prefix] = seen.steps
        if ends is not None:
            found[path] = ends
    return found


def _captured(job: _Job, calls: _Observed, request: Request, memo: Memo) -> tuple[nn.Module | None, list[_Job]]:
    """Capture ``job.module``; its graph module and the jobs for its leaves that have children."""
    work, prefix = job.module, job.prefix
    capture = _capture(work, job.inputs, prefix, request, memo)
    if isinstance(capture, Uncaptured):
        return None, [dataclasses.replace(job, eager=capture.steps)]
    switches = job.other_mode and reads_mode(work, capture, request.policy)  # the other mode: when first needed
    if capture.constants:
        export.install_constants(work, capture.constants, capture.graph)
    inner = [path for path in capture.leaves if list(work.get_submodule(path).children())]
    calls.expect([prefix + path for path in (*inner, *capture.kept)])
    called = {path for path in inner if job.inputs is None or calls.get(prefix + path) is not None}
    try:
        place = Place(prefix, eager_leaves=frozenset(called), leaf_facts=calls.leaf_facts(work, prefix, job.inputs),
                      arrive=job.arrive, autocast_arrive=job.autocast_in,
                      kept_ends=_kept_ends(work, capture, job, calls, request, memo),
                      enter=(enter := _entered(job, memo)), hands_on=job.hands_on)
        gm, job.part.report = convert_graph(work, capture, job.inputs, request, place)
    except NotReproduced as e:  # the graph does not reproduce the module on its inputs: eager instead
        if not list(work.children()):
            raise e.__cause__ or e
        why = (*capture.steps, f"traced graph does not run on the example inputs: {e}")
        return None, [dataclasses.replace(job, eager=why)]
    dry = memo.dry_runs.pop(prefix, ())
    if dry:  # the dry runs its caller made of this graph, first in its report's steps
        report = job.part.report
        job.part.report = dataclasses.replace(report, steps=(*((prefix.rstrip("."), s, t) for s, t in dry),
                                                             *report.steps))
    ends = boundary.output_dtypes(gm)
    memo.computed[prefix] = tuple(original if k in job.keeps else computed for k, (original, computed) in enumerate(ends))
    if job.hands_on or enter is not None:  # handed low values by its siblings, or handing them its own
        arming.amend(gm, linked=handing.Linked(tuple(original for original, _ in ends) if job.hands_on else None,
                                               writes=_writes_inputs(gm), keeps=job.keeps))
    if switches:
        note = _other_mode(gm, job, capture, memo)
        job.part.report = dataclasses.replace(job.part.report, notes=(*job.part.report.notes, note))
    jobs = []
    for path in inner:
        if path in called:  # runs its own Python inside the graph: its children are converted
            part = _Part()
            job.part.children.append(part)
            jobs.append(_Job(work.get_submodule(path), calls.get(prefix + path), f"{prefix}{path}.", part,
                             eager=(f"traced as a leaf: {capture.leaves[path]}",),
                             other_mode=job.other_mode and not switches))
    return gm, jobs + [_kept_job(gm, path, job, calls, not switches) for path in capture.kept]


def _writes_inputs(gm: AmpGraphModule) -> bool:
    """Does ``gm``'s graph write into one of its inputs: into a placeholder, a view of one, or a cast of one (a
    cast to the dtype the input already has returns the input itself)?"""
    def aliased(node: Any) -> Any:
        while isinstance(node, torch.fx.Node) and node.args and isinstance(node.args[0], torch.fx.Node) and (
                node.target is runtime.cast or (isinstance(d := record(node), Decision) and ops.is_view(d.op))):
            node = node.args[0]
        return node
    return any(nodes.is_inplace(n, gm) and getattr(aliased(nodes.written(n)), "op", None) == "placeholder"
               for n in gm.graph.nodes if n.op != "placeholder")


def kept_below(resolved: Resolved, prefix: str) -> frozenset[str]:
    """The modules ``keep_modules`` keeps under the module at ``prefix``, as paths in that module."""
    return frozenset(p[len(prefix):] for p, _ in resolved.keep_matched or ()
                     if p.startswith(prefix) and len(p) > len(prefix))


def _kept_job(gm: AmpGraphModule, path: str, job: _Job, calls: _Observed, other_mode: bool) -> _Job:
    """The job converting the kept module at ``path`` in ``gm`` (a boundary its graph calls) on its own,
    in its place: ``gm.blocks[3]`` becomes block 3's graph module. A wrapper (a checkpoint wrapper) keeps its
    Python, and the module it wraps is converted in its place."""
    part = _Part()
    job.part.children.append(part)
    module = gm.get_submodule(path)
    parent, _, name = path.rpartition(".")
    inputs = calls.get(job.prefix + path) if job.inputs is not None else None
    arrive = boundary_dtype(gm, path)
    why = module_match.keeps_python(module)
    if why is not None:
        return _Job(module, inputs, f"{job.prefix}{path}.", part, eager=(why,), other_mode=job.other_mode and other_mode)
    calls_of = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == path]
    handed = calls_of[0].meta.get(AUTOCAST_HANDS) if len(calls_of) == 1 else None
    return _Job(module, inputs, f"{job.prefix}{path}.", part, place=(gm.get_submodule(parent), name),
                other_mode=job.other_mode and other_mode, arrive=arrive, autocast_in=handed)


def _entered(job: _Job, memo: Memo) -> torch.dtype | None:
    """The low dtype ``job``'s float inputs arrive in, where each is moved from an output of a child of
    the same module (converted before it) that its graph computes in that dtype; else ``None``."""
    if job.fed_by is None:
        return None
    dtypes = {memo.computed.get(path, ())[k:k + 1] for path, k in job.fed_by}
    low = dtypes.pop() if len(dtypes) == 1 else ()
    return low[0] if low and low[0] in (torch.float16, torch.bfloat16) else None


def boundary_dtype(gm: AmpGraphModule, path: str) -> torch.dtype:
    """The dtype ``gm``'s converted graph gives the kept module at ``path`` its float inputs in (and
    takes its outputs back in): the dtype its call was painted, float32 where it is not one low call."""
    calls = [record(n) for n in gm.graph.nodes if n.op == "call_module" and n.target == path]
    low = [d.dtype for d in calls if d is not None and d.dtype in (torch.float16, torch.bfloat16)]
    return low[0] if len(calls) == 1 and low else torch.float32


def _other_mode(gm: AmpGraphModule, job: _Job, capture: Capture, memo: Memo) -> str:
    """Make ``gm`` convert its model module in the other training mode when first needed, as
    ``ampfx.convert(model.train() / .eval())`` would, on the job's example inputs
    (:class:`~ampfx.runtime.graph_module.PendingMode`); the report's note. Converting it here would spend
    a second capture (a second export, often) on a mode many uses never call, or call only later."""
    training = not job.module.training
    name, path = ("train" if training else "eval"), job.prefix.rstrip(".") or "<root>"
    arming.amend(gm, other=PendingMode(training, job.inputs, memo))
    return (f"{path}: the model's Python reads self.training, so its {capture.method} graph holds one mode; in "
            f"{name} mode the module runs a second conversion, made as ampfx.convert(model.{name}()) makes it, "
            f"when first needed (its first call in {name} mode, .mode_module({training}), a pickle). The records "
            f"here are this mode's; .mode_module({training}).ampfx_report has that mode's")


def _eager(job: _Job, calls: _Observed, request: Request) -> tuple[None, list[_Job]]:
    """``job.module`` keeps its Python; a job for each child it calls (see the module docstring)."""
    prefix, part = job.prefix, job.part
    calls.expect([prefix.rstrip(".")])
    if job.arrive in (torch.float16, torch.bfloat16):  # a kept module its caller gives low values
        runtime.cross_in_float32(job.module, job.arrive)
        job = dataclasses.replace(job, eager=(*job.eager, f"kept, and keeps its Python: its {dtype_name(job.arrive)} "
                                              f"inputs are cast to float32 on entry and its float32 outputs back "
                                              f"to {dtype_name(job.arrive)}, the dtype its caller's graph reads"))
    log.info("ampfx: %s cannot be traced (%s); converting its children separately", prefix or "<root>",
             list(job.eager[-1:]))
    part.parts.append(Part(prefix.rstrip("."), "eager (children converted separately)", job.eager))
    jobs: list[_Job] = []

    def visit(parent: nn.Module, path: str) -> None:
        for name, child in list(parent.named_children()):
            sub, full = f"{path}{name}", f"{prefix}{path}{name}"
            inputs = calls.get(full)
            called = inputs is not None if job.inputs is not None else not isinstance(
                child, (nn.ModuleList, nn.ModuleDict))
            if not called and list(child.children()):
                visit(child, f"{sub}.")
            elif not called:
                part.parts.append(Part(full, "left as is: not called on the example inputs"))
            elif (leaf := libraries.convert_eager_leaf(job.module, sub, request.policy,
                                                          calls.facts_of(child, full, inputs), prefix,
                                                          device_of(child, inputs), request.resolved)) is not None:
                setattr(parent, name, leaf[0])  # another library's module: one leaf, run as its table says
                part.children.append(_Part(report=leaf[1]))
            elif (not list(child.children()) and type(child) not in ops.TRACE_THROUGH
                  and AmpTracer(request.policy, named=request.resolved.below(prefix)).is_leaf_module(child, sub)):
                part.parts.append(Part(full, "left as is: a single torch.nn leaf module called from eager code"))
            else:
                child_part = _Part()
                part.children.append(child_part)
                jobs.append(_Job(child, inputs, f"{full}.", child_part, place=(parent, name),
                                 other_mode=job.other_mode))

    visit(job.module, "")
    if request.policy.runtime.hand_low:
        jobs = _linked(job, jobs, calls)
    if any(j.hands_on for j in jobs):  # its Python sees float32 wherever it does more than move them
        handing.hand_on(job.module, request.policy.dtype)
    return None, jobs


def _linked(job: _Job, jobs: list[_Job], calls: _Observed) -> list[_Job]:
    """The jobs of the children of ``job``'s module, which keeps its Python, in the order it calls them, with
    what the observation run showed of the values they pass each other (:class:`ampfx.capture.observe.Links`).
    Where its Python moves the outputs of one into another, and keeps none of them past its call, every child
    returns its float outputs in the dtype it computes them in (but those two or more readers read: their
    gradients would be summed low), and a child whose float inputs are all so moved takes them in that dtype,
    where its sibling's graph computes them low (:func:`_entered`). The module's Python sees float32 wherever it does
    more than move them, at one cast a value, the cast the child's graph made before
    (:mod:`ampfx.runtime.handing`); so no boundary costs more than it did, and moved values cost none."""
    seen = calls.links(job.prefix.rstrip(".")) if job.inputs is not None and len(jobs) > 1 else None
    if seen is None:
        return jobs
    where = {j.prefix: j.prefix.rstrip(".") for j in jobs}
    if not seen.hands_on(set(where.values())):
        return jobs
    order = list(seen.calls)
    jobs = sorted(jobs, key=lambda j: order.index(where[j.prefix]) if where[j.prefix] in order else len(order))
    linked = []
    for j in jobs:
        fed_by = seen.fed_by(where[j.prefix])
        fed_by = None if fed_by is None else frozenset((f"{p}.", k) for p, k in fed_by)
        keeps = frozenset(k for p, k in seen.fanned if p == where[j.prefix])
        linked.append(dataclasses.replace(j, hands_on=True, fed_by=fed_by, keeps=keeps))
    return linked


class _Observed:
    """What the one real run of the model shows (:func:`ampfx.capture.observe.observe`), run the first
    time a job asks: what submodules receive first, and what other libraries' leaves see.

    The first ask always comes from the root's job, before any module of the tree has been
    replaced: for every module when the root keeps its Python (``expect([""])``), for the
    modules inside the root's leaves that keep theirs (``expect(paths)``), or only for other
    libraries' leaves (:meth:`leaf_facts`). Later asks are for modules inside that scope.
    """

    def __init__(self, root: nn.Module, inputs: ExampleInputs | None, dtype: torch.dtype, prefix: str = "") -> None:
        self.root, self.inputs, self.prefix = root, inputs, prefix  # root sits at prefix in the model
        self.watch = libraries.watched(root, dtype) if inputs is not None else {}
        self.seen: Observation | None = None
        self.scope: tuple[str, ...] = ()
        self.error: Exception | None = None

    def expect(self, paths: list[str]) -> None:
        """The modules at ``paths`` and below will ask what they received. A path outside what an
        earlier run recorded (the root's graph did not run on its inputs after its leaves were
        observed) means one more run, still before any module was replaced."""
        new = [p for p in paths if not self._covers(p)]
        if new:
            self.scope = (*self.scope, *new)
            self.seen = self.error = None

    def _covers(self, path: str) -> bool:
        return any(not s or path == s or path.startswith(s + ".") for s in self.scope)

    def _run(self) -> Observation:
        if self.seen is None and self.error is None and self.inputs is not None:
            try:
                seen = observe(self.root, self.inputs, watch=self.watch, calls=lambda p: self._covers(self._full(p)))
                self.seen = Observation({self._full(p): c for p, c in seen.calls.items()},
                                        {self._full(p): s for p, s in seen.seen.items()},
                                        {self._full(p): links.renamed(self._full) for p, links in seen.links.items()})
            except Exception as e:  # noqa: BLE001 - raised where the calls are needed, see get()
                self.error = e
        return self.seen or Observation()

    def _full(self, path: str) -> str:
        """A path under the observed root as a path in the model."""
        return f"{self.prefix}{path}" if path else self.prefix.rstrip(".")

    def links(self, path: str) -> observing.Links | None:
        """How the children of the module at ``path`` pass values through its Python (``None``: not seen)."""
        if self.inputs is None:
            return None
        return self._run().links.get(path)

    def get(self, path: str) -> ExampleInputs | None:
        """What the module at ``path`` received first (``None``: not called, or no example inputs)."""
        if self.inputs is None:
            return None
        seen = self._run()
        if self.error is not None:
            raise self.error
        return seen.calls.get(path)

    def leaf_facts(self, work: nn.Module, prefix: str, inputs: ExampleInputs | None) -> dict[str, object]:
        """What other libraries make of their leaves inside ``work`` (at ``prefix``)."""
        seen = self._run().seen if self.watch else {}
        return libraries.leaf_facts(work, inputs, seen, prefix)

    def facts_of(self, module: nn.Module, path: str, inputs: ExampleInputs | None) -> object:
        """What its library makes of the leaf ``module`` at ``path``, called with ``inputs``."""
        seen = self._run().seen if self.watch else {}
        return libraries.facts_of(module, seen.get(path, []), inputs) if inputs is not None else None


def _merge(part: _Part, dtype: torch.dtype) -> Report:
    """The report of ``part`` and everything below it, in visiting order."""
    children = [_merge(c, dtype) for c in part.children]
    if part.report is None:
        return Report.merge(dtype, children, parts=tuple(part.parts))
    if not children:
        return part.report
    own = part.report
    return Report.merge(dtype, [own, *children], shapes=own.shapes, notes=own.notes)

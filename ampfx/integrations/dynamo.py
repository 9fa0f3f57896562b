"""ampfx as a ``torch.compile`` backend: ``torch.compile(model, backend="ampfx")``.

Dynamo captures the model's Python as graphs, splits it where it cannot (a graph break: a ``print``, a
data-dependent branch, a call it does not trace) and guards each graph. Given as the backend, ampfx plans each
graph dynamo hands it with :func:`ampfx.plan`, the compiler half of :func:`ampfx.convert` (the same lists, rules,
casts and log, none of the converted module's runtime), and hands the converted graph to an inner backend
(inductor by default) to compile. Dynamo's guards decide when a graph is
captured again (a new shape, a changed attribute, the other training mode): that graph is converted again, so
nothing ampfx fixed while converting can go stale, and the converted graph needs none of :func:`ampfx.convert`'s
call-time checks.

>>> import torch, torch.nn as nn, ampfx
>>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2), nn.Softmax(-1))
>>> amp = ampfx.backend("bf16", inner="eager")        # or torch.compile(net, backend="ampfx"): bf16, inductor
>>> compiled = torch.compile(net, backend=amp)
>>> compiled(torch.randn(4, 8)).dtype                 # softmax stays float32, as convert keeps it
torch.float32
>>> [str(r.dtype) for g in amp.graphs for r in g.report.records if "softmax" in r.target]
['torch.float32']
>>> print(amp.summary())                              # each graph, and what stayed float32 in it and why
ampfx backend (bfloat16, inner eager): 1 graph
  graph 0/0: converted 3/4 nodes to bfloat16 using 5 casts (0 of weights) [return_value]
    float32: softmax 1 (deny list)

Under each graph's line, the summary holds the rest of that graph's :meth:`Report.summary
<ampfx.report.Report.summary>`: what stayed float32 and why, the GEMMs kept float32 as too small to pay on the
device (and the switch that lowers them), and, where no GEMM of the graph runs low, a line saying so, which each
such graph also gives as a warning when it is converted, as :func:`ampfx.convert` does.

Graph ends: a graph hands the Python after it (and the next graph) float32 values where the model's own are
float32, as a part of a model :func:`ampfx.convert` converts part by part does: dynamo traces the code after a break
as the user wrote it, before any backend sees it, so a low value there would meet float32 weights (where
``convert`` captures through the break, as ``torch.fx`` does through a ``print``, it saves that cast each way).

Graphs with nothing to convert: dynamo also hands a backend graphs that read no tensor (what follows a break made by
a value logged with ``.item()``, code that makes its tensors from constants) or hold no floating-point value (integer
and boolean tensors only). Such a graph goes to the inner backend as captured, and :meth:`Backend.summary` lists it
so (``graph 1/1: nothing to convert (no tensor input), handed to inductor as it is``).

Graph inputs: dynamo passes a module's parameters to its graph as inputs, so their casts are counted as casts of
inputs, not of weights, and each runs inside the compiled graph. ``AMPFX_*`` variables are read once, when the
backend is made (for ``backend="ampfx"``: at the first graph). ``ampfx.convert`` then ``torch.compile`` remains
the way to keep ampfx's call-time checks and a converted module to save; the backend is for models dynamo already
captures, graph breaks included.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import torch
import torch.fx as fx

from ..api import plan
from ..errors import ArgumentError
from ..report import Report
from ..report.records import Part
from ..policy import fp8 as fp8_vocabulary
from ..policy import from_env
from ..request import MODES, check_options, policy_of

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CompiledGraph:
    """One graph dynamo handed the backend: its compile id (``"0/0"``: frame 0, first compile; ``"0/1"``:
    that frame captured again after a guard failed), why dynamo ended it there, and ampfx's report of it
    (``converted=False``: it went to the inner backend as captured, and ``why`` says why; with
    ``nothing_to_convert``, because it holds nothing ampfx converts: :func:`_nothing_to_convert`)."""

    compile_id: str
    reason: str
    report: Report | None
    converted: bool = True
    why: str = ""
    nothing_to_convert: bool = False

    def line(self, inner: str = "the inner backend") -> str:
        """What the backend's summary says of this graph: a line, and under a converted graph the rest of its
        report's summary, indented (:meth:`Backend.summary`)."""
        head = f"graph {self.compile_id}"
        if self.nothing_to_convert:
            return (f"{head}: nothing to convert ({self.why}), handed to {inner} as it is"
                    + (f" [{self.reason}]" if self.reason else ""))
        if not self.converted:
            return f"{head}: left as captured ({self.why})"
        first, *details = _summary_of(self.report).splitlines()
        return "\n".join([f"{head}: {first.removeprefix('ampfx: ')}" + (f" [{self.reason}]" if self.reason else ""),
                          *(f"  {line}" for line in details)])


class Backend:
    """A ``torch.compile`` backend that converts each captured graph with ampfx, then compiles it with ``inner``
    (a backend name such as ``"inductor"``, ``"aot_eager"``, ``"eager"``, or a backend callable). ``dtype``,
    ``policy`` and the keyword options are :func:`ampfx.convert`'s; ``graphs`` lists every graph converted so far,
    recompiles included, and ``report`` merges their reports."""

    def __init__(self, dtype: Any = None, inner: str | Callable = "inductor", policy: Any = None, *,
                 mode: str = "train", environ: dict[str, str] | None = None, **options: Any) -> None:
        check_options("backend", options)
        if mode not in MODES:
            raise ArgumentError(f"backend(mode={mode!r}): mode is 'train' or 'inference'")
        if not (isinstance(inner, str) or callable(inner)):
            raise ArgumentError(f"backend(inner={inner!r}): give a torch.compile backend's name ('inductor', "
                                "'aot_eager', 'eager') or a backend callable")
        self.environ = dict(os.environ if environ is None else environ)  # read once, here
        resolved = from_env(policy_of("backend", dtype, policy, options), self.environ,
                            dtype_given=dtype is not None or policy is not None)
        _check_no_modules(resolved)
        self.dtype, self.log_path = resolved.dtype, resolved.log.log_path
        # each graph's conversion saves nothing: the backend saves every graph's report in one, after each graph
        self.environ.pop("AMPFX_LOG_PATH", None)
        options = {k: v for k, v in options.items() if k != "log_path"}
        policy = dataclasses.replace(policy, log_path=None) if policy is not None else None
        self.given_dtype, self.inner, self.policy, self.mode, self.options = dtype, inner, policy, mode, options
        self.graphs: list[CompiledGraph] = []

    def __repr__(self) -> str:
        return f"ampfx.backend({str(self.dtype).replace('torch.', '')!r}, inner={self._inner_name()!r})"

    def _inner_name(self) -> str:
        return self.inner if isinstance(self.inner, str) else getattr(self.inner, "__name__", repr(self.inner))

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        from torch._dynamo.backends.registry import lookup_backend
        compile_id = str(gm.meta.get("dynamo_compile_id", len(self.graphs)))
        cause = getattr(gm, "compile_subgraph_reason", None)
        reason = _words(cause)
        nothing = _nothing_to_convert(gm, example_inputs)
        if nothing is not None:
            log.debug("ampfx backend: graph %s has nothing to convert (%s): handed to %s as it is", compile_id,
                      nothing, self._inner_name())
            self.graphs.append(CompiledGraph(compile_id, reason, _as_it_is(self.dtype, gm, nothing), converted=False,
                                             why=nothing, nothing_to_convert=True))
            if self.log_path:
                self.report.save(self.log_path)
            return lookup_backend(self.inner)(gm, example_inputs)
        planned = plan(gm, self.given_dtype, example_inputs=_example(example_inputs), policy=self.policy,
                       tracer="fx", mode=self.mode, environ=self.environ, **self.options)
        report = planned.report
        if planned.graph is not None:
            graph = planned.graph
            graph.meta.update(gm.meta)
            self.graphs.append(CompiledGraph(compile_id, reason, report))
        else:  # the graph did not convert whole (its parts' steps say why): compiled as dynamo captured it
            why = ("conversion disabled (AMPFX_DISABLE / disable=True)" if report.disabled else
                   "; ".join(s for p in report.parts for s in p.steps[-1:]) or "not converted whole")
            log.warning("ampfx backend: graph %s is compiled as captured, without mixed precision: %s", compile_id, why)
            graph = gm
            self.graphs.append(CompiledGraph(compile_id, reason, report, converted=False, why=why))
        if self.log_path:
            self.report.save(self.log_path)
        return lookup_backend(self.inner)(graph, example_inputs)

    @property
    def report(self) -> Report:
        """Every converted graph's report in one, each graph a part named ``graph_<frame>_<compile>`` (its code in
        ``graph_before.graph_0_0.py`` when saved); each graph's own report: ``graphs[i].report``."""
        return Report.merge(self.dtype, [_labelled(g) for g in self.graphs if g.report is not None])

    def summary(self) -> str:
        """A line per graph: what ampfx converted, and why dynamo ended the graph there; under it, the lines of
        that graph's :meth:`Report.summary <ampfx.report.Report.summary>` (what stayed float32 and why, the GEMMs
        kept float32 as small with the switch that lowers them, a graph where no GEMM runs low), without the line
        every dynamo graph would repeat (captured as its own graph)."""
        n = len(self.graphs)
        head = (f"ampfx backend ({str(self.dtype).replace('torch.', '')}, inner {self._inner_name()}): "
                f"{n} graph{'s' if n != 1 else ''}")
        return "\n".join([head, *(f"  {g.line(self._inner_name())}" for g in self.graphs)])


def backend(dtype: Any = None, inner: str | Callable = "inductor", policy: Any = None, **options: Any) -> Backend:
    """A ``torch.compile`` backend converting each graph dynamo captures (:class:`Backend`)."""
    return Backend(dtype, inner, policy, **options)


_DEFAULT: list[Backend] = []


def default() -> Backend:
    """The backend ``torch.compile(model, backend="ampfx")`` uses: bfloat16 (or ``AMPFX_DTYPE``) and inductor,
    made at its first graph; its ``graphs`` and ``report`` gather every model compiled that way."""
    if not _DEFAULT:
        _DEFAULT.append(Backend())
    return _DEFAULT[0]


def ampfx_backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
    """``backend="ampfx"`` (registered through the ``torch_dynamo_backends`` entry point): :func:`default`."""
    return default()(gm, example_inputs)


_BY_MODULE = {"fp32_modules": "AMPFX_FP32_MODULES", "leaf_modules": "AMPFX_LEAF_MODULES",
              "fp8_modules": "AMPFX_FP8_MODULES", "fp8_skip_modules": "AMPFX_FP8_SKIP_MODULES"}


def _check_no_modules(policy: Any) -> None:
    """Options that name modules are refused: a graph dynamo hands a backend holds no modules (their parameters are
    its inputs), so such an option would match nothing there, or fail inside ``torch.compile``."""
    named = [f"{field} / {var} = {getattr(policy, field)!r}" for field, var in _BY_MODULE.items()
             if getattr(policy, field)]
    if policy.module_filter_fn is not None:
        named.append("module_filter_fn")
    if named:
        raise ArgumentError(f"backend(): {'; '.join(named)} names modules, and the graphs dynamo hands a backend hold "
                            "none (a module's parameters are graph inputs). Keep ops float32 by op instead "
                            "(denylist_add=[op] with its list's *_remove, or AMPFX_DENYLIST_ADD), or convert first "
                            "and compile the result: torch.compile(ampfx.convert(model, ..., fp32_modules=[...]))")
    recipe = fp8_vocabulary.recipe(policy.fp8)
    if recipe is not None and recipe.amax_history:
        raise ArgumentError(f"backend(): fp8={recipe.name!r} uses delayed scaling (amax_history={recipe.amax_history}), "
                            "whose amax history is state a converted module keeps between calls, and a graph handed "
                            "to a backend holds none. Use current scaling (fp8='tensorwise'), or convert first and "
                            "compile the result: torch.compile(ampfx.convert(model, ..., fp8=recipe))")


def _labelled(graph: CompiledGraph) -> Report:
    """``graph``'s report with its parts and code named after the graph (``graph_0_1``: frame 0, second compile)."""
    label = "graph_" + graph.compile_id.replace("/", "_").replace(" ", "_")
    name = lambda path: f"{label}.{path}" if path else label  # noqa: E731
    report = graph.report
    return dataclasses.replace(
        report, parts=tuple(dataclasses.replace(p, path=name(p.path), why=p.why or graph.reason) for p in report.parts),
        code_before={name(k): v for k, v in report.code_before.items()},
        code_after={name(k): v for k, v in report.code_after.items()})


def _summary_of(report: Report) -> str:
    """``report``'s summary without the capture line of a graph captured as it is (every graph dynamo hands the
    backend is: the line would say so for each); a capture with leaves or functions kept whole keeps its line."""
    parts = tuple(p for p in report.parts if not (p.method.startswith("fx") and not p.leaves and not p.functions))
    return dataclasses.replace(report, parts=parts).summary()


def _nothing_to_convert(gm: fx.GraphModule, example_inputs: list[Any]) -> str | None:
    """Why ``gm`` holds nothing ampfx converts (``None``: it may hold something): no tensor among its inputs (what
    dynamo captures after a break made by a value logged with ``.item()``, tensors made from constants alone), or,
    by the value dynamo recorded of every node (``example_value``), no floating-point tensor anywhere in it."""
    if not any(isinstance(x, torch.Tensor) for x in example_inputs):
        return "no tensor input"
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    if not all("example_value" in n.meta for n in nodes):
        return None  # not dynamo's record of every value: the conversion decides
    values = torch.utils._pytree.tree_leaves([n.meta["example_value"] for n in nodes])
    if not any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in values):
        return "no floating-point value"
    return None


def _as_it_is(dtype: torch.dtype, gm: fx.GraphModule, why: str) -> Report:
    """The report of a graph handed on as dynamo captured it, since it held nothing to convert (``why``)."""
    return Report(dtype, parts=(Part("", f"left as is: nothing to convert ({why})"),),
                  shapes=f"not converted: {why}", code_before={"": gm.code}, code_after={"": gm.code})


def _example(example_inputs: list[Any]) -> tuple | None:
    """The example inputs ampfx converts on: dynamo's, unless they are fake (no values to run on)."""
    from torch._subclasses.fake_tensor import FakeTensor
    if any(isinstance(x, FakeTensor) for x in example_inputs):
        return None
    return tuple(example_inputs)




def _words(cause: Any) -> str:
    """Why dynamo ended a graph, in its first line (``graph break: ...`` or dynamo's own word)."""
    if cause is None:
        return ""
    text = str(getattr(cause, "reason", cause)).strip().splitlines()
    first = text[0] if text else ""
    return f"graph break: {first}" if getattr(cause, "graph_break", False) else first

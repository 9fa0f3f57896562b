"""``ampfx.convert``: policy, capture, analyses, passes, report — one stage after another.

1. **request** — every argument checked, a frozen :class:`~ampfx.policy.Policy` from defaults,
   arguments and the ``AMPFX_*`` environment (read here, once), and what it means in the model,
   into one :class:`~ampfx.request.Request` (:func:`ampfx.request.build`);
2. **capture, analyses, passes** — per module of the tree, as the capture ladder
   decides (:func:`ampfx.tree.convert_tree`, :func:`ampfx.rewrite.convert_graph`),
   on a private copy of the module tree that shares the model's parameters;
3. **report** — one :class:`~ampfx.report.Report` for the whole model, saved where
   the policy says.
"""
from __future__ import annotations

import dataclasses
import operator
import os
import logging
import warnings
from collections import Counter
from typing import Any, Mapping

import torch
import torch.nn as nn

from .policy import module_match
from .runtime import arming, view, weight_cache
from .runtime.entries import plan_of
from . import ranks
from .errors import ENTRY_ERRORS, ArgumentError, PathError, PlanMismatchError, warn_user
from .policy.decide import check_tuned
from .runtime.follow import follow
from .runtime.graph_module import AmpGraphModule
from .runtime.inference import store_low
from .runtime.reads import reads
from .capture.base import copied_graph
from .inputs import ExampleInputs
from .policy import Policy
from .report import Report
from .ops import ENTRIES, Category, device_cost
from .report.records import Rule, dtype_name
from .request import Asked, Request, build, log_path_name, resolve
from .state import copy_tree, one_thread, origin_of, same_contents, untouched
from .threads import converting
from .tree import Memo, convert_module, convert_tree

log = logging.getLogger(__name__)


def convert(
    model: nn.Module,
    dtype: torch.dtype | str | None = None,
    example_inputs: Any = None,
    policy: Policy | None = None,
    *,
    dynamic_dims: dict[int, str] | None = None,
    tracer: str = "auto",
    mode: str = "train",
    calibrate: Any = None,
    calibrate_loss: Any = None,
    environ: Mapping[str, str] | None = None,
    **policy_options: Any,
) -> nn.Module:
    """Return a mixed-precision version of ``model`` with a decision log.

    ``dtype`` is ``torch.bfloat16`` (default), ``torch.float16``, ``"bf16"`` or
    ``"fp16"``. ``example_inputs`` (a tuple of positional inputs, a dict of
    keyword inputs, or one tensor) gives exact dtypes and shapes; without it,
    graph inputs are assumed float32 and casts check dtypes at run time.
    ``dynamic_dims`` (e.g. ``{0: "batch"}``) makes those dimensions of the
    example inputs symbolic, so size-based decisions hold for every size.
    ``tracer`` chooses how the model is captured: ``"fx"`` (``torch.fx``
    symbolic tracing, module structure kept), ``"export"`` (``torch.export``,
    an ATen-level graph; needs ``example_inputs``, see docs/export.md) or
    ``"auto"`` (default): fx, and export where fx fails, needs leaves, or
    its graph does not reproduce the model's outputs on ``example_inputs``.
    Whatever captures nothing falls back to converting the children.
    ``mode="inference"`` reads the weights of low-precision ops from low copies
    made once, and again only when a weight changes (see :mod:`ampfx.runtime.inference`);
    ``mode="train"`` (default) casts the float32 masters per op.
    ``calibrate`` (a few batches, each given like ``example_inputs``) runs the
    float32 model forward and backward first; nodes whose outputs or gradients
    would overflow the low dtype stay float32, and the report gives loss-scale
    advice (see :mod:`ampfx.passes.calibrate`). ``calibrate_loss(output)``
    makes the loss for the backward pass (default: the output if it is a
    scalar, else the mean of the outputs).
    ``policy`` or keyword options (the fields of :class:`ampfx.Policy`) choose
    the lists; the ``AMPFX_*`` environment variables are read once, here, and
    applied on top (``environ`` replaces ``os.environ``, for tests).

    The model is not changed, nor is the global random state: every run made
    during conversion is undone (parameter and buffer values, attributes set
    in ``forward``, the CPU, CUDA, Python and numpy random state, generators the
    model holds). The result is a view of the model (:mod:`ampfx.runtime.view`): its
    parameters, buffers, ``state_dict()``, hooks, modes and attributes are the
    model's (float32 master weights: an optimizer on either trains both), and it
    carries the log as ``result.ampfx_report``. What a change to the model or to
    the result does afterwards shows through: where a graph fixed a changed value
    while tracing, that graph's module is converted again at the next call
    (:mod:`ampfx.runtime.fixed`, bounded by ``reconvert_limit``); a change that cannot be
    followed makes the next call raise :class:`ampfx.errors.StaleModelError`
    naming it. Giving a converted module converts the model it is a view of.

    >>> import torch, ampfx
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> amp = ampfx.convert(net, torch.bfloat16)
    >>> amp(torch.randn(4, 8)).dtype, net[0].weight.dtype
    (torch.float32, torch.float32)
    >>> print(amp.ampfx_report.summary())
    ampfx: converted 3/3 nodes to bfloat16 using 5 casts (3 of weights)
    """
    given = model
    try:
        model = _model_of(model)
        request = build(model, Asked(dtype, example_inputs, policy, policy_options, dynamic_dims=dynamic_dims,
                                     tracer=tracer, mode=mode, calibrate=calibrate, calibrate_loss=calibrate_loss),
                        environ=environ)
    except ENTRY_ERRORS as e:  # the user's mistake, raised from here: the traceback ends at their call
        raise e.with_traceback(None) from None
    result = convert_request(model, request, given_a_view=given is not model)
    try:
        ranks.agree(model, result.ampfx_report.records)  # several processes: the same plan on each
    except PlanMismatchError as e:
        raise e.with_traceback(None) from None
    return result


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the compiler half of ampfx makes of a model (:func:`plan`): nothing in it runs ampfx's runtime.

    ``graph``: the converted graph as a plain ``torch.fx.GraphModule`` over the model's own parameters and buffers
    (``None`` where the model did not convert as one graph: its parts, in ``report.parts``, say why); ``report``: the
    decision log, as ``convert`` gives it; ``reads``: the dtype the graph reads each parameter in, by its path
    (the low dtype where every read is a cast to it, float32 where any read takes it as it is)."""

    graph: Any
    report: Report
    reads: Mapping[str, torch.dtype]


def plan(model: nn.Module, dtype: torch.dtype | str | None = None, example_inputs: Any = None,
         policy: Policy | None = None, *, tracer: str = "auto", mode: str = "train",
         environ: Mapping[str, str] | None = None, **policy_options: Any) -> Plan:
    """The dtype plan of ``model`` (an ``nn.Module``, or a ``torch.fx.GraphModule`` such as the graphs
    ``torch.compile`` hands a backend) as :func:`convert` makes it, the same lists, rules, casts and log, without
    the converted module's runtime (its view of the model, call-time checks, conversions made again, weight
    copies): a :class:`Plan` whose ``graph`` another compiler takes (ampfx's ``torch.compile`` backend hands it to
    inductor). The arguments are :func:`convert`'s.

    >>> import torch, ampfx
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Softmax(-1))
    >>> p = ampfx.plan(net, "bf16", example_inputs=(torch.randn(4, 8),), gemm_min_flops=0)
    >>> isinstance(p.graph, torch.fx.GraphModule), p.graph(torch.randn(4, 8)).dtype, dict(p.reads)
    (True, torch.float32, {'0.weight': torch.bfloat16, '0.bias': torch.float32})
    >>> p.graph.get_parameter("0.weight") is net[0].weight
    True
    """
    try:
        model = _model_of(model)
        request = build(model, Asked(dtype, example_inputs, policy, policy_options, tracer=tracer, mode=mode),
                        environ=environ)
    except ENTRY_ERRORS as e:
        raise e.with_traceback(None) from None
    return _plan(model, request)


@converting()
def _plan(model: nn.Module, request: Request) -> Plan:
    if request.policy.log.disable:  # AMPFX_DISABLE=1: nothing planned, the graph stays as it was captured
        return Plan(None, _disabled_copy(model, request).ampfx_report, {})
    work = copy_tree(model)  # shares the model's parameters and buffers: the graph reads them
    inputs = request.inputs.tensors() if request.inputs is not None else ()
    with untouched(model, *inputs), one_thread(model, *inputs):
        result, report = convert_tree(work, request)
    check_tuned(request.policy, report.records)
    notes = report.notes + _fp8_unused(request.policy, report) + nothing_low(request.policy.dtype, report)
    report = Report.merge(request.policy.dtype, [report], policy=_policy_log(request), shapes=report.shapes,
                          notes=notes)
    graph, table = None, {}
    if isinstance(result, AmpGraphModule):
        graph = torch.fx.GraphModule(_targets(result), copied_graph(result.graph), class_name=type(model).__name__)
        low = request.policy.dtype
        paths: dict[int, list[str]] = {}
        for n, p in result.named_parameters(remove_duplicate=False):  # a tied weight under each of its names
            paths.setdefault(id(p), []).append(n)
        for r in reads(result, low):
            for path in paths.get(id(r.param), ()):
                table[path] = low if r.takes(low) and table.get(path, low) == low else torch.float32
    _save(report, request.policy)
    return Plan(graph, report, table)


def _targets(gm: AmpGraphModule) -> dict[str, Any]:
    """What the converted graph's ``get_attr`` and ``call_module`` nodes name, by target: the model's own module
    where the conversion's copy of it was left as it was (so its training flag, hooks and attributes are the
    model's), else what the conversion made (a graph module of a kept part, a tensor it holds)."""
    found: dict[str, Any] = {}
    for node in gm.graph.nodes:
        if node.op not in ("get_attr", "call_module") or node.target in found:
            continue
        value = operator.attrgetter(node.target)(gm)
        origin = origin_of(value) if isinstance(value, nn.Module) and not isinstance(value, AmpGraphModule) else None
        found[node.target] = origin if origin is not None and type(origin) is type(value) and same_contents(
            origin._modules, value._modules) else value
    return found


@converting()
def convert_request(model: nn.Module, request: Request, *, given_a_view: bool = False) -> nn.Module:
    """:func:`convert` of ``model`` as ``request`` (:func:`ampfx.request.build`) asks; ``given_a_view``: the
    caller was given a converted module of ``model``, and the report says so. One conversion at a time in the
    process (:mod:`ampfx.threads`)."""
    mode = request.mode
    if request.policy.log.disable:
        return _disabled_copy(model, request)
    work = copy_tree(model)
    inputs = request.inputs.tensors() if request.inputs is not None else ()
    with untouched(model, *inputs), one_thread(model, *inputs):
        result, report = convert_tree(work, request)
    check_tuned(request.policy, report.records)
    result, views = view.rebase(result, model)
    follower = follow(model, views)
    arm = Arm(Again(dataclasses.replace(request, inputs=None), model), request.policy.runtime.reconvert_limit,
              follower, views)
    copies: dict[int, dict[str, Any]] = {}  # id(graph module) -> its weight copies
    notes = report.notes + (_store_low(views, request.policy.dtype, copies) if mode == "inference" else
                            _cache_weights(views, request.policy, copies))
    arm(views, copies)
    arming.arm(result, check=follower)
    if given_a_view:
        notes += ("the module given is a converted module, a view of its model: that model was converted",)
    notes += _fp8_unused(request.policy, report)
    notes += nothing_low(request.policy.dtype, report)
    report = Report.merge(request.policy.dtype, [report], policy=_policy_log(request), shapes=report.shapes,
                          notes=notes)
    result.ampfx_report = report
    _save(report, request.policy)
    return result


def nothing_low(dtype: torch.dtype, report: Report) -> tuple[str, ...]:
    """Where the converted graphs have GEMMs and none runs in the low dtype, a note saying so, why (by rule) and
    the switch, and the same as a warning: a plan with nothing low is never taken for a success.

    >>> import torch, ampfx
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> amp = ampfx.convert(m, "bf16", example_inputs=torch.randn(4, 8), gemm_min_flops=10**9)  # doctest: +SKIP
    >>> print(amp.ampfx_report.summary().splitlines()[-1])  # doctest: +SKIP
      no GEMM runs in bfloat16: 2 GEMM nodes stay float32 (cost:small-gemm 2); ...
    """
    gemms = [r for r in report.compute if r.op in ENTRIES and ENTRIES[r.op].category is Category.ALLOW]
    if not gemms or any(r.dtype == dtype for r in gemms) or report.gemms_low:
        return ()
    rules = Counter(r.rule for r in gemms)
    said = ", ".join(f"{rule.value} {n}" for rule, n in rules.most_common())
    if Rule.COST_LOW_SLOWER in rules:
        switch = (f"{dtype_name(dtype)} GEMMs were measured slower than float32 at every size on this device "
                  "(`ampfx device` shows the table): this plan is float32's, the fastest here; "
                  "AMPFX_GEMM_MIN_FLOPS=0 (gemm_min_flops=0) lowers them anyway")
    elif Rule.COST_SMALL_GEMM in rules:
        switch = ("each is under the device's break-even at the example inputs' sizes (give example inputs of the "
                  "size you train at, or `dynamic_dims`); AMPFX_GEMM_MIN_FLOPS=0 (gemm_min_flops=0) lowers them")
    else:
        switch = "each node's reason in the report says why"
    note = f"no GEMM runs in {dtype_name(dtype)}: {len(gemms)} GEMM node{'s' * (len(gemms) > 1)} stay float32 " \
           f"({said}); {switch}"
    warn_user(note)
    return (note,)


def _fp8_unused(policy: Policy, report: Report) -> tuple[str, ...]:
    """With ``fp8=`` and no GEMM put in FP8, a note saying why (by rule) and the same as a warning: asking for FP8
    and getting none is never silent."""
    if policy.fp8 is None:
        return ()
    rows = [r for r in report.records if r.fp8 is not None]
    if any(r.fp8.output for r in rows):
        return ()
    name = policy.fp8 if isinstance(policy.fp8, str) else policy.fp8.name
    why = Counter(r.fp8.rule.value for r in rows)
    said = (", ".join(f"{rule} {n}" for rule, n in why.most_common()) + " (the report's decisions say why, node by "
            "node: fp8_roofline='none' drops the cost rule, fp8_modules forces modules)") if rows else \
        "the converted graphs have no GEMM node (a module keeping its Python runs its own)"
    note = f"fp8={name!r} put no GEMM in FP8: {len(rows)} GEMM nodes stay in the low dtype: {said}"
    warn_user(note)
    return (note,)


@dataclasses.dataclass
class Again:
    """Converts a model module again as ``request`` asks, on the inputs of a call (``(args, kwargs)``) at path
    ``where`` of ``model``. The modules the policy names are found again in ``model`` as it is then (a module
    that got hooks since is kept as a boundary, as ``keep_modules="auto"`` keeps it). Pickled with a converted
    module (with the model: a loaded copy converts its own copy of the model again)."""

    request: Request
    model: nn.Module

    @converting()
    def __call__(self, module: nn.Module, call: tuple, where: str, arrive: torch.dtype | None,
                 training: bool | None = None, memo: Memo | None = None) -> tuple[nn.Module, Report]:
        request, args, kwargs = self.request, *call
        inputs = ExampleInputs.from_call(module, args, kwargs).snapshot()
        # tracer='export' inlines every module: a module hooked since conversion would run its hooks once, while
        # tracing; 'auto' keeps it a boundary where torch.fx captures the rest (the other mode's conversion
        # is the first conversion's other half: its tracer)
        tracer = "auto" if request.tracer == "export" and training is None else request.tracer
        req = dataclasses.replace(request, resolved=resolve(self.model, request.policy), inputs=inputs,
                                  dynamic_dims=request.dynamic_dims if not where else None, tracer=tracer)
        tensors = inputs.tensors()
        with untouched(module, *tensors), one_thread(module, *tensors):
            return convert_module(copy_tree(module), req, inputs, where, arrive, training, memo)


@dataclasses.dataclass
class Arm:
    """Arms each graph module of a conversion (:class:`~ampfx.runtime.view.Views`) from its plan, with what the
    view bound (what its graph fixed, its other training mode), its :class:`~ampfx.runtime.view.Reconvert` (by an
    :class:`Again`: the example inputs are not held, a conversion made again uses the inputs of the call that
    needs it) and its weight copies (``copies``; made here for a conversion made again at a call, as for the first:
    the training weight cache, or ``mode="inference"``'s low copies); a conversion made again at a call is watched
    by ``follower`` (the structure follower of the first conversion's views, ``first``). A pickled copy follows no
    structure."""

    again: Again
    limit: int
    follower: Any = None
    first: Any = None

    def __call__(self, made: view.Views, copies: dict[int, dict[str, Any]] | None = None) -> None:
        if made is not self.first and self.follower is not None:
            self.follower.watch(made)
        if copies is None:  # a conversion made again at a call: its weight copies as the first conversion's
            copies = {}
            request = self.again.request
            if request.mode == "inference":
                _store_low(made, request.policy.dtype, copies)
            else:
                _cache_weights(made, request.policy, copies)
        for gm, _ in made.graphs:
            arming.arm(gm, **made.bound.get(id(gm), {}), **(copies or {}).get(id(gm), {}),
                       reconvert=view.Reconvert(self.again, plan_of(gm).arrive, self.limit, self))

    def __getstate__(self) -> dict:
        return {"again": self.again, "limit": self.limit, "follower": None, "first": None}


def _model_of(module: nn.Module) -> nn.Module:
    """The model ``module`` stands for when it is a converted module (it is a view of it: converting it
    converts the model), else ``module``. A converted module loaded from a pickle stands for no model."""
    if not isinstance(module, nn.Module):
        return module
    model = module.__dict__.get("_ampfx_model") if isinstance(module, AmpGraphModule) else None
    if model is None and isinstance(module, view.Mirror):
        model = module._ampfx_model
    if model is None and isinstance(module, AmpGraphModule):
        raise ArgumentError("this converted module was loaded from a copy (pickle, torch.save) and stands for no "
                            "model: convert the model itself (ampfx.convert(model, ...))")
    return model if model is not None else module


def _save(report: Report, policy: Policy) -> None:
    """The report saved where ``log_path`` / ``AMPFX_LOG_PATH`` says (checked before the conversion,
    :func:`ampfx.request.build`); a place that fails while it is written is named."""
    if not policy.log.log_path:
        return
    try:
        report.save(policy.log.log_path)
    except OSError as e:
        raise PathError(f"{log_path_name(policy)}: cannot write the report there ({e.strerror or e}); give a "
                        "writable directory") from None


def _disabled_copy(model: nn.Module, request: Request) -> nn.Module:
    """``AMPFX_DISABLE=1``: an unconverted copy, and a report that says so."""
    policy = request.policy
    copy = copy_tree(model)
    copy.ampfx_report = Report(dtype=policy.dtype, disabled=True, policy=_policy_log(request),
                               notes=("conversion disabled: the model is an unconverted copy",))
    log.info("ampfx disabled: returning an unconverted copy")
    _save(copy.ampfx_report, policy)
    return copy


def _store_low(views: view.Views, dtype: torch.dtype, armed: dict[int, dict[str, Any]]) -> tuple[str, ...]:
    """``mode="inference"``: the weights of low-precision ops read from low copies (:mod:`ampfx.runtime.inference`),
    each graph module's put in ``armed``; the note saying so."""
    count = nbytes = 0
    for gm in _graphs(views):
        copies = armed.setdefault(id(gm), {})["weights"] = store_low(gm, dtype)
        # the graph reads those copies now, not the parameters: its plan's table says so
        copied = {e.path for e in copies.entries}
        arming.amend(gm, reads=tuple(u for u in plan_of(gm).reads if u.path not in copied))
        count, nbytes = count + len(copies.entries), nbytes + copies.nbytes()
    return (f"inference mode: {count} weights read from {dtype_name(dtype)} copies made once ({nbytes:,} bytes beside "
            "the model's float32 weights) and made again only when a weight changes",)


def _cache_weights(views: view.Views, policy: Policy, armed: dict[int, dict[str, Any]]) -> tuple[str, ...]:
    """Training mode: each weight a low op reads cast once per change of its master (:mod:`ampfx.runtime.weight_cache`):
    every one (``weight_cache=True``), those the device's costs and the calls decide (``"auto"``) or none, each graph
    module's cache put in ``armed``; the note saying which."""
    how = policy.runtime.weight_cache
    if how is False:
        return ("weight cache: off: weights are cast at every forward, as autocast casts them (weight_cache=True or "
                "AMPFX_WEIGHT_CACHE=1 keeps low copies between steps)",)
    graphs = _graphs(views)
    auto_from = where = None
    if how == "auto":
        device = next((p.device for gm in graphs for p in gm.parameters()), torch.device("cpu"))
        auto_from, where = device_cost.cache_limit(device, policy.dtype, policy.gemm_min_flops)
    count = numel = large = 0
    for gm in graphs:
        weights = weight_cache.cast_weights(gm, policy.dtype)
        count += len(weights)
        cache = weight_cache.cache_for(gm, policy.dtype, auto_from, weights)
        if cache is None:
            continue
        armed.setdefault(id(gm), {})["weights"] = cache
        chosen = cache.entries if cache.auto is None else cache.auto.large
        large += len(chosen)
        numel += sum(e.owner[e.name].numel() for e in chosen)
    nbytes = numel * torch.finfo(policy.dtype).bits // 8
    if how == "auto":
        return (f"weight cache: auto: {large} of {count} cast weights are large enough that a cached "
                f"{dtype_name(policy.dtype)} copy pays (from {auto_from:,} elements, {where}); they are cached while "
                f"a graph runs more than once between weight updates (gradient accumulation, recompute, evaluation; "
                f"up to {nbytes:,} bytes), and cast at every forward otherwise (weight_cache=True caches every "
                "weight always, False none: ampfx.runtime.weight_cache)",)
    return (f"weight cache: on, {count} weights cast to {dtype_name(policy.dtype)} once per change of their float32 "
            f"masters and reused by every forward, backward and recompute ({nbytes:,} bytes held between steps; "
            "off inside FSDP2 and torch.compile: ampfx.runtime.weight_cache)",)


def _graphs(views: view.Views) -> list[AmpGraphModule]:
    """The graph modules of the converted tree (not the other training mode's, made later), each once."""
    seen: dict[int, AmpGraphModule] = {}
    for gm, _ in views.graphs:
        seen.setdefault(id(gm), gm)
    return list(seen.values())


def _policy_log(request: Request) -> dict[str, Any]:
    """The report's record of the policy: every field of what was asked (:class:`~ampfx.policy.Policy`; the list
    edits under ``edits``) and what it was resolved to in the model (:class:`~ampfx.request.Resolved`)."""
    policy = request.policy
    edits = {f.name: list(getattr(policy, f.name)) for f in policy.option_fields()
             if f.name.endswith(("_add", "_remove")) and getattr(policy, f.name)}
    out: dict[str, Any] = {"dtype": dtype_name(policy.dtype), "edits": edits}
    for f in policy.option_fields():
        if f.name != "dtype" and not f.name.endswith(("_add", "_remove")) and f.name != "user_ops":
            out[f.name] = _logged(f.name, getattr(policy, f.name))
    out["pad_multiple"] = policy.pad_multiple or 8
    return {**out, **request.resolved.as_json()}


def _logged(name: str, value: Any) -> Any:
    """A policy field's value as the report's JSON holds it."""
    if name in ("fp32_modules", "keep_modules"):
        return [module_match.describe(e) for e in value]
    if name in ("tuned", "env"):
        return dict(value)
    if name == "origins":
        return {f"{f}:{n}": s for (f, n), s in value}
    if isinstance(value, tuple):
        return [str(v) for v in value]
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    return str(value) if isinstance(value, os.PathLike) else value

"""``ampfx.convert``: policy, trace, shapes, passes, report."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import os
from typing import Any, Mapping

import torch
import torch.nn as nn

from . import integrations
from . import policy as policy_mod
from .meta import leaf_param_casts, record
from .passes import PIPELINE, PassContext, shapes
from .policy import Policy, PolicyError
from .report import CastInfo, Decision, Region, Report
from .state import modes
from .capture import export as export_mod
from .capture.base import Capture
from .capture.tracer import RootUntraceable, trace, trace_other_mode
from .capture.verify import reproduces
from .graph_module import AmpGraphModule, graph_module
from .state import copy_tree

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
    ``mode="inference"`` stores the weights of low-precision ops in the low
    dtype once, in the converted module only (see :mod:`ampfx.inference`);
    ``mode="train"`` (default) keeps float32 masters shared with ``model``.
    ``calibrate`` (a few batches, each given like ``example_inputs``) runs the
    float32 model forward and backward first; nodes whose outputs or gradients
    would overflow the low dtype stay float32, and the report gives loss-scale
    advice (see :mod:`ampfx.passes.calibrate`). ``calibrate_loss(output)``
    makes the loss for the backward pass (default: the output if it is a
    scalar, else the mean of the outputs).
    ``policy`` or keyword options (the fields of :class:`ampfx.Policy`) choose
    the lists; the ``AMPFX_*`` environment variables are read once, here, and
    applied on top (``environ`` replaces ``os.environ``, for tests).

    The model is not changed. The result shares its parameters and buffers
    (float32 master weights: an optimizer on either trains both), has the
    same ``state_dict()`` keys, shapes and dtypes, and carries the log as
    ``result.ampfx_report``.

    >>> import torch, ampfx
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> amp = ampfx.convert(net, torch.bfloat16)
    >>> amp(torch.randn(4, 8)).dtype, net[0].weight.dtype
    (torch.float32, torch.float32)
    >>> print(amp.ampfx_report.summary())
    ampfx: converted 3/3 nodes to bfloat16 using 5 casts (3 of weights)
    """
    if policy is None:
        policy = Policy(dtype=dtype if dtype is not None else torch.bfloat16, **policy_options)
    else:
        if policy_options:
            raise TypeError(f"pass either policy= or policy options, not both: {sorted(policy_options)}")
        if dtype is not None and policy_mod.parse_dtype(dtype) != policy.dtype:
            raise PolicyError(f"dtype={dtype!r} disagrees with policy.dtype={policy.dtype}; give one of them")
    policy = policy_mod.from_env(policy, os.environ if environ is None else environ)
    _check_module_names(model, policy)
    if policy.disable:
        copy = copy_tree(model)
        copy.ampfx_report = Report(dtype=policy.dtype, disabled=True, policy=_policy_log(policy),
                                   notes=("conversion disabled: the model is an unconverted copy",))
        log.info("ampfx disabled: returning an unconverted copy")
        if policy.log_path:
            copy.ampfx_report.save(policy.log_path)
        return copy
    if mode not in ("train", "inference"):
        raise PolicyError(f"mode={mode!r}: use 'train' (float32 master weights) or 'inference' "
                          "(weights stored in the low dtype once)")
    if tracer not in ("auto", "fx", "export"):
        raise ValueError(f"tracer={tracer!r}: use 'auto' (torch.fx, then torch.export where fx fails), 'fx' or "
                         "'export'")
    if tracer == "export" and example_inputs is None:
        raise TypeError("tracer='export' runs the model on example_inputs: give example_inputs=(x,) (or a dict "
                        "of keyword inputs), or use tracer='fx'")
    if tracer == "export" and export_mod.unavailable():
        raise RuntimeError(export_mod.unavailable())
    if dynamic_dims and example_inputs is None:
        raise TypeError("dynamic_dims names dimensions of example_inputs; give example_inputs too")
    calib = (list(calibrate), calibrate_loss) if calibrate is not None else None
    if calib is not None and example_inputs is None and calib[0]:
        example_inputs = calib[0][0]
    result, report = _convert(copy_tree(model), policy, example_inputs, prefix="", dynamic_dims=dynamic_dims,
                              calib=calib, tracer=tracer)
    notes = report.notes
    if mode == "inference":
        from .inference import store_low

        count, before, after = 0, 0, 0
        for gm in [m for m in result.modules() if isinstance(m, AmpGraphModule)]:
            c, b, a = store_low(gm, policy.dtype)
            count, before, after = count + c, before + b, after + a
        total_before = sum(p.numel() * p.element_size() for p in model.parameters())
        total_after = sum(p.numel() * p.element_size() for p in result.parameters())
        notes += (f"inference mode: {count} parameters stored in {str(policy.dtype)[6:]} once; parameter bytes "
                  f"{total_before:,} -> {total_after:,} (saved {total_before - total_after:,})",)
    report = Report.merge(policy.dtype, [report], policy=_policy_log(policy), shapes=report.shapes,
                          notes=notes)
    result.ampfx_report = report
    if policy.log_path:
        report.save(policy.log_path)
    return result


def _device_of(model: nn.Module, example_inputs: Any) -> str:
    for p in model.parameters():
        return p.device.type
    for t in torch.utils._pytree.tree_leaves(example_inputs):
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"


def _given_args(model: nn.Module, example_inputs: Any) -> set[str] | None:
    if example_inputs is None:
        return None
    import inspect

    params = list(inspect.signature(model.forward).parameters)
    if isinstance(example_inputs, dict):
        given = example_inputs
    elif isinstance(example_inputs, (tuple, list)):
        given = dict(zip(params, example_inputs))
    else:
        given = {params[0]: example_inputs} if params else {}
    # only tensor-valued arguments stay symbolic; None, flags and sizes may be fixed at their defaults
    return {k for k, v in given.items()
            if any(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(v))}


def _capture(work: nn.Module, policy: Policy, example_inputs: Any, tracer: str) -> Capture | list[str]:
    """Capture ``work`` as one graph with ``tracer``, or the steps tried when nothing captured it.

    ``"auto"``: torch.fx first; if the root does not trace, if modules had to
    become leaves, or if the fx graph does not reproduce the eager outputs on
    the example inputs, torch.export. An fx capture with leaves that still
    reproduces the model is kept when export fails.
    """
    steps: list[str] = []
    fx_capture = None
    if tracer != "export":
        try:
            fx_capture = trace(work, policy, _given_args(work, example_inputs))
        except RootUntraceable as e:
            steps = [*e.steps]
            if tracer == "fx" or example_inputs is None:
                return steps
            steps.append("auto: torch.fx could not trace this module's forward; trying torch.export")
        else:
            if tracer == "fx" or example_inputs is None:
                return fx_capture
            wrong = reproduces(work, fx_capture.graph, example_inputs)
            if wrong is None and not fx_capture.leaves:
                return fx_capture
            steps = [*fx_capture.steps, f"auto: {wrong}; trying torch.export" if wrong is not None else
                     f"auto: torch.fx needed leaves ({', '.join(sorted(fx_capture.leaves))}); trying torch.export "
                     "for one graph"]
            if wrong is not None:
                fx_capture = None  # a graph that computes something else is never used
    try:
        ex = export_mod.capture(work, example_inputs)
    except export_mod.ExportFailed as e:
        if fx_capture is not None:
            fx_capture.steps = [*steps, *e.steps, "kept the torch.fx graph with leaves"]
            return fx_capture
        return [*steps, *e.steps]
    return Capture(graph=ex.graph, method="export", steps=[*steps, *ex.steps], mode_graphs=ex.mode_graphs,
                   constants=ex.constants, notes=ex.notes, mode_error=ex.mode_error)


def _convert(work: nn.Module, policy: Policy, example_inputs: Any, prefix: str,
             dynamic_dims: dict[int, str] | None = None, calib: Any = None,
             tracer: str = "auto") -> tuple[nn.Module, Report]:
    """Convert ``work`` (already a private copy); falls back region by region."""
    capture = _capture(work, policy, example_inputs, tracer)
    if isinstance(capture, list):
        return _convert_children(work, policy, example_inputs, prefix, capture, tracer)
    if capture.constants:
        export_mod.install_constants(work, capture.constants)
    # modules that failed to trace run their own Python, with their children converted
    inner = [path for path in capture.leaves if list(work.get_submodule(path).children())]
    inner_inputs = _submodule_inputs(work, example_inputs, inner)
    parts = []
    for path in inner:
        sub = work.get_submodule(path)
        if example_inputs is not None and path not in inner_inputs:
            continue
        converted, rep = _convert_children(sub, policy, inner_inputs.get(path), f"{prefix}{path}.",
                                           [f"traced as a leaf: {capture.leaves[path]}"], tracer)
        parts.append(rep)
    gm = graph_module(work, capture.graph)
    before = gm.code
    shape_note = Report.__dataclass_fields__["shapes"].default
    notes: list[str] = list(capture.notes)
    if capture.method == "export" and (policy.leaf_modules or any(not isinstance(o, str) for o, _ in policy.user_ops)):
        notes.append("torch.export traces through leaf_modules and the modules and functions named on a list: on "
                     "this exported graph their ops are decided one by one (tracer='fx' keeps them whole)")
    symbols = None
    if example_inputs is not None:
        try:
            _, shape_note, symbols = shapes.propagate(gm, example_inputs, dynamic_dims)
        except ValueError as e:  # the graph does not reproduce the module on its inputs: a region instead
            if not list(work.children()):
                raise
            return _convert_children(work, policy, example_inputs, prefix,
                                     [*capture.steps, f"traced graph does not run on the example inputs: {e}"],
                                     tracer)
    ctx = PassContext(policy=policy, device=_device_of(work, example_inputs), prefix=prefix,
                      leaf_facts=integrations.observe(work, example_inputs, policy.dtype),
                      leaves=dict(capture.leaves), symbols=symbols,
                      regions=frozenset(p for p in inner if p in inner_inputs or example_inputs is None))
    if calib is not None:
        from .passes import calibrate as calibration

        seen = calibration.record(gm, calib[0], calib[1], policy.dtype)
        notes.append(f"calibration: {seen} batches, forward and backward")
        advice = calibration.loss_scale_advice(gm, policy.dtype)
        if advice:
            notes.append(advice)
    _run_passes(gm, ctx)
    try:
        if capture.method == "export":  # exported once per mode already
            other = (capture.mode_graphs or {}).get(not work.training)
        else:
            other = trace_other_mode(work, policy, capture)
    except Exception as e:  # noqa: BLE001 - this mode's graph only; the other mode raises, saying what to do
        other = None
        missing = "eval" if work.training else "train"
        gm.set_mode_graph(not work.training, export_mod.ModeUnavailable(not work.training, str(e), "torch.fx"))
        notes.append(f"the model reads self.training but could not be traced in {missing} mode ({e}); the "
                     f"converted module raises in {missing} mode: convert model.{missing}() for that")
    if other is not None:
        alt = graph_module(work, other)
        alt.training = not work.training  # its own flag only: the module tree is shared
        if example_inputs is not None:
            shapes.propagate(alt, example_inputs, dynamic_dims)
        _run_passes(alt, dataclasses.replace(ctx))
        gm.set_mode_graph(not work.training, alt)
        notes.append(f"the model's Python reads self.training: a second graph for "
                     f"{'eval' if work.training else 'train'} mode was converted and runs whenever the module is "
                     "in that mode (the records here are the conversion-time mode's)")
    if capture.mode_error is not None:
        missing = "eval" if work.training else "train"
        gm.set_mode_graph(not work.training, export_mod.ModeUnavailable(not work.training, capture.mode_error))
        notes.append(f"torch.export failed on the model in {missing} mode ({capture.mode_error}); the converted "
                     f"module raises in {missing} mode: convert model.{missing}() for that")
    records, casts = [], []
    for node in gm.graph.nodes:
        rec = record(node)
        if isinstance(rec, CastInfo):
            casts.append(rec)
        elif isinstance(rec, Decision):
            records.append(rec)
    if capture.fixed_args:
        notes.append("optional arguments fixed at their defaults while tracing (the converted module asserts "
                      f"them): {', '.join(f'{k}={v!r}' for k, v in capture.fixed_args.items())}")
    region = Region(path=prefix.rstrip("."), method=capture.method, steps=tuple(capture.steps),
                    leaves=tuple(capture.leaves.items()))
    report = Report(dtype=policy.dtype, records=tuple(records), casts=tuple(casts), regions=(region,),
                    leaf_param_casts=leaf_param_casts(gm), shapes=shape_note,
                    code_before={prefix.rstrip("."): before}, code_after={prefix.rstrip("."): gm.code},
                    notes=tuple(notes))
    if parts:
        report = Report.merge(policy.dtype, [report, *parts], shapes=shape_note, notes=tuple(notes))
    return gm, report


def _run_passes(gm: AmpGraphModule, ctx: PassContext) -> None:
    """The pipeline, then lint and one recompile; fake tensors leave the meta (deepcopy, pickling)."""
    for pass_ in PIPELINE:
        pass_(gm, ctx)
    gm.graph.lint()
    gm.recompile()
    for node in gm.graph.nodes:
        for key in ("val", "tensor_meta"):
            node.meta.pop(key, None)


def _submodule_inputs(work: nn.Module, example_inputs: Any, paths: list[str]) -> dict[str, Any]:
    """Run the model once (eval, no grad) and record what each named submodule
    receives first, as positional tuples or keyword dicts."""
    if example_inputs is None or not paths:
        return {}
    seen: dict[str, Any] = {}
    hooks = []
    for path in paths:
        def hook(mod, args, kwargs, path=path):
            if path not in seen:  # a snapshot: the forward may mutate what it passed (caches)
                seen[path] = _snapshot((args, kwargs))
        hooks.append(work.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with modes(work, training=False), torch.no_grad():
            if isinstance(example_inputs, dict):
                work(**example_inputs)
            elif isinstance(example_inputs, (tuple, list)):
                work(*example_inputs)
            else:
                work(example_inputs)
    finally:
        for h in hooks:
            h.remove()
    return {p: (args if not kwargs else {**dict(zip(_param_names(work.get_submodule(p)), args)), **kwargs})
            for p, (args, kwargs) in seen.items()}


def _snapshot(value: Any) -> Any:
    """A copy of recorded inputs that later in-place changes cannot reach."""
    try:
        return copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - uncopyable objects: keep the live reference
        return value


def _param_names(m: nn.Module) -> list[str]:
    import inspect

    return list(inspect.signature(m.forward).parameters)


def _convert_children(work: nn.Module, policy: Policy, example_inputs: Any, prefix: str,
                      steps: list[str], tracer: str = "auto") -> tuple[nn.Module, Report]:
    """``work``'s own ``forward`` cannot be traced: keep it eager and convert
    each child it calls. Containers (``ModuleList``, ``ModuleDict``, or
    children never called themselves) are entered and their children
    converted instead."""
    from .capture.tracer import TRACE_THROUGH, AmpTracer

    log.info("ampfx: %s cannot be traced (%s); converting its children separately", prefix or "<root>", steps[-1:])
    inputs = _submodule_inputs(work, example_inputs, [n for n, _ in work.named_modules() if n])
    parts: list[Report] = []
    regions = [Region(prefix.rstrip("."), "eager (children converted separately)", tuple(steps))]

    def visit(parent: nn.Module, path: str) -> None:
        for name, child in list(parent.named_children()):
            sub = f"{path}{name}"
            called = sub in inputs if example_inputs is not None else not isinstance(
                child, (nn.ModuleList, nn.ModuleDict))
            if not called and list(child.children()):
                visit(child, f"{sub}.")
            elif not called:
                regions.append(Region(f"{prefix}{sub}", "left as is: not called on the example inputs"))
            elif (leaf := integrations.convert_eager_leaf(work, sub, policy, inputs.get(sub), prefix,
                                                          _device_of(child, inputs.get(sub)))) is not None:
                setattr(parent, name, leaf[0])  # a DGL module: one leaf, run as its library's table says
                parts.append(leaf[1])
            elif (not list(child.children()) and AmpTracer(policy).is_leaf_module(child, sub)
                  and type(child) not in TRACE_THROUGH):
                regions.append(Region(f"{prefix}{sub}", "left as is: a single torch.nn leaf module called "
                                                        "from eager code"))
            else:
                converted, rep = _convert(child, policy, inputs.get(sub), prefix=f"{prefix}{sub}.", tracer=tracer)
                setattr(parent, name, converted)
                parts.append(rep)

    visit(work, "")
    return work, Report.merge(policy.dtype, parts, regions=tuple(regions))


def _check_module_names(model: nn.Module, policy: Policy) -> None:
    names = [n for n, _ in model.named_modules() if n]
    for prefix in policy.fp32_modules:
        if not any(n == prefix or n.startswith(prefix + ".") for n in names):
            close = difflib.get_close_matches(prefix, names, n=3, cutoff=0.5)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise PolicyError(f"fp32_modules / AMPFX_FP32_MODULES names {prefix!r}, which is not a module of "
                              f"{type(model).__name__}.{hint}")
    for leaf in policy.leaf_modules:
        if isinstance(leaf, str) and leaf not in names:
            close = difflib.get_close_matches(leaf, names, n=3, cutoff=0.5)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise PolicyError(f"leaf_modules / AMPFX_LEAF_MODULES names {leaf!r}, which is neither a module "
                              f"of {type(model).__name__} nor an importable module type.{hint}")


def _policy_log(policy: Policy) -> dict[str, Any]:
    edits = {}
    for f in ("allowlist", "inferlist", "clearlist", "denylist"):
        for a in ("add", "remove"):
            v = getattr(policy, f"{f}_{a}")
            if v:
                edits[f"{f}_{a}"] = list(v)
    return {"dtype": str(policy.dtype).replace("torch.", ""), "edits": edits,
            "reduction_threshold": policy.reduction_threshold, "pad": policy.pad,
            "pad_multiple": policy.pad_multiple or 8, "probe": policy.probe,
            "fp32_modules": list(policy.fp32_modules),
            "leaf_modules": [str(m) for m in policy.leaf_modules], "keep_output_dtype": policy.keep_output_dtype,
            "env": dict(policy.env),
            "origins": {f"{f}:{n}": s for (f, n), s in policy.origins}}

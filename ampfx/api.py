"""``ampfx.convert``: policy, capture, analyses, passes, report — one stage after another.

1. **policy** — a frozen :class:`~ampfx.policy.Policy` from defaults, arguments and
   the ``AMPFX_*`` environment (read here, once); arguments checked into a
   :class:`~ampfx.rewrite.Request`;
2. **capture, analyses, passes** — per module of the tree, as the capture ladder
   decides (:func:`ampfx.tree.convert_tree`, :func:`ampfx.rewrite.convert_graph`),
   on a private copy of the module tree that shares the model's parameters;
3. **report** — one :class:`~ampfx.report.Report` for the whole model, saved where
   the policy says.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Mapping

import torch
import torch.nn as nn

from . import arguments as args
from . import guards, integrations, module_match, view, weight_cache
from . import policy as policy_mod
from .capture import export
from .errors import ArgumentError, UninitializedModelError
from .decide import check_tuned
from .follow import follow
from .graph_module import AmpGraphModule
from .inference import store_low
from .inputs import ExampleInputs
from .policy import Policy, PolicyError, did_you_mean
from .report import Report, dtype_name
from .rewrite import Request
from .state import copy_tree, one_thread, untouched
from .tree import convert_module, convert_tree

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
    made once, and again only when a weight changes (see :mod:`ampfx.inference`);
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
    model holds). The result is a view of the model (:mod:`ampfx.view`): its
    parameters, buffers, ``state_dict()``, hooks, modes and attributes are the
    model's (float32 master weights: an optimizer on either trains both), and it
    carries the log as ``result.ampfx_report``. What a change to the model or to
    the result does afterwards shows through: where a graph fixed a changed value
    while tracing, that graph's module is converted again at the next call
    (:mod:`ampfx.fixed`, bounded by ``reconvert_limit``); a change that cannot be
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
    model = _model_of(model)
    request = _request(model, dtype, example_inputs, policy, dynamic_dims, tracer, mode, calibrate, calibrate_loss,
                       os.environ if environ is None else environ, policy_options)
    if request.policy.disable:
        return _disabled_copy(model, request.policy)
    work = copy_tree(model)
    inputs = request.inputs.tensors() if request.inputs is not None else ()
    with untouched(model, *inputs), one_thread(model, *inputs):
        result, report = convert_tree(work, request)
    check_tuned(request.policy, report.records)
    result, views = view.rebase(result, model)
    follower = follow(model, result, views)
    _arm(views, request, follower, model)
    notes = report.notes + (_store_low(model, result, request.policy.dtype) if mode == "inference" else
                            _cache_weights(result, request.policy))
    if given is not model:
        notes += ("the module given is a converted module, a view of its model: that model was converted",)
    report = Report.merge(request.policy.dtype, [report], policy=_policy_log(request.policy), shapes=report.shapes,
                          notes=notes)
    result.ampfx_report = report
    _save(report, request.policy)
    return result


def _arm(views: view.Views, request: Request, follower: Any, model: nn.Module) -> None:
    """Give every graph module of the converted tree the means to convert its model module again when
    what its graph fixed changes (:class:`ampfx.view.Reconvert`); what those conversions depend on is
    added to what ``follower`` watches. The modules the policy names are found again in ``model`` as it
    is then (a module that got hooks since is kept as a boundary, as ``keep_modules="auto"`` keeps it).
    The example inputs are not held: a conversion made again uses the inputs of the call that needs it."""
    request = dataclasses.replace(request, inputs=None)

    def again(module: nn.Module, call: tuple, where: str, arrive: torch.dtype | None) -> tuple[nn.Module, Report]:
        args, kwargs = call
        inputs = ExampleInputs.from_call(module, args, kwargs).snapshot()
        # tracer='export' inlines every module: a module hooked since conversion would run its hooks once, while
        # tracing; 'auto' keeps it a boundary where torch.fx captures the rest
        req = dataclasses.replace(request, policy=_check_module_names(model, request.policy), inputs=inputs,
                                  dynamic_dims=request.dynamic_dims if not where else None,
                                  tracer="auto" if request.tracer == "export" else request.tracer,
                                  export_sizes={}, export_drops={})
        tensors = inputs.tensors()
        with untouched(module, *tensors), one_thread(module, *tensors):
            return convert_module(copy_tree(module), req, inputs, where, arrive)

    def arm(made: view.Views) -> None:
        if made is not views:
            follower.watch(made)
        for gm, _ in made.graphs:
            gm.set_reconvert(view.Reconvert(again, gm.__dict__.get("_ampfx_arrive"), request.policy.reconvert_limit,
                                            arm))

    arm(views)


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
    """The report saved where ``log_path`` / ``AMPFX_LOG_PATH`` says; an unwritable place is named."""
    if not policy.log_path:
        return
    try:
        report.save(policy.log_path)
    except OSError as e:
        raise ArgumentError(f"log_path / AMPFX_LOG_PATH={str(policy.log_path)!r}: cannot write the report there "
                            f"({e.strerror or e}); give a writable directory") from e


def _request(model: nn.Module, dtype: Any, example_inputs: Any, policy: Policy | None, dynamic_dims: Any,
             tracer: str, mode: str, calibrate: Any, calibrate_loss: Any, environ: Mapping[str, str],
             policy_options: dict[str, Any]) -> Request:
    """The policy (arguments, then the environment) and every argument checked."""
    args.check_model(model)
    _check_unwrapped(model)
    args.check_choice("mode", mode, {"train": "float32 master weights",
                                     "inference": "weights stored in the low dtype once"})
    args.check_choice("tracer", tracer, {"auto": "torch.fx, then torch.export where fx fails", "fx": "torch.fx",
                                         "export": "torch.export"})
    if not isinstance(environ, Mapping):
        raise ArgumentError(f"environ={type(environ).__name__}: give a mapping of variable names to strings "
                            "(like os.environ), or leave it out to read os.environ")
    dtype_given = dtype is not None or policy is not None  # else AMPFX_POLICY_FILE's dtype is taken
    if policy is None:
        args.check_policy_options(policy_options)
        policy = Policy(dtype=dtype if dtype is not None else torch.bfloat16, **policy_options)
    else:
        if not isinstance(policy, Policy):
            raise ArgumentError(f"policy={policy!r}: give an ampfx.Policy(...), or pass its fields as keywords "
                                "(convert(model, 'bf16', fp32_modules=...))")
        if policy_options:
            raise ArgumentError(f"pass either policy= or policy options, not both: {sorted(policy_options)}")
        if dtype is not None and policy_mod.parse_dtype(dtype) != policy.dtype:
            raise PolicyError(f"dtype={dtype!r} disagrees with policy.dtype={policy.dtype}; give one of them")
    policy = _check_module_names(model, policy_mod.from_env(policy, environ, dtype_given=dtype_given))
    _check_initialised(model)
    if policy.disable:
        return Request(policy, None)
    if tracer == "export" and example_inputs is None:
        raise ArgumentError("tracer='export' runs the model on example_inputs: give example_inputs=(x,) (or a "
                            "dict of keyword inputs), or use tracer='fx'")
    if tracer == "export" and export.unavailable():
        raise RuntimeError(export.unavailable())
    if dynamic_dims and example_inputs is None:
        raise ArgumentError("dynamic_dims names dimensions of example_inputs; give example_inputs too")
    inputs = args.check_inputs(model, example_inputs, "example_inputs")
    calib = args.check_calibration(model, calibrate, calibrate_loss, inputs)
    if calib is not None and inputs is None:
        inputs = ExampleInputs.of(calib[0][0])
    if dynamic_dims is not None and inputs is not None:
        guards.check_dynamic_dims(dynamic_dims, inputs)
    return Request(policy, inputs, tracer, dynamic_dims, calib)


def _disabled_copy(model: nn.Module, policy: Policy) -> nn.Module:
    """``AMPFX_DISABLE=1``: an unconverted copy, and a report that says so."""
    copy = copy_tree(model)
    copy.ampfx_report = Report(dtype=policy.dtype, disabled=True, policy=_policy_log(policy),
                               notes=("conversion disabled: the model is an unconverted copy",))
    log.info("ampfx disabled: returning an unconverted copy")
    _save(copy.ampfx_report, policy)
    return copy


def _store_low(model: nn.Module, result: nn.Module, dtype: torch.dtype) -> tuple[str, ...]:
    """``mode="inference"``: the weights of low-precision ops read from low copies (:mod:`ampfx.inference`);
    the note saying so."""
    count = nbytes = 0
    for gm in [m for m in result.modules() if isinstance(m, AmpGraphModule)]:
        copies = store_low(gm, dtype)
        gm._install_dispatch()
        count, nbytes = count + len(copies.entries), nbytes + copies.nbytes()
    return (f"inference mode: {count} weights read from {dtype_name(dtype)} copies made once ({nbytes:,} bytes beside "
            "the model's float32 weights) and made again only when a weight changes",)


def _cache_weights(result: nn.Module, policy: Policy) -> tuple[str, ...]:
    """Training mode: each weight a low op reads cast once per change of its master (:mod:`ampfx.weight_cache`),
    unless the policy turns that off; the note saying which."""
    if not policy.weight_cache:
        return ("weight cache: off (weight_cache=False or AMPFX_WEIGHT_CACHE=0): weights are cast at every forward",)
    count = numel = 0
    for gm in [m for m in result.modules() if isinstance(m, AmpGraphModule)]:
        cache = weight_cache.install(gm, policy.dtype)
        gm._install_dispatch()
        count += len(cache.entries)
        numel += sum(e.owner[e.name].numel() for e in cache.entries)
    nbytes = numel * torch.finfo(policy.dtype).bits // 8
    return (f"weight cache: on, {count} weights cast to {dtype_name(policy.dtype)} once per change of their float32 "
            f"masters and reused by every forward, backward and recompute ({nbytes:,} bytes held between steps; "
            "off inside FSDP2 and torch.compile: ampfx.weight_cache)",)


def _all_modules(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules(remove_duplicate=False)]


def _check_initialised(model: nn.Module) -> None:
    """Lazy modules must have their parameters before conversion (see :class:`UninitializedModelError`)."""
    lazy = [name or "<root>" for name, m in model.named_modules()
            if any(nn.parameter.is_lazy(t) for t in (*m._parameters.values(), *m._buffers.values()))]
    if lazy:
        raise UninitializedModelError(
            f"{type(model).__name__} has lazy modules with uninitialised parameters ({', '.join(lazy[:5])}): "
            "initialising them changes the model, which ampfx.convert does not do. Run the model once first "
            "(model(*example_inputs), as torch asks before an optimizer is built), then convert it.")


def _check_module_names(model: nn.Module, policy: Policy) -> Policy:
    """The modules ``fp32_modules`` keeps float32 in ``model``, resolved once
    (:func:`ampfx.module_match.resolve`: an entry that keeps nothing is an error), and every name
    in ``leaf_modules`` a module of ``model``, under any of its names: a submodule registered
    twice (``self.alias = self.fc``) answers to both, and the policy returned names it by all of
    them (the converted tree copies each name's module apart; a graph records the name ``forward``
    used). ``module_filter_fn`` is asked once about every module (:func:`ampfx.module_match.filter_rejected`),
    so it also holds inside modules converted on their own under a rejected parent."""
    named = list(model.named_modules(remove_duplicate=False))
    names = [n for n, _ in named if n]
    matched = module_match.resolve(model, policy.fp32_modules)
    # another library's module (a DGL conv) is a leaf its integration runs: its forward runs already
    libraries = [n for n, m in named if n and integrations.library_of(m) is not None]
    kept = tuple((p, why) for p, why in module_match.resolve(model, policy.keep_modules, "keep_modules")
                 if not any(p == lib or p.startswith(lib + ".") for lib in libraries))
    rejected = (module_match.filter_rejected(model, policy.module_filter_fn)
                if policy.module_filter_fn is not None else None)
    leaves = []
    for leaf in policy.leaf_modules:
        if isinstance(leaf, str) and leaf not in names:
            raise PolicyError(f"leaf_modules / AMPFX_LEAF_MODULES names {leaf!r}, which is neither a module "
                              f"of {type(model).__name__} nor an importable module type."
                              f"{did_you_mean(leaf, names, cutoff=0.5)}")
        if isinstance(leaf, str):
            module = model.get_submodule(leaf)
            leaves += [n for n, m in named if n and m is module and n not in policy.leaf_modules]
    return dataclasses.replace(policy, fp32_matched=matched, filter_rejected=rejected, user_ops=policy.user_ops,
                               keep_matched=kept,
                               leaf_modules=policy.leaf_modules + tuple(dict.fromkeys(leaves)))


def _check_unwrapped(model: nn.Module) -> None:
    """A model already sharded, wrapped for data parallelism or compiled cannot be converted inside
    (:func:`ampfx.module_match.wrapped_first`): the error names the module and the order that works."""
    found = module_match.wrapped_first(model)
    if found is None:
        return
    path, wrapper = found
    raise ArgumentError(
        f"{'model.' + path if path else 'the model'} is already wrapped by {wrapper}: ampfx converts a plain model, "
        "and the wrapper goes on the converted one (it holds the parameters as shards, or a forward bound when it "
        "was made, which a conversion cannot reach inside). Convert first, then wrap: amp = ampfx.convert(model, ...); "
        "then fully_shard(amp.blocks[i]) for each block and fully_shard(amp), DDP(amp) or torch.compile(amp) "
        "(see docs/scale.md). Activation-checkpoint wrappers may go on before or after.")


def _policy_log(policy: Policy) -> dict[str, Any]:
    edits = {}
    for f in ("allowlist", "inferlist", "clearlist", "denylist"):
        for a in ("add", "remove"):
            v = getattr(policy, f"{f}_{a}")
            if v:
                edits[f"{f}_{a}"] = list(v)
    return {"dtype": dtype_name(policy.dtype), "edits": edits,
            "reduction_threshold": policy.reduction_threshold, "pad": policy.pad,
            "pad_multiple": policy.pad_multiple or 8, "probe": policy.probe,
            "fp32_modules": [module_match.describe(e) for e in policy.fp32_modules],
            "fp32_matched": dict(policy.fp32_matched), "tuned": dict(policy.tuned),
            "keep_modules": [module_match.describe(e) for e in policy.keep_modules],
            "keep_matched": dict(policy.keep_matched or ()),
            "leaf_modules": [str(m) for m in policy.leaf_modules], "keep_output_dtype": policy.keep_output_dtype,
            "env": dict(policy.env),
            "origins": {f"{f}:{n}": s for (f, n), s in policy.origins}}

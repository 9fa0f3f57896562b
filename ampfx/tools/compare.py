"""How faithful a conversion is: ampfx against torch.autocast, both against float32.

``ampfx.compare(model, amp, batch)`` runs one batch forward and backward three
times: the float32 ``model``, the converted ``amp``, and ``model`` under
``torch.autocast`` with ``amp``'s dtype on the batch's device. For each float
output and each parameter's gradient it reports the relative error against
float32, ``||x - x32|| / ||x32||`` (computed in float64), for ampfx and for
autocast, parameters worst first by ampfx's error, with the ratio
ampfx / autocast (above 1: ampfx is further from float32 than autocast).
The loss is computed inside the autocast region, as torch's AMP recipe does
(autocast runs ``cross_entropy`` and the like in float32).

Each run starts from the same state: the model's buffers (batch-norm
statistics), its modules' attributes and the random state are put back after
each run (so dropout draws the same masks in all three: checked on the
device, a note says where the low dtype's masks would differ), each parameter's
``.grad`` is cleared before and the caller's ``.grad`` put back after, and
the model keeps its training mode. ``amp`` shares ``model``'s parameters
(that is checked: an ``amp`` converted from another model is refused), so
the three runs write the same ``.grad`` slots one after the other.

>>> import torch, ampfx
>>> _ = torch.manual_seed(0)
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
>>> amp = ampfx.convert(net, "bf16")
>>> c = ampfx.compare(net, amp, torch.randn(4, 8))
>>> c.n_params, [o.name for o in c.outputs], c.gradient.ampfx < 0.05, net[0].weight.grad
(4, ['output'], True, None)
"""
from __future__ import annotations

import contextlib
import io
import importlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from ..api import convert_request
from ..arguments import check_inputs
from ..errors import ENTRY_ERRORS, ArgumentError, ExampleInputsError
from ..inputs import ExampleInputs
from ..passes.calibrate import default_loss
from ..policy import Policy
from ..report import Report
from ..report.records import dtype_name
from ..request import Asked, build, check_options
from ..state import kept_random, kept_rng, untouched


@dataclass(frozen=True)
class _Pair:
    """One value's relative error under ampfx and under autocast (``None``: not available)."""

    name: str
    ampfx: float | None
    autocast: float | None

    @property
    def ratio(self) -> float | None:
        """``ampfx / autocast`` (1 where both are 0, inf where only autocast's is); ``None`` where
        either figure is missing."""
        if self.ampfx is None or self.autocast is None:
            return None
        if self.autocast == 0:
            return 1.0 if self.ampfx == 0 else math.inf
        return self.ampfx / self.autocast

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "ampfx": self.ampfx, "autocast": self.autocast, "ratio": self.ratio}


@dataclass(frozen=True)
class OutputError(_Pair):
    """The relative error of one float output (``name``: its place in the output, ``"output"``
    for a lone tensor, else a pytree key path such as ``"[0]"`` or ``"['logits']"``)."""


@dataclass(frozen=True)
class ParamError(_Pair):
    """The relative error of one parameter's gradient, ``||g - g32|| / ||g32||`` (``name`` as in
    ``model.named_parameters()``; ``"(all parameters)"`` for all gradients as one vector).
    ``norm32`` is ``||g32||``; ``noise`` marks a float32 gradient that is about 0 (below
    :data:`NOISE` of the largest parameter's): its relative errors measure rounding noise."""

    norm32: float | None = None
    noise: bool = False

    def as_json(self) -> dict[str, Any]:
        return {**super().as_json(), "norm32": self.norm32, "noise": self.noise}


NOISE = 1e-5
"""A float32 gradient whose norm is below this fraction of the largest parameter gradient's norm
is taken for 0 (a bias before batch norm; a mean loss over a normalised output): float32's own
rounding (eps 1.2e-7, summed over many terms) is of that size, so a relative error against it
says nothing about ampfx. Such parameters are listed after the others."""


@dataclass(frozen=True)
class NodeError:
    """A node of ``amp`` that :func:`ampfx.sensitivity` found most responsible for the error:
    the output and gradient error when that node alone runs in the low dtype."""

    node: str
    op: str
    module: str
    out_err: float | None
    grad_err: float | None

    def as_json(self) -> dict[str, Any]:
        return {"node": self.node, "op": self.op, "module": self.module, "out_err": self.out_err,
                "grad_err": self.grad_err}


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare` measured. ``params`` holds the ``top`` worst parameters by ampfx's
    gradient error (of ``n_params`` compared); ``gradient`` all gradients as one vector;
    ``autocast_error`` why autocast could not run (its figures are then ``None``)."""

    dtype: torch.dtype
    device: str
    outputs: tuple[OutputError, ...]
    params: tuple[ParamError, ...]
    gradient: ParamError | None
    n_params: int
    nodes: tuple[NodeError, ...] = ()
    notes: tuple[str, ...] = ()
    autocast_error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``json.dumps`` (a missing figure is ``None``; a non-finite one stays a float)."""
        return {"dtype": dtype_name(self.dtype), "device": self.device,
                "outputs": [o.as_json() for o in self.outputs],
                "gradient": self.gradient.as_json() if self.gradient is not None else None,
                "n_params": self.n_params, "params": [p.as_json() for p in self.params],
                "nodes": [n.as_json() for n in self.nodes], "notes": list(self.notes),
                "autocast_error": self.autocast_error}

    def table(self, *, width: int = 120, color: bool | None = None) -> str:
        """The figures as rich tables: outputs, then gradients worst first, then the nodes."""
        from rich.console import Console

        buf = io.StringIO()
        console = Console(file=buf, width=width, force_terminal=bool(color), no_color=not color,
                          color_system="standard" if color else None)
        for t in _tables(self):
            console.print(t)
        for note in self.notes:
            console.print(f"note: {note}", highlight=False)
        return buf.getvalue()

    def __str__(self) -> str:
        return self.table()


def _fmt(x: float | None, form: str = "{:.2e}") -> str:
    return "n/a" if x is None else form.format(x) if math.isfinite(x) else str(x)


def _ratio_style(r: float | None) -> str:
    return "" if r is None else "red" if r > 2 else "green" if r < 1 else ""


def _tables(c: Comparison) -> list[Any]:
    """The rich tables of :meth:`Comparison.table`."""
    from rich.table import Table

    name = dtype_name(c.dtype)
    head = f"autocast ({c.device})" + (" n/a" if c.autocast_error else "")
    out = Table(title=f"output error vs float32 ({name})")
    grads = Table(title=f"gradient error vs float32, worst first ({len(c.params)} of {c.n_params} parameters)")
    for t, first, extra in ((out, "output", ()), (grads, "parameter", ("float32 |g|",))):
        for col in (first, "ampfx", head, "ampfx/autocast", *extra):
            t.add_column(col, overflow="fold", justify="left" if col == first else "right")
    for o in c.outputs:
        out.add_row(o.name, _fmt(o.ampfx), _fmt(o.autocast), _fmt(o.ratio, "{:.2f}"), style=_ratio_style(o.ratio))
    for p in ((c.gradient,) if c.gradient is not None else ()) + c.params:
        grads.add_row(p.name, _fmt(p.ampfx), _fmt(p.autocast), _fmt(p.ratio, "{:.2f}"),
                      _fmt(p.norm32) + (" ~0" if p.noise else ""), style="dim" if p.noise else _ratio_style(p.ratio))
    tables = [out, grads]
    if c.nodes:
        nodes = Table(title="nodes most responsible (ampfx.sensitivity)")
        for col in ("node", "op", "module", "out_err", "grad_err"):
            nodes.add_column(col, overflow="fold")
        for n in c.nodes:
            nodes.add_row(n.node, n.op, n.module, _fmt(n.out_err), _fmt(n.grad_err))
        tables.append(nodes)
    return tables


# ------------------------------------------------------------------ the runs
@dataclass(frozen=True)
class _Run:
    """What one run gave: its float outputs by place, each parameter's gradient (``None``: none)."""

    outputs: tuple[tuple[str, torch.Tensor], ...]
    grads: dict[str, torch.Tensor | None]
    drew: bool = False  # the run drew random numbers (dropout)


def compare(model: nn.Module, amp: Any, batch: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None, *,
            top: int = 10, autocast: bool = True, sensitivity: bool = True, policy: Policy | None = None,
            environ: Mapping[str, str] | None = None, **policy_options: Any) -> Comparison:
    """Measure ``amp`` (``ampfx.convert(model, ...)``) and ``torch.autocast`` against float32 on
    ``batch`` (a tuple of positional inputs, a dict of keyword inputs, or one tensor), forward
    and backward; see the module docstring. ``amp`` may also be a dtype (``"bf16"``,
    ``torch.float16``): then ``model`` is converted here, on ``batch``, with ``policy`` or the keyword
    options and ``environ`` as :func:`ampfx.convert` takes them. ``loss_fn(output)`` makes the loss
    (default: the output if it is a scalar, else the mean of the float outputs). ``top`` limits the
    parameters and nodes listed; ``autocast=False`` skips autocast's run; ``sensitivity`` asks
    ``ampfx.sensitivity`` (where this ampfx has it) for the nodes most responsible. ``model``
    is left as it was: values, buffers, ``.grad``, training mode and the random state."""
    try:
        amp = _converted(model, amp, batch, policy, environ, policy_options)
        report = _check(model, amp, top)
        inputs = check_inputs(model, batch, "batch")
    except ENTRY_ERRORS as e:  # the user's mistake, raised from here: the traceback ends at their call
        raise e.with_traceback(None) from None
    if inputs is None:
        raise ArgumentError("batch=None: give the inputs to run, e.g. (torch.randn(8, 16),) or one tensor")
    device = inputs.device() or next((p.device.type for p in model.parameters()), "cpu")
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    loss = _Loss(loss_fn)
    saved = {p: p.grad for p in params.values()}
    try:
        ref = _run(model, model, inputs, loss, params, contextlib.nullcontext(), fails=_not_running(inputs))
        mine = _run(model, amp, inputs, loss, params, contextlib.nullcontext())
        if amp.training != model.training:
            raise ArgumentError(f"amp is in {_mode(amp)} mode and the model in {_mode(model)} mode: the runs "
                                "would differ (dropout, batch norm); put amp in the model's mode "
                                f"(amp.train({model.training}))")
        theirs, why = None, "not run (autocast=False)"
        if autocast:
            theirs, why = _autocast_run(model, inputs, loss, params, device, report.dtype)
        nodes, node_notes = _nodes(model, amp, (batch, inputs), loss_fn, top) if sensitivity else ((), ())
    finally:
        for p, g in saved.items():
            p.grad = g
    notes = _notes(report, ref, mine, theirs, why) + node_notes
    if ref.drew and not _dropout_masks_match(device, report.dtype):
        notes += (f"the model draws random numbers (dropout) and on {device} dropout draws other masks for "
                  f"{dtype_name(report.dtype)} than for float32: the errors include different masks; compare in "
                  "eval mode (model.eval()) for rounding alone",)
    return _comparison(report.dtype, device, (ref, mine, theirs), top, nodes, notes, why)


def _mode(m: nn.Module) -> str:
    return "train" if m.training else "eval"


@dataclass(frozen=True)
class _Loss:
    """The loss of one run: ``loss_fn(output)`` or the default, checked to be a float scalar."""

    fn: Callable[[Any], Any] | None

    def __call__(self, output: Any) -> torch.Tensor:
        value = self.fn(output) if self.fn is not None else default_loss(output)
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
            return value.reshape(())
        got = (f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
               else f"{value!r} (a {type(value).__name__})")
        if self.fn is None:
            raise ArgumentError(f"the model's output holds no float tensor to make a default loss from (got {got}): "
                                "give loss_fn=, a function output -> scalar loss tensor")
        raise ArgumentError(f"loss_fn returned {got}: return one float number as a tensor, "
                            "e.g. loss_fn=lambda out: out.pow(2).mean()")


def _not_running(inputs: ExampleInputs) -> Callable[[BaseException], Exception]:
    """The error for a float32 model that does not run on the batch."""
    def error(e: BaseException) -> Exception:
        return ExampleInputsError(f"the model does not run on batch ({type(e).__name__}: {e}); batch: "
                                  f"{inputs.describe()}. Give a batch the model accepts, as model(*batch) does")
    return error


def _run(model: nn.Module, module: nn.Module, inputs: ExampleInputs, loss: _Loss, params: dict[str, nn.Parameter],
         context: Any, fails: Callable[[BaseException], Exception] | None = None) -> _Run:
    """``module`` forward on a private copy of the inputs (under ``context``), the loss and its
    backward, leaving ``model``'s values, attributes and random state as they were. The
    gradients are taken off the parameters (each ``.grad`` left ``None``)."""
    for p in params.values():
        p.grad = None
    with untouched(model, *inputs.tensors()), kept_random() as seen, torch.enable_grad():
        with context:
            try:
                out = inputs.snapshot().call(module)
            except Exception as e:  # noqa: BLE001 - the float32 model's own failure names the batch
                if fails is None:
                    raise
                raise fails(e) from e
            value = loss(out)
        if value.requires_grad:
            value.backward()
    grads = {n: (p.grad.detach() if p.grad is not None else None) for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return _Run(_float_leaves(out), grads, seen.drew)


def _dropout_masks_match(device: str, dtype: torch.dtype) -> bool:
    """Whether dropout on ``device`` draws the same mask for a float32 tensor and a ``dtype`` one
    from the same random state (so the three runs drop the same units). It does on CPU; a
    device whose kernel draws per dtype differently would make the errors compare masks."""
    x = torch.ones(4096, device=device)
    masks = []
    for t in (x, x.to(dtype)):
        with kept_rng(x):
            masks.append(F.dropout(t, 0.5, training=True) != 0)
    return torch.equal(masks[0], masks[1])


def _float_leaves(out: Any) -> tuple[tuple[str, torch.Tensor], ...]:
    """The float tensors of an output with their places (``"output"`` for a lone tensor)."""
    if isinstance(out, torch.Tensor):
        return (("output", out.detach()),) if out.is_floating_point() else ()
    with_path = getattr(pytree, "tree_flatten_with_path", None)  # torch >= 2.2
    if with_path is not None:
        pairs = [(pytree.keystr(path), leaf) for path, leaf in with_path(out)[0]]
    else:
        pairs = [(f"[{i}]", leaf) for i, leaf in enumerate(pytree.tree_leaves(out))]
    return tuple((name, t.detach()) for name, t in pairs if isinstance(t, torch.Tensor) and t.is_floating_point())


@contextlib.contextmanager
def _autocast_on(device: str, dtype: torch.dtype) -> Iterator[None]:
    """``torch.autocast(device, dtype)``, or an error where torch turns it off (a dtype the device's
    autocast lacks: torch warns and runs float32, which would read as a perfect score)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ctx = torch.autocast(device_type=device, dtype=dtype)
        ctx.__enter__()
    try:
        if not _autocast_enabled(device):
            said = "; ".join(str(w.message).splitlines()[0] for w in seen)
            raise RuntimeError(f"torch turned autocast off on {device} for {dtype_name(dtype)}"
                               + (f" ({said})" if said else ""))
        yield
    finally:
        ctx.__exit__(None, None, None)


def _autocast_enabled(device: str) -> bool:
    try:
        return torch.is_autocast_enabled(device)
    except TypeError:  # torch < 2.4 takes no device
        return torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled()


def _autocast_run(model: nn.Module, inputs: ExampleInputs, loss: _Loss, params: dict[str, nn.Parameter],
                  device: str, dtype: torch.dtype) -> tuple[_Run | None, str | None]:
    """autocast's run, or ``None`` and why it failed (autocast lacks an op, e.g. nn.LSTM on CPU):
    that is a figure not available, not a failure of the comparison."""
    try:
        return _run(model, model, inputs, loss, params, _autocast_on(device, dtype)), None
    except Exception as e:  # noqa: BLE001 - reported as n/a with the error
        return None, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


# ------------------------------------------------------------------ checks
def _converted(model: Any, amp: Any, batch: Any, policy: Policy | None, environ: Mapping[str, str] | None,
               given: dict[str, Any]) -> Any:
    """``amp`` when it is a module; else ``model`` converted to the dtype ``amp`` names, on ``batch``, with
    the policy as :func:`ampfx.convert` takes it (:mod:`ampfx.request`: the same checks, the same errors)."""
    if not isinstance(amp, nn.Module):
        return convert_request(model, build(model, Asked(amp, batch, policy, given), caller="compare", environ=environ))
    if given or policy is not None or environ is not None:
        check_options("compare", given)
        raise ArgumentError("compare(): policy, environ and policy options apply when compare converts the model: "
                            "pass amp as a dtype (compare(model, 'bf16', batch, fp32_modules=...)), or give them to "
                            "ampfx.convert")
    return amp


def _check(model: Any, amp: Any, top: Any) -> Report:
    """``model`` a module, ``amp`` a module ampfx converted from it, ``top`` a count; ``amp``'s report."""
    if not isinstance(model, nn.Module):
        raise ArgumentError(f"compare() takes the float32 model first (an nn.Module); got {_what(model)}")
    report = getattr(amp, "ampfx_report", None) if isinstance(amp, nn.Module) else None
    if not isinstance(report, Report):
        raise ArgumentError(f"amp={_what(amp)} is not a module ampfx.convert returned (it has no ampfx_report): "
                            "pass amp = ampfx.convert(model, ...)")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ArgumentError(f"top={top!r}: give how many parameters and nodes to list, a whole number >= 1")
    wrong = _not_shared(model, amp, report.dtype)
    if wrong:
        raise ArgumentError(
            f"amp was not converted from this model: {len(wrong)} of its parameters and buffers are not the "
            f"model's ({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}). Pass the model that "
            "amp = ampfx.convert(model, ...) was made from (amp shares its parameters), or convert this model; "
            "a model whose tensors were replaced or retrained since a mode='inference' conversion: convert it again")
    return report


def _what(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _not_shared(model: nn.Module, amp: nn.Module, low: torch.dtype) -> list[str]:
    """Names of the parameters and buffers ``amp`` does not share with ``model``. A parameter
    ``mode="inference"`` stored low (no gradient, ``low`` dtype, equal to the model's rounded)
    counts as shared."""
    def stored_low(p: torch.Tensor, q: torch.Tensor) -> bool:
        return (not q.requires_grad and q.dtype == low and q.shape == p.shape and q.device == p.device
                and torch.equal(q, p.detach().to(low)))

    wrong = []
    for kind in ("parameters", "buffers"):
        mine = dict(getattr(model, f"named_{kind}")(remove_duplicate=False))
        theirs = dict(getattr(amp, f"named_{kind}")(remove_duplicate=False))
        for name in sorted(mine.keys() | theirs.keys()):
            p, q = mine.get(name), theirs.get(name)
            if p is q:
                continue
            if p is None or q is None or kind == "buffers" or not stored_low(p, q):
                wrong.append(name)
    return wrong


# ------------------------------------------------------------------ the figures
def _rel(got: torch.Tensor | None, want: torch.Tensor) -> float | None:
    """``||got - want|| / ||want||`` in float64 (0 where both are 0, inf where only ``want`` is)."""
    if got is None or got.shape != want.shape:
        return None
    diff = float((got.double() - want.double()).norm())
    scale = float(want.double().norm())
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / scale


def _total(run: _Run | None, ref: _Run) -> float | None:
    """All gradients as one vector: over the parameters this run gave a gradient for."""
    if run is None:
        return None
    names = [n for n, g in ref.grads.items() if g is not None and run.grads.get(n) is not None]
    if not names:
        return None
    diff = sum(float((run.grads[n].double() - ref.grads[n].double()).norm()) ** 2 for n in names)
    scale = sum(float(ref.grads[n].double().norm()) ** 2 for n in names)
    return math.sqrt(diff / scale) if scale else (0.0 if diff == 0 else math.inf)


def _output(run: _Run | None, i: int, want: torch.Tensor) -> float | None:
    return _rel(run.outputs[i][1], want) if run is not None and i < len(run.outputs) else None


def _worst_first(p: ParamError) -> tuple[bool, bool, float]:
    """Sort key: the largest ampfx error first (NaN counts as the worst), then missing figures,
    then the gradients that are about 0 in float32 (:data:`NOISE`)."""
    if p.ampfx is None:
        return p.noise, True, 0.0
    return p.noise, False, -(math.inf if math.isnan(p.ampfx) else p.ampfx)


def _comparison(dtype: torch.dtype, device: str, runs: tuple[_Run, _Run, _Run | None], top: int,
                nodes: tuple[NodeError, ...], notes: tuple[str, ...], why: str | None) -> Comparison:
    ref, mine, theirs = runs
    outputs = tuple(OutputError(name, _output(mine, i, t), _output(theirs, i, t))
                    for i, (name, t) in enumerate(ref.outputs))
    norms = {n: float(g.double().norm()) for n, g in ref.grads.items() if g is not None}
    floor = NOISE * max(norms.values(), default=0.0)
    params = [ParamError(n, _rel(mine.grads.get(n), ref.grads[n]),
                         _rel(theirs.grads.get(n), ref.grads[n]) if theirs else None, norm, norm <= floor)
              for n, norm in norms.items()]
    params.sort(key=_worst_first)
    gradient = ParamError("(all parameters)", _total(mine, ref), _total(theirs, ref),
                          math.sqrt(sum(v * v for v in norms.values()))) if params else None
    return Comparison(dtype, device, outputs, tuple(params[:top]), gradient, len(params), nodes[:top], notes, why)


def _notes(report: Report, ref: _Run, mine: _Run, theirs: _Run | None, why: str | None) -> tuple[str, ...]:
    """What a reader needs to read the figures right."""
    notes = []
    if report.disabled:
        notes.append("amp is an unconverted copy (conversion disabled): its errors are those of float32 itself")
    if why is not None:
        notes.append(f"torch.autocast: {why}; its figures are n/a")
    nothing = [n for n in report.notes if n.startswith("no GEMM runs")]
    if nothing:
        notes.append(f"ampfx's plan has no GEMM in the low dtype, so its errors are about float32's: {nothing[0]}")
    if not any(g is not None for g in ref.grads.values()):
        notes.append("no parameter got a gradient in float32 (the loss needs none): gradients not compared")
    norms = [float(g.double().norm()) for g in ref.grads.values() if g is not None]
    noise = sum(n <= NOISE * max(norms) for n in norms) if norms else 0
    if noise:
        notes.append(f"{noise} parameter(s) have a float32 gradient of about 0 (below {NOISE:g} of the largest): "
                     "their relative errors measure rounding noise; listed last, marked ~0")
    unused = [n for n, g in ref.grads.items() if g is None]
    if unused and len(unused) < len(ref.grads):
        notes.append(f"{len(unused)} parameter(s) got no gradient in float32 (unused by this batch): not listed")
    for who, run in (("ampfx", mine), ("autocast", theirs)):
        if run is None:
            continue
        lost = [n for n, g in ref.grads.items() if g is not None and run.grads.get(n) is None]
        if lost:
            why_lost = " (mode='inference' stores them low, without gradients)" if who == "ampfx" else ""
            notes.append(f"{len(lost)} parameter(s) got no gradient from {who}'s run{why_lost}: n/a, e.g. {lost[0]}")
        if len(run.outputs) != len(ref.outputs):
            notes.append(f"{who}'s output has {len(run.outputs)} float tensors, float32's {len(ref.outputs)}: "
                         "outputs compared by position")
    return tuple(notes)


NODE_BUDGET = 64
"""Forward/backward runs :func:`compare` lets ``ampfx.sensitivity`` spend ranking the nodes."""


def _nodes(model: nn.Module, amp: nn.Module, batch: tuple[Any, ExampleInputs], loss_fn: Any,
           top: int) -> tuple[tuple[NodeError, ...], tuple[str, ...]]:
    """The nodes ``ampfx.sensitivity(amp, batch, loss_fn=, top=)`` finds most responsible (worst
    first, records with ``node, op, module, out_err, grad_err``), where this ampfx has it."""
    given, inputs = batch
    sensitivity = getattr(importlib.import_module(__name__.split(".")[0]), "sensitivity", None)  # the ampfx package
    if sensitivity is None:
        return (), ("nodes most responsible: not measured (this ampfx has no ampfx.sensitivity)",)
    try:
        with untouched(model, *inputs.tensors()):
            # threshold 0 ranks every low node (bisecting down to single nodes), capped by NODE_BUDGET evaluations
            records = list(sensitivity(amp, given, loss_fn=loss_fn, top=top, threshold=0.0, budget=NODE_BUDGET))
    except Exception as e:  # noqa: BLE001 - an optional figure: reported, the comparison stands
        return (), (f"nodes most responsible: ampfx.sensitivity failed ({type(e).__name__}: {e})",)
    return tuple(_node_error(r) for r in records[:top]), ()


def _node_error(record: Any) -> NodeError:
    """A record of ``ampfx.sensitivity`` (an object with fields, or a dict) as a :class:`NodeError`."""
    def get(key: str) -> Any:
        return record.get(key) if isinstance(record, dict) else getattr(record, key, None)

    def number(key: str) -> float | None:
        value = get(key)
        return float(value) if value is not None else None

    return NodeError(str(get("node") or ""), str(get("op") or ""), str(get("module") or ""),
                     number("out_err"), number("grad_err"))

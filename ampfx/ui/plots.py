"""Pictures of value ranges: will float16 hold this model's numbers, and what loss scale does it need?

These are the pictures of NVIDIA's mixed-precision training guide (its Figures 2
and 3), made for your model: a histogram of activation and activation-gradient
magnitudes from one float32 step on a log2 axis, against the range of the low
dtype. Gradients left of float16's smallest subnormal (2**-24) become zero in
float16; a loss scale shifts the whole gradient histogram right.

:func:`collect_magnitudes` runs the float32 model forward and backward on one
batch and keeps log2 histograms (not the tensors), so it is cheap in memory.
:func:`range_plot` and :func:`loss_scale_plot` draw matplotlib figures and
return them (nothing is shown; a file is written only when given a path).
matplotlib is imported inside those functions, so ``import ampfx`` never needs it.

>>> import torch, torch.nn as nn
>>> _ = torch.manual_seed(0)
>>> net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
>>> x, y = torch.randn(4, 8), torch.randn(4, 2)
>>> tiny = lambda out, target: nn.functional.mse_loss(out, target) * 1e-9
>>> mags = collect_magnitudes(net, (x, y), tiny)
>>> sorted(mags["gradients"])          # one entry per leaf module
['0', '1', '2']
>>> mags["summary"]["gradients"]["below_subnormal"] > 0.5    # most would be zero in fp16
True
>>> scale = suggest_loss_scale(mags)
>>> scale == 2.0 ** round(math.log2(scale)) and mags["summary"]["gradients"]["max"] * scale < 65504
True
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch
import torch.nn as nn

from ..errors import ArgumentError, PathError
from ..paths import check_writable
from ..policy.names import parse_dtype
from ..report.records import dtype_name

#: Histogram bins are integer log2 exponents: bin ``e`` counts values in ``[2**e, 2**(e+1))``.
#: The range covers every float32 value (smallest subnormal 2**-149, max < 2**128);
#: values outside it (float64 models) are counted in the end bins.
EXPONENTS = np.arange(-160, 128)
KINDS = ("activations", "gradients")          # what range_plot draws
ALL_KINDS = KINDS + ("weight_gradients",)     # collected
_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------- ranges

def dtype_range(dtype: Any = torch.float16) -> dict:
    """The numbers that matter for range: smallest subnormal, smallest normal, max (from ``torch.finfo``).

    >>> r = dtype_range("fp16")
    >>> (r["subnormal"] == 2.0**-24, r["normal"] == 2.0**-14, r["max"])
    (True, True, 65504.0)
    >>> dtype_range(torch.bfloat16)["normal"] == 2.0**-126
    True
    """
    dtype = parse_dtype(dtype)
    fi = torch.finfo(dtype)
    return {"dtype": dtype, "name": dtype_name(dtype, short=True), "subnormal": fi.smallest_normal * fi.eps,
            "normal": fi.smallest_normal, "max": fi.max}


def _log2(value: float) -> int:
    """The exponent of a power of two, exactly: ``_log2(2.0**-24) == -24``."""
    return math.frexp(value)[1] - 1


# ----------------------------------------------------------------------------- statistics

def _empty_stats() -> dict:
    return {"count": 0, "zeros": 0, "nonfinite": 0, "max": 0.0,
            "hist": np.zeros(len(EXPONENTS), dtype=np.int64), "above_max": {d: 0 for d in _DTYPES}}


def _add_tensor(stats: dict, t: torch.Tensor) -> None:
    """Fold ``|t|`` into ``stats``: counts, a log2 histogram of the nonzero finite values, the max,
    and how many exceed each low dtype's max. Runs on ``t``'s device; only small results are kept."""
    a = t.detach().abs().flatten()
    finite = torch.isfinite(a)
    nonzero = a[finite & (a != 0)]
    stats["count"] += a.numel()
    stats["zeros"] += int((a == 0).sum())
    stats["nonfinite"] += int((~finite).sum())
    if nonzero.numel() == 0:
        return
    stats["max"] = max(stats["max"], float(nonzero.max()))
    exps = (torch.frexp(nonzero.float() if nonzero.dtype != torch.float64 else nonzero)[1] - 1).long()
    exps = exps.clamp(int(EXPONENTS[0]), int(EXPONENTS[-1])) - int(EXPONENTS[0])
    stats["hist"] += torch.bincount(exps, minlength=len(EXPONENTS)).cpu().numpy()
    for d in _DTYPES:
        stats["above_max"][d] += int((nonzero > torch.finfo(d).max).sum())


def _merge(parts: Iterable[dict]) -> dict:
    """One ``stats`` dict that sums several (a total over sites)."""
    total = _empty_stats()
    for s in parts:
        for k in ("count", "zeros", "nonfinite"):
            total[k] += s[k]
        total["max"] = max(total["max"], s["max"])
        total["hist"] += s["hist"]
        for d in _DTYPES:
            total["above_max"][d] += s["above_max"][d]
    return total


def _below(hist: np.ndarray, threshold: float, shift: int = 0) -> int:
    """How many histogram values are below ``threshold`` (a power of two) after multiplying by ``2**shift``."""
    return int(hist[EXPONENTS + shift < _log2(threshold)].sum())


def summarize(stats: dict, dtype: Any = torch.float16) -> dict:
    """Fractions of the nonzero finite values that ``dtype`` cannot hold as they are.

    ``below_subnormal``: become zero; ``below_normal``: zero or subnormal (fewer
    significant bits); ``above_max``: become inf. Also the raw counts, the max
    magnitude, and ``zero_fraction`` (exact zeros among all values).

    >>> s = _empty_stats(); _add_tensor(s, torch.tensor([0.0, 2.0**-30, 2.0**-20, 1.0, 7e4]))
    >>> f = summarize(s, "fp16")
    >>> (f["nonzero"], f["below_subnormal"], f["below_normal"], f["above_max"], f["zero_fraction"])
    (4, 0.25, 0.5, 0.25, 0.2)
    >>> summarize(s, "bf16")["below_normal"]
    0.0
    """
    r = dtype_range(dtype)
    if r["dtype"] not in _DTYPES:
        raise ValueError(f"summarize: {r['dtype']} is not one of {', '.join(map(str, _DTYPES))}")
    nonzero = int(stats["hist"].sum())
    frac = (lambda n: n / nonzero) if nonzero else (lambda n: 0.0)
    return {"count": stats["count"], "zeros": stats["zeros"], "nonzero": nonzero, "nonfinite": stats["nonfinite"],
            "max": stats["max"], "zero_fraction": stats["zeros"] / stats["count"] if stats["count"] else 0.0,
            "below_subnormal": frac(_below(stats["hist"], r["subnormal"])),
            "below_normal": frac(_below(stats["hist"], r["normal"])),
            "above_max": frac(stats["above_max"][r["dtype"]])}


# ----------------------------------------------------------------------------- collection

def _tensors(value: Any) -> Iterable[torch.Tensor]:
    """The floating-point tensors inside a module output (tensors, tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class _Recorder:
    """Accumulates activation and gradient statistics per site name."""

    def __init__(self) -> None:
        self.sites: dict[str, dict[str, dict]] = {k: {} for k in ALL_KINDS}

    def _stats(self, kind: str, name: str) -> dict:
        return self.sites[kind].setdefault(name, _empty_stats())

    def record(self, name: str, output: Any) -> None:
        """Record each tensor of ``output`` now, and its gradient when backward reaches it."""
        for t in _tensors(output):
            _add_tensor(self._stats("activations", name), t)
            if t.requires_grad:
                grads = self._stats("gradients", name)
                t.register_hook(lambda g, grads=grads: _add_tensor(grads, g))


def _leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    leaves = [(n, m) for n, m in model.named_modules() if not any(True for _ in m.children())]
    return [(n or type(m).__name__, m) for n, m in leaves]


def _run_modules(model: nn.Module, rec: _Recorder, call: Callable[[Callable], Any]) -> Any:
    """Run with a forward hook on every leaf module (sites are module names)."""
    handles = [m.register_forward_hook(lambda mod, args, out, name=name: rec.record(name, out))
               for name, m in _leaf_modules(model)]
    try:
        return call(model)
    finally:
        for h in handles:
            h.remove()


def _run_ops(model: nn.Module, rec: _Recorder, call: Callable[[Callable], Any]) -> Any:
    """Trace with ``torch.fx`` and run node by node (sites are graph node names: functions and methods too)."""
    gm = torch.fx.symbolic_trace(model)

    class Interp(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            out = super().run_node(n)
            if n.op in ("call_module", "call_function", "call_method"):
                rec.record(n.target if n.op == "call_module" else n.name, out)
            return out

    return call(lambda *args: Interp(gm).run(*args))


def _loss(run: Callable, batch: Any, loss_fn: Callable) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return loss_fn(run(batch))
    inputs, target = batch
    out = run(*inputs) if isinstance(inputs, (tuple, list)) else run(inputs)
    return loss_fn(out, target)


def synthetic_loss(name: str = "ce") -> Callable:
    """A loss for models without their own data (the ``ampfx plot`` command): ``loss_fn(output, _)``.

    ``"ce"``: cross-entropy of the output (classes on dim 1) against random labels;
    ``"mse"``: mean square of the output. A tuple or list output uses its first tensor.

    >>> _ = torch.manual_seed(0)
    >>> out = torch.zeros(4, 10)
    >>> round(float(synthetic_loss("ce")(out, None)), 4) == round(math.log(10), 4)
    True
    >>> float(synthetic_loss("mse")((torch.full((2, 2), 3.0),), None))
    9.0
    """
    def first(out: Any) -> torch.Tensor:
        return next(iter(_tensors(out)))

    def ce(out: Any, _: Any) -> torch.Tensor:
        logits = first(out).float()
        labels = torch.randint(logits.shape[1], (logits.shape[0],) + tuple(logits.shape[2:]), device=logits.device)
        return nn.functional.cross_entropy(logits, labels)

    def mse(out: Any, _: Any) -> torch.Tensor:
        return first(out).float().pow(2).mean()

    losses = {"ce": ce, "mse": mse}
    if name not in losses:
        raise ValueError(f"synthetic_loss: {name!r}; use one of {', '.join(losses)}")
    return losses[name]


def collect_magnitudes(model: nn.Module, batch: Any, loss_fn: Callable, *, by: str = "module") -> dict:
    """Run ``model`` forward and backward on one batch and histogram every activation and activation gradient.

    ``batch`` is ``(inputs, target)``: the loss is ``loss_fn(model(inputs), target)``
    (``model(*inputs)`` when ``inputs`` is a tuple or list). A lone tensor ``batch``
    gives ``loss_fn(model(batch))``. Pass the float32 model, not a converted one:
    the point is to see float32's numbers against the low dtype's range.

    ``by="module"`` records the outputs of every leaf module (forward hooks);
    ``by="op"`` traces the model with ``torch.fx`` and records every op, functions
    such as residual adds included. Gradients come from tensor hooks during
    ``torch.autograd.grad``, so parameters' ``.grad`` are left as they were; buffers
    (batch norm's running statistics) are restored. The model runs in its current
    mode (``train()`` or ``eval()``).

    Returns a dict:

    - ``"activations"``, ``"gradients"``: site name -> stats (``count``, ``zeros``,
      ``nonfinite``, ``max``, ``hist``: counts of nonzero finite magnitudes per
      log2 bin of :data:`EXPONENTS`, ``above_max``: counts above each low dtype's max).
      A site called several times accumulates.
    - ``"weight_gradients"``: parameter name -> the same stats for its gradient
      (under ampfx these are computed in the low dtype too, and are often the
      largest gradients).
    - ``"total"``: the same stats summed over sites, per kind.
    - ``"summary"``: :func:`summarize` of the totals for float16, per kind: the
      fractions of nonzero values below 2**-24 (zero in fp16), below 2**-14, above 65504.
    - ``"loss"``: the loss value.
    """
    rec = _Recorder()
    runner = {"module": _run_modules, "op": _run_ops}.get(by)
    if runner is None:
        raise ValueError(f"collect_magnitudes: by={by!r}; use 'module' or 'op'")
    saved = [b.detach().clone() for b in model.buffers()]      # e.g. batch norm's running statistics
    with torch.enable_grad():
        loss = runner(model, rec, lambda run: _loss(run, batch, loss_fn))
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        wrt = [p for _, p in params] + [t for t in _tensors(batch) if t.requires_grad]
        if not loss.requires_grad or not wrt:
            raise ValueError("collect_magnitudes: the loss does not depend on anything that requires grad")
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    with torch.no_grad():
        for b, old in zip(model.buffers(), saved):
            b.copy_(old)
    for (name, _), g in zip(params, grads):
        if g is not None:
            _add_tensor(rec._stats("weight_gradients", name), g)
    total = {k: _merge(rec.sites[k].values()) for k in ALL_KINDS}
    return {**rec.sites, "total": total, "summary": {k: summarize(total[k], torch.float16) for k in ALL_KINDS},
            "loss": float(loss.detach())}


# ----------------------------------------------------------------------------- loss scale

def suggest_loss_scale(max_grad: float | dict, dtype: Any = torch.float16) -> float | None:
    """The largest power of two ``S`` with ``max_grad * S`` below the dtype's max (NVIDIA's rule for a
    constant loss scale). ``max_grad`` is a number or :func:`collect_magnitudes`' result (then the
    max over activation gradients and weight gradients).
    ``None`` when the max gradient is 0 (any scale would do).

    >>> suggest_loss_scale(1.0), suggest_loss_scale(1e-3), suggest_loss_scale(65504.0)
    (32768.0, 33554432.0, 0.5)
    >>> suggest_loss_scale(2.0**-10) == 2.0**25    # 2**-10 * 2**26 == 65536 would overflow
    True
    """
    if isinstance(max_grad, dict):
        max_grad = _max_grad(max_grad)
    if not max_grad:
        return None
    top = dtype_range(dtype)["max"]
    k = _log2(top / max_grad)
    while max_grad * 2.0**k >= top:
        k -= 1
    while max_grad * 2.0 ** (k + 1) < top:
        k += 1
    return 2.0**k


def _max_grad(magnitudes: dict) -> float:
    return max(magnitudes["total"][k]["max"] for k in ("gradients", "weight_gradients"))


def flushed_after_scale(magnitudes: dict, scale: float, dtype: Any = torch.float16) -> float:
    """The fraction of nonzero activation gradients still below ``dtype``'s smallest subnormal
    after multiplying them by ``scale`` (a power of two).

    >>> s = _empty_stats(); _add_tensor(s, torch.tensor([2.0**-30, 2.0**-26, 1.0, 1.0]))
    >>> mags = {"total": {"gradients": s}}
    >>> [flushed_after_scale(mags, 2.0**k) for k in (0, 2, 6)]
    [0.5, 0.25, 0.0]
    """
    r = dtype_range(dtype)
    hist = magnitudes["total"]["gradients"]["hist"]
    return _below(hist, r["subnormal"], shift=_log2(scale)) / max(int(hist.sum()), 1)


def describe(magnitudes: dict, dtype: Any = torch.float16) -> str:
    """The numbers of :func:`range_plot` as text, one line per kind plus the loss scale.

    >>> s = _empty_stats(); _add_tensor(s, torch.tensor([0.0, 2.0**-30, 2.0**-20, 1.0]))
    >>> mags = {"total": {"activations": s, "gradients": s, "weight_gradients": _empty_stats()}}
    >>> print(describe(mags))
    fp16: zero below 2**-24, subnormal below 2**-14, inf above 65504
    activations: 33.3% of nonzero values become zero, 66.7% zero or subnormal, 0% inf (exact zeros: 25% of all)
    gradients: 33.3% of nonzero values become zero, 66.7% zero or subnormal, 0% inf (exact zeros: 25% of all)
    loss scale 2**15 keeps max|grad| (1) below 65504; with it 0% of nonzero gradients become zero
    >>> describe(mags, "bf16").splitlines()[-1]
    'no gradient becomes zero in bf16: no loss scale needed'
    """
    r = dtype_range(dtype)
    lines = [f"{r['name']}: zero below 2**{_log2(r['subnormal'])}, subnormal below 2**{_log2(r['normal'])}, "
             f"inf above {_num(r['max'])}"]
    for kind in KINDS:
        f = summarize(magnitudes["total"][kind], r["dtype"])
        lines.append(f"{kind}: {_pct(f['below_subnormal'])} of nonzero values become zero, "
                     f"{_pct(f['below_normal'])} zero or subnormal, {_pct(f['above_max'])} inf "
                     f"(exact zeros: {_pct(f['zero_fraction'])} of all)")
    scale = suggest_loss_scale(magnitudes, r["dtype"])
    if scale is None:
        lines.append("all gradients are zero")
    elif flushed_after_scale(magnitudes, 1.0, r["dtype"]) == 0:
        lines.append(f"no gradient becomes zero in {r['name']}: no loss scale needed")
    else:
        lines.append(f"loss scale 2**{_log2(scale)} keeps max|grad| ({_max_grad(magnitudes):.3g}) below "
                     f"{_num(r['max'])}; with it {_pct(flushed_after_scale(magnitudes, scale, r['dtype']))} "
                     f"of nonzero gradients become zero")
    return "\n".join(lines)


def record_loss_scale(scaler: "torch.amp.GradScaler", log: dict | None = None) -> dict:
    """Call in place of ``scaler.update()``: updates the scaler and notes the scale that step used.

    A step was skipped (inf/NaN gradients) exactly when ``update()`` lowered the
    scale. Returns ``log`` (a new one the first time): ``{"scales": [...], "skipped": [step, ...]}``,
    ready for ``loss_scale_plot(**log)``.

    >>> w = torch.nn.Parameter(torch.ones(1)); opt = torch.optim.SGD([w], lr=0.1)
    >>> scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    >>> log = None
    >>> for g in (1.0, float("inf"), 1.0):      # the second step's gradient overflows
    ...     opt.zero_grad(); scaler.scale((w * g).sum()).backward(); scaler.step(opt)
    ...     log = record_loss_scale(scaler, log)
    >>> log
    {'scales': [8.0, 16.0, 8.0], 'skipped': [1]}
    """
    log = {"scales": [], "skipped": []} if log is None else log
    used = float(scaler.get_scale())
    scaler.update()
    log["scales"].append(used)
    if float(scaler.get_scale()) < used:
        log["skipped"].append(len(log["scales"]) - 1)
    return log


# ----------------------------------------------------------------------------- figures

def _figure(**kw: Any) -> Any:
    """A matplotlib Figure on an Agg canvas, outside pyplot (no global state, nothing shown)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kw)
    FigureCanvasAgg(fig)
    return fig


def check_figure_path(path: str | os.PathLike, what: str) -> None:
    """Fail before any work when a figure cannot be written to ``path``: nothing can be written there
    (:func:`ampfx.paths.check_writable`; folders still missing are made when the figure is saved), or matplotlib
    writes no figure of its extension (without one, matplotlib's default format). ``what`` begins the message
    (``"range_plot(path='x.txt')"``)."""
    from matplotlib.figure import Figure

    check_writable(path, what)
    kinds = Figure().canvas.get_supported_filetypes()
    suffix = Path(path).suffix.lstrip(".").lower()
    if suffix and suffix not in kinds:
        raise ArgumentError(f"{what}: matplotlib writes no .{suffix} figure; give one of "
                            f"{', '.join('.' + k for k in sorted(kinds))}")


def _checked(path: Any, caller: str) -> None:
    """A plot's ``path`` (``None``: nothing written) checked before the figure is drawn."""
    if path is not None:
        check_figure_path(path, f"{caller}(path={str(path) if isinstance(path, os.PathLike) else path!r})")


def _save(fig: Any, path: Any, caller: str) -> Any:
    """``fig`` written to ``path`` (its folders made first), when given."""
    if path is None:
        return fig
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise PathError(f"{caller}(path={str(path)!r}): cannot write the figure there ({e.strerror or e})") from None
    return fig


def _pct(x: float) -> str:
    return f"{100 * x:.3g}%"


def _num(v: float) -> str:
    return f"{v:g}" if v < 1e6 else f"{v:.3g}"


def _pow2(k: int) -> str:
    return f"$2^{{{k}}}$"


def _view(hists: Sequence[np.ndarray], r: dict) -> tuple[int, int]:
    """The x range (log2) that shows the data and the dtype's range lines."""
    used = np.flatnonzero(sum(hists))
    lo = min([_log2(r["subnormal"])] + ([int(EXPONENTS[used[0]])] if used.size else []))
    hi = max([math.log2(r["max"])] + ([int(EXPONENTS[used[-1]]) + 1] if used.size else []))
    return lo - 3, math.ceil(hi) + 3


def _bands(ax: Any, r: dict, lo: int, hi: int) -> None:
    """Shade what the dtype loses and draw its range lines (labelled, so they show in the legend)."""
    sub, norm, top = _log2(r["subnormal"]), _log2(r["normal"]), math.log2(r["max"])
    ax.axvspan(lo, sub, color="tab:red", alpha=0.10, lw=0)
    ax.axvspan(sub, norm, color="tab:orange", alpha=0.10, lw=0)
    ax.axvspan(top, hi, color="tab:red", alpha=0.10, lw=0)
    n = r["name"]
    ax.axvline(sub, color="tab:red", lw=1.2, label=f"{n} smallest subnormal {_pow2(sub)}")
    ax.axvline(norm, color="tab:orange", lw=1.2, ls="--", label=f"{n} smallest normal {_pow2(norm)}")
    ax.axvline(top, color="tab:red", lw=1.2, ls=":", label=f"{n} max {_num(r['max'])}")


def _bars(ax: Any, hist: np.ndarray, r: dict, log_y: bool) -> None:
    """The histogram in percent of nonzero values, bars coloured by what the dtype makes of them."""
    total = hist.sum()
    keep = hist > 0
    e, pct = EXPONENTS[keep], 100.0 * hist[keep] / max(total, 1)
    colors = np.where(e < _log2(r["subnormal"]), "tab:red",
                      np.where(e < _log2(r["normal"]), "tab:orange",
                               np.where(e + 1 > math.log2(r["max"]), "tab:purple", "tab:blue")))
    ax.bar(e, pct, width=1.0, align="edge", color=colors, edgecolor="white", lw=0.3)
    ax.set_ylabel("% of nonzero values")
    if log_y:
        from matplotlib.ticker import FuncFormatter

        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v <= 100 else ""))  # headroom: no 10^4 %


def _headroom(ax: Any, top: float, log_y: bool, used: float = 0.6) -> None:
    """Raise the y limit so the bars (highest ``top``) fill the lower ``used`` of the axes, below the text."""
    if top <= 0:
        return
    if not log_y:
        ax.set_ylim(0, top / used)
        return
    bottom = ax.get_ylim()[0]
    ax.set_ylim(bottom, bottom * (top / bottom) ** (1 / used))


def _fraction_text(s: dict, r: dict, what: str) -> str:
    return (f"{_pct(s['below_subnormal'])} of nonzero {what} < {_pow2(_log2(r['subnormal']))}: zero in {r['name']}\n"
            f"{_pct(s['below_normal'])} < {_pow2(_log2(r['normal']))} (subnormal or zero)\n"
            f"{_pct(s['above_max'])} > {_num(r['max'])}: inf\n"
            f"exact zeros: {_pct(s['zero_fraction'])} of all values (not drawn)")


def _shifted(ax: Any, hist: np.ndarray, k: int) -> None:
    """Outline of the gradient histogram after multiplying by ``2**k``."""
    keep = hist > 0
    e, pct = EXPONENTS[keep] + k, 100.0 * hist[keep] / max(hist.sum(), 1)
    ax.bar(e, pct, width=1.0, align="edge", fill=False, edgecolor="tab:green", lw=1.0,
           label=f"gradients × loss scale {_pow2(k)}")


def _scale_text(magnitudes: dict, s: dict, r: dict, scale: float | None) -> str:
    """What :func:`suggest_loss_scale` proposes and how much would still flush to zero with it."""
    if scale is None:
        return "all gradients are zero"
    if s["below_subnormal"] == 0:
        return f"no gradient flushes to zero in {r['name']}: no loss scale needed"
    k, left = _log2(scale), flushed_after_scale(magnitudes, scale, r["dtype"])
    return (f"loss scale {_pow2(k)}: the largest power of two keeping max|grad| × scale < {_num(r['max'])}\n"
            f"(max|grad| {_max_grad(magnitudes):.3g}, activation and weight gradients); "
            f"then {_pct(left)} flush to zero (was {_pct(s['below_subnormal'])})")


def _annotate(ax: Any, text: str) -> None:
    ax.text(0.01, 0.97, text, transform=ax.transAxes, va="top", ha="left", fontsize=8,
            bbox={"boxstyle": "round", "fc": "white", "ec": "0.7", "alpha": 0.9})


def _ticks(ax: Any, lo: int, hi: int) -> None:
    step = next(s for s in (2, 4, 8, 16, 32) if (hi - lo) / s <= 16)
    ticks = np.arange(math.ceil(lo / step) * step, hi + 1, step)
    ax.set_xticks(ticks, [_pow2(int(t)) for t in ticks])
    ax.set_xlim(lo, hi)


def range_plot(magnitudes: dict, dtype: Any = torch.float16, path: Any = None, *, log_y: bool = False) -> Any:
    """Histograms of |activation| and |activation gradient| (log2 x axis) against ``dtype``'s range.

    Two axes, titled ``"activations"`` and ``"activation gradients"``. Each has
    vertical lines at the dtype's smallest subnormal, smallest normal and max
    (``torch.finfo``), the part of the axis the dtype loses shaded, bars coloured
    red (becomes zero), orange (subnormal), blue (fine), purple (becomes inf), and
    a box with the fractions. The gradient axis also outlines the histogram shifted
    by :func:`suggest_loss_scale`'s scale (when any gradient would flush to zero),
    and says how much would still flush. ``log_y`` draws the y axis
    logarithmically (the guide's Figure 3). Saves a PNG to ``path`` if given (its folders made; a path
    nothing can be written to is a :class:`~ampfx.errors.PathError` before anything is drawn).
    Returns the Figure.
    """
    _checked(path, "range_plot")
    r = dtype_range(dtype)
    lo, hi = _view([magnitudes["total"][k]["hist"] for k in KINDS], r)
    fig = _figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, kind in zip(axes, KINDS):
        _panel(ax, magnitudes, kind, r, (lo, hi), log_y)
    _ticks(axes[-1], lo, hi)
    axes[-1].set_xlabel("|value| (log2 scale; the bar at $2^e$ counts values in $[2^e, 2^{e+1})$)")
    fig.suptitle(f"float32 magnitudes against the {r['name']} range ({len(magnitudes['gradients'])} sites)")
    return _save(fig, path, "range_plot")


def _panel(ax: Any, magnitudes: dict, kind: str, r: dict, view: tuple[int, int], log_y: bool) -> None:
    """One histogram of ``range_plot``: bands, bars, (shifted gradients), the text box, the legend."""
    stats = magnitudes["total"][kind]
    s = summarize(stats, r["dtype"])
    _bands(ax, r, *view)
    _bars(ax, stats["hist"], r, log_y)
    ax.set_title({"activations": "activations", "gradients": "activation gradients"}[kind])
    text = _fraction_text(s, r, kind)
    if kind == "gradients":
        scale = suggest_loss_scale(magnitudes, r["dtype"])
        if scale is not None and s["below_subnormal"] > 0:
            _shifted(ax, stats["hist"], _log2(scale))
        text += "\n" + _scale_text(magnitudes, s, r, scale)
    _annotate(ax, text)
    ax.legend(loc="upper right", fontsize=8)
    _headroom(ax, 100.0 * stats["hist"].max() / max(stats["hist"].sum(), 1), log_y)


def _skip_steps(skipped: Sequence | None, n: int) -> list[int]:
    """Indices of skipped steps from indices or a boolean mask of length ``n``."""
    if skipped is None:
        return []
    skipped = list(skipped)
    if len(skipped) == n and all(isinstance(s, (bool, np.bool_)) for s in skipped):
        return [i for i, s in enumerate(skipped) if s]
    return sorted(int(s) for s in skipped)


def loss_scale_plot(scales: Sequence[float], skipped: Sequence | None = None, path: Any = None, *,
                    suggested: float | None = None) -> Any:
    """A GradScaler's loss scale per step on a log2 y axis, skipped steps (inf/NaN) marked with red crosses.

    ``scales``: the scale each step used (see :func:`record_loss_scale`);
    ``skipped``: step indices or a boolean mask; ``suggested``: a constant scale
    to draw for comparison (e.g. :func:`suggest_loss_scale`). Saves a PNG to
    ``path`` if given (checked first, as :func:`range_plot` checks it). Returns the
    Figure (one axes titled ``"GradScaler loss scale"``).
    """
    _checked(path, "loss_scale_plot")
    scales = [float(s) for s in scales]
    steps = np.arange(len(scales))
    fig = _figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.plot(steps, scales, drawstyle="steps-post", color="tab:blue", label="loss scale")
    skips = _skip_steps(skipped, len(scales))
    if skips:
        ax.plot(skips, [scales[i] for i in skips], "x", color="tab:red", ms=7, mew=1.8,
                label=f"skipped step (inf/NaN): {len(skips)} of {len(scales)}")
    if suggested:
        ax.axhline(suggested, color="tab:green", ls="--", lw=1,
                   label=f"suggested constant scale {_pow2(_log2(suggested))}")
    ax.set_yscale("log", base=2)
    ax.set_title("GradScaler loss scale")
    ax.set_xlabel("step")
    ax.set_ylabel("scale (log2)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path, "loss_scale_plot")

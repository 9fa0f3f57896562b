"""Device capability probes: does a tiny instance of an op run in the low dtype here?

Some kernels have no low-precision (or no mixed-dtype) version on some
devices or torch versions. Measured on CPU: oneDNN's bf16 LSTM needs AVX-512;
``avg_pool3d`` has no bfloat16 or float16 kernel (torch 2.13); torch 2.2 has
no float16 ``layer_norm``, ``avg_pool2d``, ``interpolate`` or reflection /
replication ``pad``. Before the policy assigns a low dtype to such an op,
:func:`check` runs a tiny forward and backward of it on the target device,
once per process, and returns the error text if it fails (the op then stays
float32 and the report says why).

A kernel is picked by more than the op's name: ``avg_pool`` covers 1-d, 2-d,
3-d and adaptive pooling, ``interpolate`` covers every mode. :func:`variant_of`
reads a node's :class:`Variant` (spatial dimensions and mode) from its target's
name, its ``mode`` argument or attribute, and its input's rank, and the probe
builds that variant:

>>> check("layer_norm", torch.bfloat16, "cpu") is None
True
>>> variant_of("avg_pool", "torch.nn.functional.avg_pool3d", {}, None, 5)
Variant(dims=3, mode=None)
>>> variant_of("interpolate", "torch.nn.functional.interpolate", {"mode": "bilinear"}, None, 4)
Variant(dims=2, mode='bilinear')
>>> variant_of("pad", "aten.reflection_pad1d.default", {}, None, None)
Variant(dims=1, mode='reflect')
>>> variant_of("linear", "torch._C._nn.linear", {}, None, 3)  # one kernel whatever the rank
Variant(dims=None, mode=None)
"""
from __future__ import annotations

import functools
import operator
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import TensorMetadata


@dataclass(frozen=True)
class Variant:
    """Which kernel of an op kind a node runs: ``dims`` spatial dimensions
    (``None``: the op's usual 2-d form) and ``mode`` (interpolation or padding
    mode, ``"adaptive"`` pooling; ``None``: the op's default)."""

    dims: int | None = None
    mode: str | None = None


# words in a target's name that name its mode (aten.upsample_bilinear2d, nn.ReflectionPad2d,
# F.adaptive_avg_pool2d), longest first; the value is the mode as F.interpolate / F.pad spell it
_MODE_WORDS = {"nearest_exact": "nearest-exact", "trilinear": "trilinear", "bilinear": "bilinear",
               "bicubic": "bicubic", "nearest": "nearest", "linear": "linear", "area": "area",
               "reflect": "reflect", "replicat": "replicate", "circular": "circular", "adaptive": "adaptive"}
_MODES = set(_MODE_WORDS.values())

VARIED = frozenset({"conv", "conv_transpose", "avg_pool", "max_pool", "interpolate", "pad"})
"""Probe kinds whose kernel depends on the :class:`Variant`."""


def variant_of(kind: str, target: str, kwargs: Mapping[str, Any], module: nn.Module | None, rank: int | None,
               args: tuple = ()) -> Variant:
    """The :class:`Variant` of probe ``kind`` a node runs. ``target`` is its
    function, method, module class or ATen name; ``kwargs`` / ``args`` its
    arguments; ``module`` the called module (``nn.Upsample`` keeps its mode as
    an attribute); ``rank`` the number of dimensions of its first input, if
    known. Kinds with one kernel (not in :data:`VARIED`) have one variant."""
    if kind not in VARIED:
        return Variant()
    name = target.rsplit(".", 1)[-1] if not target.startswith("aten.") else target.split(".")[1]
    name = re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()  # AvgPool3d -> avg_pool3d
    found = re.search(r"(\d)d(?:_|$)", name)
    dims = int(found.group(1)) if found else (rank - 2 if rank is not None and rank >= 3 else None)
    mode = kwargs.get("mode", getattr(module, "mode", None))
    if not isinstance(mode, str):
        mode = next((a for a in args if isinstance(a, str) and a in _MODES), None)
    if mode is None:
        mode = next((m for word, m in _MODE_WORDS.items() if word in name), None)
    return Variant(dims, mode)


def _t(dtype: torch.dtype, device: str, *shape: int) -> torch.Tensor:
    """An input of distinct values in [-1, 1], made without the random generator."""
    n = 1
    for s in shape:
        n *= s
    return torch.linspace(-1, 1, n, device=device).reshape(shape).to(dtype).requires_grad_()


def _spatial(v: Variant, default: int = 2) -> int:
    return v.dims if v.dims in (1, 2, 3) else default


def _conv(transpose: bool) -> Callable:
    def run(dtype: torch.dtype, device: str, v: Variant) -> torch.Tensor:
        n = _spatial(v)
        fn = getattr(F, f"conv_transpose{n}d" if transpose else f"conv{n}d")
        w = _t(dtype, device, *((3, 4) if transpose else (4, 3)), *[3] * n)
        return fn(_t(dtype, device, 1, 3, *[5] * n), w, _t(dtype, device, 4))
    return run


def _pool(kind: str) -> Callable:
    def run(dtype: torch.dtype, device: str, v: Variant) -> torch.Tensor:
        n = _spatial(v)
        x = _t(dtype, device, 1, 2, *[4] * n)
        if v.mode == "adaptive":
            out = getattr(F, f"adaptive_{kind}_pool{n}d")(x, 3)
        else:
            out = getattr(F, f"{kind}_pool{n}d")(x, 2)
        return out[0] if isinstance(out, tuple) else out
    return run


def _interpolate(dtype: torch.dtype, device: str, v: Variant) -> torch.Tensor:
    n = {"linear": 1, "bilinear": 2, "bicubic": 2, "trilinear": 3}.get(v.mode or "", _spatial(v))
    return F.interpolate(_t(dtype, device, 1, 2, *[4] * n), scale_factor=2, mode=v.mode or "nearest")


def _pad(dtype: torch.dtype, device: str, v: Variant) -> torch.Tensor:
    n = _spatial(v)
    return F.pad(_t(dtype, device, 1, 2, *[4] * n), (1, 1) * n, mode=v.mode or "constant")


def _norm(fn: Callable, shape: tuple, affine: int) -> Callable:
    def run(dtype: torch.dtype, device: str, v: Variant) -> torch.Tensor:
        w = torch.ones(affine, device=device, requires_grad=True)
        return fn(_t(dtype, device, *shape), w)
    return run


def _rnn(cls: type, cell: bool) -> Callable:
    def run(dtype: torch.dtype, device: str, v: Variant) -> torch.Tensor:
        m = cls(4, 4).to(device=device, dtype=dtype)  # random init: check() forks the CPU generator
        out = m(_t(dtype, device, *((2, 4) if cell else (3, 2, 4))))
        return out[0] if isinstance(out, tuple) else out
    return run


def _fixed(fn: Callable[[Callable[..., torch.Tensor]], torch.Tensor]) -> Callable:
    """A probe with one form: ``fn(t)``, where ``t(*shape)`` makes an input."""
    return lambda dtype, device, v: fn(functools.partial(_t, dtype, device))


PROBES: dict[str, Callable[[torch.dtype, str, Variant], torch.Tensor]] = {
    # GEMMs and attention
    "linear": _fixed(lambda t: F.linear(t(4, 8), t(6, 8), t(6))),
    "bilinear": _fixed(lambda t: F.bilinear(t(4, 3), t(4, 5), t(2, 3, 5), t(2))),
    "matmul": _fixed(lambda t: t(2, 4, 8) @ t(8, 3)),
    "mm": _fixed(lambda t: torch.mm(t(4, 8), t(8, 3))),
    "mv": _fixed(lambda t: torch.mv(t(4, 8), t(8))),
    "bmm": _fixed(lambda t: torch.bmm(t(2, 4, 8), t(2, 8, 3))),
    "baddbmm": _fixed(lambda t: torch.baddbmm(t(2, 4, 3), t(2, 4, 8), t(2, 8, 3))),
    "addmm": _fixed(lambda t: torch.addmm(t(3), t(4, 8), t(8, 3))),
    "addbmm": _fixed(lambda t: torch.addbmm(t(4, 3), t(2, 4, 8), t(2, 8, 3))),
    "einsum": _fixed(lambda t: torch.einsum("bij,bjk->bik", t(2, 4, 8), t(2, 8, 3))),
    "conv": _conv(transpose=False),
    "conv_transpose": _conv(transpose=True),
    "scaled_dot_product_attention": _fixed(
        lambda t: F.scaled_dot_product_attention(t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8))),
    "multi_head_attention": lambda dtype, device, v: nn.MultiheadAttention(8, 2).to(device, dtype)(
        *(_t(dtype, device, 4, 1, 8) for _ in range(3)))[0],
    # windows and resampling: kernels differ by dimensions and mode
    "avg_pool": _pool("avg"),
    "max_pool": _pool("max"),
    "interpolate": _interpolate,
    "pad": _pad,
    # normalisation: low-precision data with float32 affine parameters (a mixed-dtype kernel)
    "batch_norm": _norm(lambda x, w: F.batch_norm(x, torch.zeros_like(w), torch.ones_like(w), w, w * 0, True),
                        (4, 3, 2, 2), 3),
    "layer_norm": _norm(lambda x, w: F.layer_norm(x, (3,), w, w * 0), (2, 3), 3),
    "group_norm": _norm(lambda x, w: F.group_norm(x, 1, w, w * 0), (2, 3, 4), 3),
    **({"rms_norm": _norm(lambda x, w: F.rms_norm(x, (3,), w), (2, 3), 3)} if hasattr(F, "rms_norm") else {}),
    # recurrent layers
    "lstm": _rnn(nn.LSTM, False),
    "gru": _rnn(nn.GRU, False),
    "rnn": _rnn(nn.RNN, False),
    "lstm_cell": _rnn(nn.LSTMCell, True),
    "gru_cell": _rnn(nn.GRUCell, True),
    "rnn_cell": _rnn(nn.RNNCell, True),
}
"""Probe kind -> ``run(dtype, device, variant)`` returning a tensor to backpropagate
from. Op table entries name their kind (``OpEntry.probe``). Elementwise ops have
no probe: every float dtype has them on CPU and CUDA."""


@functools.lru_cache(maxsize=None)
def check(kind: str, dtype: torch.dtype, device: str, variant: Variant = Variant()) -> str | None:
    """``None`` if probe ``kind`` runs forward and backward in ``dtype`` on
    ``device``, else the error text. Cached per process."""
    probe = PROBES.get(kind)
    if probe is None:
        return None
    try:
        # modules are built on the CPU: fork its generator so that converting leaves the user's random
        # stream as it was (a probe runs only at the first conversion of a process)
        with torch.enable_grad(), warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            probe(dtype, device, variant).float().sum().backward()
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return None


@dataclass(frozen=True)
class Arg:
    """A tensor argument of a call to probe: its sizes and dtype (a float one is made in the low dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Listed:
    """A list argument (``dim=[1, 2]``), kept hashable."""

    items: tuple


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout,
          type(Ellipsis), slice)


def shrunk(args: Any) -> Any:
    """``args`` (a tree of :class:`Arg`, tuples, :class:`Listed` and plain values) with every tensor size above
    one mapped to a small one, equal sizes to equal ones (2, 3, 4, ... in the order of size), so a probe keeps the
    shapes' agreements at a tiny cost.

    >>> shrunk((Arg((40, 8), torch.float32), Arg((50, 8), torch.float32)))
    (Arg(shape=(3, 2), dtype=torch.float32), Arg(shape=(4, 2), dtype=torch.float32))
    """
    sizes: set[int] = set()

    def collect(a: Any) -> None:
        if isinstance(a, Arg):
            sizes.update(n for n in a.shape if n > 1)
        elif isinstance(a, (tuple, Listed)):
            for x in (a.items if isinstance(a, Listed) else a):
                collect(x)
    collect(args)
    small = {n: i + 2 for i, n in enumerate(sorted(sizes))}

    def remap(a: Any) -> Any:
        if isinstance(a, Arg):
            return Arg(tuple(small.get(n, n) for n in a.shape), a.dtype)
        if isinstance(a, Listed):
            return Listed(tuple(remap(x) for x in a.items))
        return tuple(remap(x) for x in a) if isinstance(a, tuple) else a
    return remap(args)


def _made(a: Any, low: torch.dtype, device: str) -> Any:
    if isinstance(a, Arg):
        if a.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return _t(low, device, *a.shape) if a.shape else torch.tensor(0.5, device=device, dtype=low)
        return torch.zeros(a.shape, dtype=a.dtype, device=device)  # indices, masks: valid everywhere
    if isinstance(a, Listed):
        return [_made(x, low, device) for x in a.items]
    return tuple(_made(x, low, device) for x in a) if isinstance(a, tuple) else a


_REFUSALS = ("not implemented", "not supported", "unsupported", "does not support", "no kernel")
_DTYPE_WORDS = ("bfloat16", "half", "float16", "dtype", "precision")


def _missing(e: Exception) -> bool:
    """Does ``e`` say the op has no kernel for a dtype (not that the probe's inputs were wrong)? (A refusal that
    names a dtype: ``"cdist" not implemented for 'BFloat16'``, ``linalg.inv: Low precision dtypes not
    supported``.)"""
    text = str(e).lower()
    return isinstance(e, NotImplementedError) or (any(w in text for w in _REFUSALS)
                                                   and any(w in text for w in _DTYPE_WORDS))


def _run_call(fn: Callable, method: str | None, args: tuple, kwargs: tuple, dtype: torch.dtype,
              device: str) -> None:
    made = _made(args, dtype, device)
    kw = {k: _made(v, dtype, device) for k, v in kwargs}
    out = getattr(made[0], method)(*made[1:], **kw) if method else fn(*made, **kw)
    floats = [t for t in torch.utils._pytree.tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if floats:
        sum(t.float().sum() for t in floats).backward()


@functools.lru_cache(maxsize=4096)
def check_call(fn: Callable, method: str | None, args: tuple, kwargs: tuple, dtype: torch.dtype,
               device: str) -> str | None:
    """The error text if the call ``fn(*args, **kwargs)`` (or ``args[0].<method>(...)``) has no ``dtype`` kernel
    on ``device`` (forward or backward), on tiny inputs (:func:`shrunk` :class:`Arg` trees; float tensors made in
    ``dtype``); ``None`` where it runs or the probe cannot tell (its inputs fail in float32 too, or fail for
    another reason than a missing kernel). Cached per process.

    >>> print(check_call(torch.cdist, None, (Arg((3, 2), torch.float32), Arg((4, 2), torch.float32)), (),
    ...                  torch.bfloat16, "cpu"))
    NotImplementedError: "cdist" not implemented for 'BFloat16'
    >>> check_call(torch.add, None, (Arg((3, 2), torch.float32), 1.0), (), torch.bfloat16, "cpu") is None
    True
    """
    try:
        with torch.enable_grad(), warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            try:
                _run_call(fn, method, args, kwargs, dtype, device)
                return None
            except Exception as e:  # noqa: BLE001 - classified below
                if not _missing(e):
                    return None
                err = e
            _run_call(fn, method, args, kwargs, torch.float32, device)  # the inputs are fine: dtype is the cause
    except Exception:  # noqa: BLE001 - float32 fails too (or the device is not here): the probe cannot tell
        return None
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200] if str(err).strip() else ''}"


_NOT_PROBED = frozenset({operator.getitem, getattr, len, torch.Tensor.size, torch.Tensor.dim})


def missing_kernel(node: fx.Node, low: torch.dtype, device: str) -> str | None:
    """An op without a probe of its own (:data:`PROBES`) tried in ``low`` on its own
    arguments' shapes, shrunk (:func:`ampfx.ops.check_call`): the error text where its ``low`` kernel is
    missing (``torch.cdist`` in bfloat16 on CPU), else ``None`` (also where its arguments' shapes are not
    known: no example inputs, symbolic sizes, values computed in the graph)."""
    if node.op not in ("call_function", "call_method") or node.target in _NOT_PROBED:
        return None
    known = [True]

    def spec(a: Any) -> Any:
        if isinstance(a, fx.Node):
            meta = a.meta.get("tensor_meta")  # shape propagation's record (ampfx.meta.TENSOR_META)
            if isinstance(meta, TensorMetadata) and all(type(n) is int for n in meta.shape):
                return Arg(tuple(meta.shape), meta.dtype)
            known[0] = False
        elif isinstance(a, list):
            return Listed(tuple(spec(x) for x in a))
        elif isinstance(a, tuple):
            return tuple(spec(x) for x in a)
        elif isinstance(a, _PLAIN):
            return a
        known[0] = False
        return None

    args, kwargs = spec(tuple(node.args)), tuple(sorted((k, spec(v)) for k, v in node.kwargs.items()))
    if not known[0] or not any(isinstance(a, Arg) and a.dtype in (torch.float32, torch.float16, torch.bfloat16) for a in args):
        return None
    method = str(node.target) if node.op == "call_method" else None
    if method is not None and not isinstance(args[0], Arg):
        return None
    small = shrunk((args, kwargs))
    try:
        return check_call(None if method else node.target, method, *small, low, device)
    except TypeError:  # an unhashable argument
        return None


def describe(variant: Variant) -> str:
    """``" (3-d)"``, ``" (2-d, bilinear)"`` or ``""``: the variant as the log says it."""
    parts = [f"{variant.dims}-d"] if variant.dims else []
    parts += [variant.mode] if variant.mode else []
    return f" ({', '.join(parts)})" if parts else ""


_ROUNDS_ONCE: dict[str, Callable[..., torch.Tensor]] = {"softmax": torch.softmax, "softmin": F.softmin}


@functools.lru_cache(maxsize=None)
def rounds_once(op: str, dtype: torch.dtype, device: str) -> bool:
    """Does ``op``'s ``dtype`` kernel on ``device`` compute in float32 inside and round once, so that
    ``op(x)`` equals ``op(x, dtype=torch.float32).to(dtype)`` within one unit in the last place? Tried
    on rows of 7, 64 and 4099 elements (a low-precision accumulation over 4099 would be off by many);
    ``False`` where the kernel is missing or the device is not here. Cached per process.

    >>> rounds_once("softmax", torch.bfloat16, "cpu")
    True
    """
    fn = _ROUNDS_ONCE.get(op)
    if fn is None:
        return False
    try:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n in (7, 64, 4099):
                x = (torch.randn(4, n, generator=g) * 3).to(device=device, dtype=dtype)
                low, ref = fn(x, -1), fn(x, -1, dtype=torch.float32).to(dtype).float()
                ulp = torch.finfo(dtype).eps * ref.abs().clamp_min(torch.finfo(dtype).tiny)
                if low.dtype != dtype or not bool(((low.float() - ref).abs() <= ulp).all()):
                    return False
    except Exception:  # noqa: BLE001 - no such kernel here
        return False
    return True

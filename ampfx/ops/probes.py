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
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F


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

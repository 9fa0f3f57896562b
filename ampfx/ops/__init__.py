"""The op tables: which list every op is on, and why.

This module is data. No pass names an op; passes ask :func:`lookup` for the
:class:`OpEntry` of a node and read its fields.

One op has one canonical name however it is reached: ``nn.Linear``,
``F.linear`` and ``aten.linear`` are all ``linear``; ``nn.Softmax``,
``F.softmax``, ``torch.softmax`` and ``Tensor.softmax`` are all ``softmax``.
Keys are the torch callables themselves, ``Tensor`` method names (the strings
``torch.fx`` records for ``call_method`` nodes), ``nn.Module`` types and ATen
op-packet names (so graphs captured at the ATen level map to the same names
and the same policy).

>>> from ampfx.ops import lookup_name, ENTRIES
>>> import torch.nn.functional as F, torch.nn as nn
>>> lookup_name(F.softmax), lookup_name(nn.Softmax), lookup_name("softmax")
('softmax', 'softmax', 'softmax')
>>> ENTRIES["softmax"].category
<Category.DENY: 'deny'>

The package holds the other op facts beside the tables: :mod:`~ampfx.ops.autocast_lists` (torch.autocast's own
lists), :mod:`~ampfx.ops.custom_ops` (``torch.library`` ops), :mod:`~ampfx.ops.registration` (``register_op``),
:mod:`~ampfx.ops.probes` (kernels tried on the device) and :mod:`~ampfx.ops.shape_memo`.
"""
from __future__ import annotations

import builtins
import enum
import functools
import operator
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F



class Category(str, enum.Enum):
    """What an op's list says about its precision.

    ``ALLOW``, ``INFER``, ``CLEAR`` and ``DENY`` are TF-AMP's lists and take part
    in painting (see ``ampfx.passes.paint``). ``FP32`` and ``PASS`` do not.
    """

    ALLOW = "allow"  #: worth running in low precision (GEMMs, convolutions)
    INFER = "infer"  #: safe either way; low when between low-precision ops
    CLEAR = "clear"  #: numerically neutral; follows its neighbours
    DENY = "deny"  #: needs float32, and float32 flows forward through infer/clear
    FP32 = "fp32"  #: float32 here only, no propagation (unlisted ops, fp32 modules, missing kernels)
    PASS = "pass"  #: left as written (no float data, explicit casts, factories)


LISTS = (Category.ALLOW, Category.INFER, Category.CLEAR, Category.DENY)
"""The four lists a policy can edit, in the order the env variables name them."""


class Result(str, enum.Enum):
    """What a ``PASS`` op returns (``OpEntry.result``)."""

    NONFLOAT = "nonfloat"  #: no float data (sizes, comparisons, indices)
    CAST = "cast"  #: an explicit conversion written in the model
    FP32 = "fp32"  #: float32 whatever its inputs (a gather from a float32 table)


@dataclass(frozen=True)
class OpEntry:
    """One op's entry: its list and the reason, plus what the rewrite must know.

    ``fp16`` / ``bf16`` replace ``(category, reason)`` under that dtype, where
    range matters (bfloat16 has float32's exponent range; float16 overflows at
    65504). ``fp32_args`` name argument slots that stay float32 whatever the
    op's dtype (batch-norm statistics, affine parameters). ``index_args`` are
    integer or boolean slots that are never cast. ``accum_dtype`` is the name of
    the op's own accumulation-dtype argument, used instead of a cast.
    ``result`` says what a ``PASS`` op returns (:class:`Result`; ``None``:
    unknown until run). ``gemm`` is the operand layout
    the padding pass needs: ``"linear"`` (x[..., K], weight[N, K], bias[N]),
    ``"matmul"`` (a[..., M, K], b[..., K, N]) or ``"addmm"`` (c, a, b). ``flops``: how
    :mod:`ampfx.passes.gemm_cost` counts the forward's operations of an op with no ``gemm`` layout:
    ``"conv"`` (weight[C_out, C_in / groups, *kernel]), ``"conv_transpose"``, ``"convolution"`` (ATen's, with
    its ``transposed`` flag), ``"attention"`` (query, key, value), ``"attention_module"``
    (``nn.MultiheadAttention``) or ``"rnn"`` (a recurrent module: each weight matrix once per step and batch row).
    ``promotes``: the kernel takes mixed float dtypes and computes in the
    widest (PyTorch's type promotion, an exact upcast), so a float32 op needs
    no cast of a low input when another input is a float32 tensor with at
    least one dimension.

    What the passes need to know about an op's data, instead of its name:

    ``view``: the result may share storage with the first argument
    (``x.view(...)``, ``x[i]``, ``x.t()``): a cast made before an in-place write
    to either is stale after it, and the op moves no bytes of its own.
    ``select``: the result is a part of the first argument (``x[i]``, a
    container's item) and keeps its dtype; consumers cast the smaller
    selection (rule ``select``). ``reduction``: many input elements are
    summed or multiplied into each output element, so the reductions pass
    decides the op by how many (``sum``, ``var``, ``norm``, ``logsumexp``).
    ``fp32_accumulation``: the kernel accumulates in float32 whatever its
    input dtype (the report says so for a low-precision node), so under
    bfloat16 (float32's range) even a large reduction may follow its inputs. ``writes_low``: a float32
    op (softmax) whose low-precision kernel computes in float32 inside and rounds its result once; where
    every consumer reads its result low, it reads and writes the low dtype instead of writing float32 for a
    cast (the same values; :func:`ampfx.ops.probes.rounds_once` checks the kernel). ``split_bias``: the op's third argument (or
    ``bias=``) is a bias added last (``linear(x, w, b) == linear(x, w) + b``),
    so a low-precision call whose consumers all want float32 can leave it out
    and add it after the float32 cast. For a ``"cast"`` op, ``cast_to`` names
    the spellings that convert to one fixed dtype (``x.half()``, ``x.double()``) and ``cast_like`` those whose
    result takes the dtype of their tensor argument (``x.type_as(y)``).
    ``dtype_like``: for a factory, the spellings (functions, method names, ``"aten::name"``) whose
    result takes the dtype of their first tensor argument unless ``dtype=`` says otherwise
    (``torch.zeros_like(x)``, ``x.new_zeros(n)``).
    ``float_attrs``: for ``getattr``, the attribute names that hold a float
    tensor of the container (``topk(...).values``, ``x.T``), so that without
    shapes the attribute is known to be a selection, not a size or a dtype.

    What fidelity needs (``ampfx.passes.fidelity``): ``additive``: the result
    carries an operand's magnitude (``coords + delta``): a float32 operand's low
    bits survive only if the op computes in float32. ``exact``: the result
    depends on exact input values (an integer conversion, a comparison, an
    argmax): the float32 values it reads must not be rounded first.

    What FP8 needs (``ampfx.passes.fp8``): ``fp8``: a weight GEMM ``fp8=`` can run in FP8 (a linear layer:
    x[..., K] by weight[N, K]). ``chooses``: the result picks among its input's entries (``topk``, ``sort``,
    ``argmax``): a GEMM whose output reaches one is a router.
    """

    name: str
    category: Category
    reason: str
    fp16: tuple[Category, str] | None = None
    bf16: tuple[Category, str] | None = None
    fp32_args: tuple[int | str, ...] = ()
    index_args: tuple[int | str, ...] = ()
    accum_dtype: str | None = None
    result: Result | None = None
    probe: str | None = None
    gemm: str | None = None
    flops: str | None = None
    promotes: bool = False
    view: bool = False
    select: bool = False
    reduction: bool = False
    fp32_accumulation: bool = False
    writes_low: bool = False
    split_bias: bool = False
    cast_to: tuple[tuple[str, torch.dtype | None], ...] = ()
    cast_like: tuple[str, ...] = ()
    float_attrs: tuple[str, ...] = ()
    dtype_like: tuple[Any, ...] = ()
    additive: bool = False
    exact: bool = False
    fp8: bool = False
    chooses: bool = False

    def for_dtype(self, dtype: torch.dtype) -> tuple[Category, str]:
        """The ``(category, reason)`` that applies when converting to ``dtype``."""
        variant = {torch.float16: self.fp16, torch.bfloat16: self.bf16}.get(dtype)
        return variant if variant is not None else (self.category, self.reason)


class _Entries(dict):
    """Op name -> :class:`OpEntry`. ``get`` of one overload of a custom op (``"ns::op.overload"``,
    named on a list by itself) finds the op's entry (``"ns::op"``, :func:`ampfx.register_op`) when
    the overload has none of its own: the facts about an op's arguments (``fp32_args``) hold for
    every overload."""

    def get(self, name: Any, default: Any = None) -> Any:
        hit = dict.get(self, name)
        if hit is None and isinstance(name, str) and "::" in name and "." in name:
            hit = dict.get(self, name.rpartition(".")[0])
        return default if hit is None else hit


ENTRIES: dict[str, OpEntry] = _Entries()
REGISTERED: dict[str, str] = {}
"""Ops added by :func:`ampfx.register_op`: name -> the library that registered it."""
_ALIASES: dict[Any, str] = {}  # callable | module type | method name | "aten::name" -> canonical name


def _op(
    name: str,
    category: Category,
    reason: str,
    *,
    fns: Iterable[Callable] = (),
    methods: Iterable[str] = (),
    modules: Iterable[type] = (),
    aten: Iterable[str] = (),
    **fields: Any,
) -> None:
    assert name not in ENTRIES, f"duplicate op table entry {name!r}"
    ENTRIES[name] = OpEntry(name, category, reason, **fields)
    keys = [*fns, *methods, *modules, *(f"aten::{a}" for a in aten)]
    for key in keys:
        assert _ALIASES.get(key, name) == name, f"{key!r} is both {_ALIASES[key]!r} and {name!r}"
        _ALIASES[key] = name
    # the canonical name itself is always accepted where names are typed
    _ALIASES.setdefault(name, name)


def _torch_fns(*names: str) -> list[Callable]:
    """``torch.X``, ``torch.nn.functional.X`` and ``torch.special.X`` where they exist."""
    out = []
    for ns in (torch, F, torch.special, torch.linalg):
        for n in names:
            fn = getattr(ns, n, None)
            if fn is not None and fn not in out:
                out.append(fn)
    return out


def _mods(*names: str) -> list[type]:
    return [getattr(nn, n) for n in names if hasattr(nn, n)]


A, I, C, D, P = Category.ALLOW, Category.INFER, Category.CLEAR, Category.DENY, Category.PASS

# --------------------------------------------------------------------------- ALLOW
_GEMM = "GEMM: tensor-core friendly, low-precision inputs with float32 accumulation halve the bytes moved"
_op("linear", A, _GEMM, fns=[F.linear], modules=_mods("Linear", "LazyLinear"), aten=["linear"], gemm="linear",
    probe="linear", split_bias=True, fp8=True)
_op("bilinear", A, _GEMM, fns=_torch_fns("bilinear"), modules=_mods("Bilinear"), aten=["bilinear"], probe="bilinear")
_op("matmul", A, _GEMM, fns=[torch.matmul, operator.matmul], methods=["matmul", "__matmul__"], aten=["matmul"],
    gemm="matmul", probe="matmul")
_op("mm", A, _GEMM, fns=[torch.mm], methods=["mm"], aten=["mm"], gemm="matmul", probe="mm")
_op("mv", A, _GEMM, fns=[torch.mv], methods=["mv"], aten=["mv"], probe="mv")
_op("bmm", A, _GEMM, fns=[torch.bmm], methods=["bmm"], aten=["bmm"], gemm="matmul", probe="bmm")
_op("baddbmm", A, _GEMM, fns=[torch.baddbmm], methods=["baddbmm"], aten=["baddbmm"], gemm="addmm", probe="baddbmm")
_op("addmm", A, _GEMM, fns=[torch.addmm], methods=["addmm"], aten=["addmm"], gemm="addmm", probe="addmm")
_op("addbmm", A, _GEMM, fns=[torch.addbmm], methods=["addbmm"], aten=["addbmm"], probe="addbmm")
_op("einsum", A, _GEMM + " (einsum contracts like a batched matmul)", fns=[torch.einsum], aten=["einsum"], probe="einsum")
_CONV = "convolution: tensor-core friendly, low-precision inputs with float32 accumulation"
for _d in (1, 2, 3):
    _op(f"conv{_d}d", A, _CONV, fns=_torch_fns(f"conv{_d}d"), modules=_mods(f"Conv{_d}d", f"LazyConv{_d}d"), aten=[f"conv{_d}d"],
        probe="conv", flops="conv")
    _op(f"conv_transpose{_d}d", A, _CONV, fns=_torch_fns(f"conv_transpose{_d}d"),
        modules=_mods(f"ConvTranspose{_d}d", f"LazyConvTranspose{_d}d"), aten=[f"conv_transpose{_d}d"],
        probe="conv_transpose", flops="conv_transpose")
_op("convolution", A, _CONV, aten=["convolution", "_convolution"], probe="conv", flops="convolution")
_op("scaled_dot_product_attention", A,
    "fused attention: GEMMs inside, the kernel keeps softmax statistics in float32",
    fns=[F.scaled_dot_product_attention], aten=["scaled_dot_product_attention"],
    probe="scaled_dot_product_attention", flops="attention")
_op("multi_head_attention", A,
    "projections and attention are GEMMs; runs as one leaf with low-precision copies of its weights",
    fns=[F.multi_head_attention_forward], modules=_mods("MultiheadAttention"), probe="multi_head_attention",
    flops="attention_module")
_RNN = "recurrent cell: its gates are GEMMs; runs as a leaf with low-precision copies of its weights"
_op("lstm", A, _RNN, modules=_mods("LSTM"), aten=["lstm"], probe="lstm", flops="rnn")
_op("gru", A, _RNN, modules=_mods("GRU"), aten=["gru"], probe="gru", flops="rnn")
_op("rnn", A, _RNN, modules=_mods("RNN"), aten=["rnn_tanh", "rnn_relu"], probe="rnn", flops="rnn")
_op("lstm_cell", A, _RNN, modules=_mods("LSTMCell"), aten=["lstm_cell"], probe="lstm_cell", flops="rnn")
_op("gru_cell", A, _RNN, modules=_mods("GRUCell"), aten=["gru_cell"], probe="gru_cell", flops="rnn")
_op("rnn_cell", A, _RNN, modules=_mods("RNNCell"), aten=["rnn_tanh_cell", "rnn_relu_cell"], probe="rnn_cell", flops="rnn")

# --------------------------------------------------------------------------- CLEAR
_NEUTRAL = "numerically neutral: moves or selects values without arithmetic"
_views = ["view", "reshape", "permute", "transpose", "t", "flatten", "unflatten", "squeeze", "unsqueeze",
          "chunk", "split", "tensor_split", "unbind", "contiguous", "expand", "expand_as", "repeat", "narrow",
          "select", "flip", "roll", "movedim", "swapaxes", "view_as", "reshape_as", "clone", "detach",
          "tril", "triu", "index_select", "gather", "take_along_dim", "repeat_interleave", "diagonal",
          "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "topk", "sort", "unfold"]
# those whose result may share its first argument's storage (OpEntry.view)
_aliasing = {"view", "reshape", "permute", "transpose", "t", "flatten", "unflatten", "squeeze", "unsqueeze", "expand",
             "expand_as", "narrow", "select", "chunk", "split", "tensor_split", "unbind", "view_as", "reshape_as",
             "movedim", "swapaxes", "diagonal", "contiguous", "detach"}
_view_modules = {"pixel_shuffle": ("PixelShuffle",), "pixel_unshuffle": ("PixelUnshuffle",),
                 "channel_shuffle": ("ChannelShuffle",)}
for _name in _views:
    _op(_name, C, _NEUTRAL, fns=[f for f in _torch_fns(_name) if _name != "unfold"],  # F.unfold: im2col, below
        methods=[_name], aten=[_name, *(["native_channel_shuffle"] if _name == "channel_shuffle" else [])],
        modules=_mods(*_view_modules.get(_name, ())),
        index_args=(("index", 2) if _name in ("index_select", "gather") else ()), view=_name in _aliasing,
        chooses=_name in ("topk", "sort"))
_op("getitem", C, _NEUTRAL + "; a slice is cast after it is taken (fewer bytes)", fns=[operator.getitem],
    view=True, select=True)
_op("cat", C, _NEUTRAL, fns=_torch_fns("cat", "concat", "concatenate"), aten=["cat"])
_op("stack", C, _NEUTRAL, fns=_torch_fns("stack", "hstack", "vstack"), aten=["stack"])
_op("pad", C, "pads with a constant: neutral", fns=[F.pad], aten=["constant_pad_nd"], modules=_mods(
    "ZeroPad1d", "ZeroPad2d", "ZeroPad3d", "ConstantPad1d", "ConstantPad2d", "ConstantPad3d",
    "ReflectionPad1d", "ReflectionPad2d", "ReflectionPad3d", "ReplicationPad1d", "ReplicationPad2d",
    "ReplicationPad3d", "CircularPad1d", "CircularPad2d", "CircularPad3d"), probe="pad")
_op("identity", C, _NEUTRAL, modules=_mods("Identity", "Flatten", "Unflatten"))
_op("dropout", C, "zeroes and rescales: no range or precision risk",
    fns=_torch_fns("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"),
    modules=_mods("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout"),
    aten=["dropout", "native_dropout"])
_op("relu", C, "max(x, 0) is exact in any float format", fns=_torch_fns("relu", "relu_"), methods=["relu"],
    modules=_mods("ReLU"), aten=["relu"])
_op("relu6", C, "clamps: exact in any float format", fns=_torch_fns("relu6", "hardtanh"), modules=_mods("ReLU6", "Hardtanh"),
    aten=["hardtanh"])
_op("clamp", C, "clamps: exact in any float format", fns=_torch_fns("clamp", "clip"), methods=["clamp", "clip"],
    aten=["clamp"])
for _name in ("max", "min", "amax", "amin", "maximum", "minimum", "abs", "neg", "sign"):
    _op(_name, C, "selects or negates: exact in any float format",
        fns=[*_torch_fns(_name), *([operator.neg] if _name == "neg" else [])],
        methods=[_name, *(["__neg__"] if _name == "neg" else [])], aten=[_name])
_op("threshold", C, "keeps x or writes a given value: exact in any float format",
    fns=_torch_fns("threshold", "hardshrink"), methods=["hardshrink"], modules=_mods("Threshold", "Hardshrink"),
    aten=["threshold", "hardshrink"])
_op("im2col", C, _NEUTRAL + " (copies each sliding window's values, zero padding)", fns=[F.unfold],
    modules=_mods("Unfold"), aten=["im2col"])
_op("where", C, "selects between values: exact", fns=[torch.where], methods=["where"], aten=["where"])
_op("masked_fill", C, "fills selected values: exact", fns=[torch.masked_fill], methods=["masked_fill"],
    aten=["masked_fill"], index_args=(1, "mask"))
_op("max_pool", C, "max over windows: exact in any float format",
    fns=_torch_fns("max_pool1d", "max_pool2d", "max_pool3d", "adaptive_max_pool1d", "adaptive_max_pool2d",
                   "adaptive_max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices"),
    modules=_mods("MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d"),
    aten=["max_pool2d", "max_pool2d_with_indices", "max_pool1d", "max_pool3d", "adaptive_max_pool2d"], probe="max_pool")

# --------------------------------------------------------------------------- INFER
_ELEMENTWISE = "elementwise: as accurate as its inputs; low precision when its neighbours are"
for _name, _extra_fns, _methods, _mod in [
    ("add", [operator.add], ["add", "__add__", "__radd__"], ()),
    ("sub", [operator.sub], ["sub", "__sub__", "__rsub__", "rsub"], ()),
    ("mul", [operator.mul], ["mul", "__mul__", "__rmul__"], ()),
    ("div", [operator.truediv], ["div", "__truediv__", "__rtruediv__", "true_divide"], ()),
    ("addcmul", [], ["addcmul"], ()),
    ("addcdiv", [], ["addcdiv"], ()),
    ("lerp", [], ["lerp"], ()),
    ("gelu", [], ["gelu"], ("GELU",)),
    ("silu", [], ["silu"], ("SiLU",)),
    ("tanh", [], ["tanh"], ("Tanh",)),
    ("sigmoid", [], ["sigmoid"], ("Sigmoid",)),
    ("elu", [], ["elu"], ("ELU",)),
    ("selu", [], ["selu"], ("SELU",)),
    ("celu", [], ["celu"], ("CELU",)),
    ("leaky_relu", [], ["leaky_relu"], ("LeakyReLU",)),
    ("prelu", [], ["prelu"], ("PReLU",)),
    ("hardswish", [], ["hardswish"], ("Hardswish",)),
    ("hardsigmoid", [], ["hardsigmoid"], ("Hardsigmoid",)),
    ("softplus", [], ["softplus"], ("Softplus",)),
    ("softsign", [], ["softsign"], ("Softsign",)),
    ("mish", [], ["mish"], ("Mish",)),
    ("logsigmoid", [], [], ("LogSigmoid",)),
    ("sqrt", [], ["sqrt"], ()),
    ("erf", [], ["erf"], ()),
    ("glu", [], [], ("GLU",)),  # a * sigmoid(b), the halves of its input (conformer convolution modules)
    ("softshrink", [], ["softshrink"], ("Softshrink",)),
]:
    _op(_name, I, _ELEMENTWISE, fns=[*_torch_fns(_name), *_extra_fns], methods=_methods, modules=_mods(*_mod),
        aten=[_name], promotes=_name in ("add", "sub", "mul", "div"),
        additive=_name in ("add", "sub", "addcmul", "addcdiv", "lerp"))
_op("avg_pool", I, "window mean: the kernel accumulates in float32",
    fns=_torch_fns("avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d", "adaptive_avg_pool2d",
                   "adaptive_avg_pool3d"),
    modules=_mods("AvgPool1d", "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d"),
    aten=["avg_pool2d", "adaptive_avg_pool2d", "_adaptive_avg_pool2d", "avg_pool1d", "avg_pool3d"], probe="avg_pool")
_op("fold", I, "sums the few sliding windows that overlap each output: as accurate as its inputs", fns=[F.fold],
    modules=_mods("Fold"), aten=["col2im"])
_op("interpolate", I, "weighted sums of a few neighbours: as accurate as its inputs",
    fns=[F.interpolate, F.upsample], modules=_mods("Upsample", "UpsamplingNearest2d", "UpsamplingBilinear2d"),
    aten=["upsample_nearest2d", "upsample_bilinear2d"], probe="interpolate")
_NORM = ("normalisation: low-precision data in and out, statistics and affine parameters stay float32 "
         "(the kernel accumulates in float32)")
_op("batch_norm", I, _NORM, fns=[F.batch_norm, torch.batch_norm],
    modules=_mods("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d", "LazyBatchNorm2d"),
    aten=["batch_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
          "_native_batch_norm_legit_functional", "cudnn_batch_norm"],
    fp32_args=(1, 2, 3, 4, "running_mean", "running_var", "weight", "bias"), probe="batch_norm",
    fp32_accumulation=True)
_op("instance_norm", I, _NORM, fns=[F.instance_norm, torch.instance_norm],
    modules=_mods("InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"), aten=["instance_norm"],
    fp32_args=(1, 2, 3, 4, "running_mean", "running_var", "weight", "bias"), probe="batch_norm",
    fp32_accumulation=True)
_op("layer_norm", I, _NORM, fns=[F.layer_norm, torch.layer_norm], modules=_mods("LayerNorm"),
    aten=["layer_norm", "native_layer_norm"], fp32_args=(2, 3, "weight", "bias"), probe="layer_norm",
    fp32_accumulation=True)
_op("group_norm", I, _NORM, fns=[F.group_norm, torch.group_norm], modules=_mods("GroupNorm"),
    aten=["group_norm", "native_group_norm"], fp32_args=(2, 3, "weight", "bias"), probe="group_norm",
    fp32_accumulation=True)
_op("rms_norm", I, _NORM, fns=_torch_fns("rms_norm"), modules=_mods("RMSNorm"), aten=["rms_norm"],
    fp32_args=(2, "weight"), probe="rms_norm", fp32_accumulation=True)
_RANGE16 = "overflow float16's range (max 65504)"
_op("rsqrt", I, _ELEMENTWISE + " (bfloat16 has float32's range)", fns=_torch_fns("rsqrt"), methods=["rsqrt"],
    aten=["rsqrt"], fp16=(D, "1/sqrt(x): small inputs give large outputs that " + _RANGE16))
_op("reciprocal", I, _ELEMENTWISE + " (bfloat16 has float32's range)", fns=_torch_fns("reciprocal"),
    methods=["reciprocal"], aten=["reciprocal"], fp16=(D, "1/x: small inputs give large outputs that " + _RANGE16))
_SUM16 = ("reduction: a sum of many values can " + _RANGE16 + " and lose low bits; kept float32 "
          "(accumulating in the op's own dtype= argument)")
_SUMBF = "reduction: bfloat16 has float32's range and the kernel accumulates in float32"
_op("sum", I, _SUMBF, fns=[torch.sum, torch.nansum], methods=["sum", "nansum"], aten=["sum"],
    accum_dtype="dtype", fp16=(D, _SUM16), reduction=True, fp32_accumulation=True)
_op("mean", I, _SUMBF, fns=[torch.mean, torch.nanmean], methods=["mean", "nanmean"], aten=["mean"],
    accum_dtype="dtype", fp16=(D, _SUM16), reduction=True, fp32_accumulation=True)

# --------------------------------------------------------------------------- DENY
_op("softmax", D, "exp of its inputs overflows low precision and the normaliser needs float32 (softmax(..., dtype=float32))",
    fns=[F.softmax, torch.softmax, torch.special.softmax], methods=["softmax"], modules=_mods("Softmax", "Softmax2d"),
    aten=["softmax", "_softmax"], accum_dtype="dtype", writes_low=True)
_op("log_softmax", D, "exp/log of its inputs: needs float32 (log_softmax(..., dtype=float32))",
    fns=[F.log_softmax, torch.log_softmax, torch.special.log_softmax], methods=["log_softmax"],
    modules=_mods("LogSoftmax"), aten=["log_softmax", "_log_softmax"], accum_dtype="dtype")
_op("softmin", D, "exp of its inputs: needs float32", fns=[F.softmin], methods=["softmin"], modules=_mods("Softmin"),
    accum_dtype="dtype", writes_low=True)
_EXP = "|f(x)| >> |x|: overflows low precision"
for _name in ("exp", "expm1", "exp2", "pow", "square", "float_power"):
    _op(_name, D, _EXP, fns=[*_torch_fns(_name), *([operator.pow] if _name == "pow" else [])],
        methods=[_name, *(["__pow__", "__rpow__"] if _name == "pow" else [])], aten=[_name],
        # a power overflows bfloat16 no sooner than float32; its rounding is a few multiplies' (tanh-GELU's x**3)
        bf16=(I, "a power: bfloat16 has float32's range (no overflow risk beyond float32's) and "
                 "x**p rounds like p multiplies") if _name in ("pow", "square") else None)
_LOG = "log near 0 needs float32's precision and range"
for _name in ("log", "log1p", "log2", "log10"):
    _op(_name, D, _LOG, fns=_torch_fns(_name), methods=[_name], aten=[_name])
_PERIODIC = "periodic function of a possibly large argument: low precision loses the argument"
for _name in ("sin", "cos", "tan"):
    _op(_name, D, _PERIODIC, fns=_torch_fns(_name), methods=[_name], aten=[_name])
_FFT = ("Fourier transform: complex results have no bfloat16 dtype and the CPU kernels take float32/float64 only "
        "(CUDA's float16 FFT takes power-of-two sizes only); each output sums the whole signal: float32")
for _name in ("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2", "rfftn", "irfftn",
              "hfft", "ihfft", "hfft2", "ihfft2", "hfftn", "ihfftn"):
    _op(_name, D, _FFT, fns=[getattr(torch.fft, _name)], aten=[f"fft_{_name}"])
_op("stft", D, _FFT + " (short-time: one per window)", fns=[torch.stft], methods=["stft"], aten=["stft"])
_op("istft", D, _FFT + " (inverse short-time, overlap-added)", fns=[torch.istft], methods=["istft"], aten=["istft"])
_REDUCE = "reduction: loses precision summing many low-precision values; kept float32"
_op("var", D, _REDUCE, fns=_torch_fns("var", "var_mean"), methods=["var"], aten=["var", "var_mean"], reduction=True)
_op("std", D, _REDUCE, fns=_torch_fns("std", "std_mean"), methods=["std"], aten=["std", "std_mean"], reduction=True)
_op("norm", D, _REDUCE + " (squares overflow float16)",
    fns=[torch.norm, torch.linalg.norm, torch.linalg.vector_norm, torch.cdist, F.pairwise_distance],
    modules=_mods("PairwiseDistance"), methods=["norm"], aten=["norm", "linalg_vector_norm"], reduction=True)
_op("normalize", I, "x / max(norm(x), eps): the norm kernel accumulates in float32 and bfloat16 holds eps; "
    "follows its inputs", fns=[F.normalize, F.cosine_similarity], modules=_mods("CosineSimilarity"),
    fp16=(D, "x / max(norm(x), eps): eps (1e-12 by default, 1e-8 in cosine_similarity) is 0 in float16, so a "
             "zero vector gives 0/0 = NaN; float32"))
_op("cumsum", D, "running sum: every output carries the rounding of all before it",
    fns=_torch_fns("cumsum", "cumprod"), methods=["cumsum", "cumprod"], aten=["cumsum", "cumprod"],
    accum_dtype="dtype", reduction=True)
_op("prod", D, "product of many values overflows/underflows low precision", fns=[torch.prod], methods=["prod"],
    aten=["prod"], accum_dtype="dtype", reduction=True)
_op("logsumexp", D, "exp then sum: needs float32", fns=[torch.logsumexp], methods=["logsumexp"], aten=["logsumexp"],
    reduction=True)
_LOSS = "loss: a reduction of logs/squares over the batch; computed in float32"
for _name, _mod in [
    ("cross_entropy", "CrossEntropyLoss"), ("nll_loss", "NLLLoss"), ("mse_loss", "MSELoss"), ("l1_loss", "L1Loss"),
    ("smooth_l1_loss", "SmoothL1Loss"), ("huber_loss", "HuberLoss"), ("binary_cross_entropy", "BCELoss"),
    ("binary_cross_entropy_with_logits", "BCEWithLogitsLoss"), ("kl_div", "KLDivLoss"),
    ("poisson_nll_loss", "PoissonNLLLoss"), ("gaussian_nll_loss", "GaussianNLLLoss"),
    ("cosine_embedding_loss", "CosineEmbeddingLoss"), ("margin_ranking_loss", "MarginRankingLoss"),
    ("triplet_margin_loss", "TripletMarginLoss"), ("ctc_loss", "CTCLoss"), ("multi_margin_loss", "MultiMarginLoss"),
    ("soft_margin_loss", "SoftMarginLoss"), ("hinge_embedding_loss", "HingeEmbeddingLoss"),
]:
    _op(_name, D, _LOSS, fns=_torch_fns(_name), modules=_mods(_mod), aten=[_name])

# --------------------------------------------------------------------------- PASS
_NONFLOAT = "no float data: sizes, comparisons and indices are left as written"
for _name, _fns, _methods in [
    ("size", [], ["size", "dim", "numel", "nelement", "stride", "is_contiguous", "is_floating_point"]),
    ("compare", [operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge, operator.not_,
                 operator.and_, operator.or_, operator.xor, operator.invert, torch.eq, torch.ne, torch.lt, torch.le,
                 torch.gt, torch.ge, torch.logical_and, torch.logical_or, torch.logical_not, torch.logical_xor,
                 torch.isnan, torch.isinf, torch.isfinite, torch.isclose, torch.equal],
     ["eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "isnan", "isinf", "isfinite",
      "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__and__", "__or__", "__invert__", "bool"]),
    ("argmax", [torch.argmax, torch.argmin, torch.argsort, torch.nonzero, torch.any, torch.all, torch.bucketize,
                torch.searchsorted, F.one_hot],
     ["argmax", "argmin", "argsort", "nonzero", "any", "all", "long", "int", "item", "tolist"]),
    ("assert", [torch._assert,
                *([torch.fx._symbolic_trace._assert_is_none]
                  if hasattr(torch.fx._symbolic_trace, "_assert_is_none") else [])], []),
]:
    _op(_name, P, _NONFLOAT, fns=_fns, methods=_methods, result=Result.NONFLOAT,
        exact=_name in ("compare", "argmax"), chooses=_name == "argmax")
_op("getattr", P, _NONFLOAT + "; an attribute that holds a float tensor (topk(...).values) is a selection: it "
    "keeps the dtype the container's tensor has", fns=[builtins.getattr], result=Result.NONFLOAT, view=True,
    select=True, float_attrs=("values", "T", "mT", "H", "mH", "real", "imag", "data"))
_op("to", P, "explicit dtype or device conversion written in the model: kept as written",
    methods=["to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu", "cuda"],
    aten=["_to_copy", "to"], result=Result.CAST,
    cast_to=(("float", torch.float32), ("half", torch.float16), ("bfloat16", torch.bfloat16),
             ("double", torch.float64)),
    cast_like=("type_as",))
_op("factory", P, "creates a tensor; its dtype is set by its arguments",
    fns=[f for f in _torch_fns("arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "tensor",
                               "zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
                               "linspace", "eye", "as_tensor")],
    methods=["new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"], result=None,
    dtype_like=(*_torch_fns("zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like"),
                "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor",
                *(f"aten::{a}" for a in ("zeros_like", "ones_like", "full_like", "empty_like", "rand_like",
                                         "randn_like", "new_zeros", "new_ones", "new_full", "new_empty"))))
_op("embedding", P,
    "gathers rows of a float32 table: the table stays float32 and consumers that want low precision cast "
    "the gathered rows (cheaper than casting the whole table every step)",
    fns=[F.embedding, F.embedding_bag], modules=_mods("Embedding", "EmbeddingBag"), aten=["embedding"],
    result=Result.FP32)

del A, I, C, D, P

# --------------------------------------------------------------------------- module types traced through
TRACE_THROUGH: tuple[type, ...] = tuple(
    getattr(nn, n) for n in (
        "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
        "ConvTranspose3d", "Softmax", "LogSoftmax", "Softmin", "Identity", "Flatten", "Unflatten",
        "TransformerEncoderLayer", "TransformerDecoderLayer", "TransformerEncoder", "TransformerDecoder",
        "Transformer") if hasattr(nn, n))
"""``torch.nn`` types the tracer traces into: their ``forward`` has no ``training``-dependent Python,
their parameters become ``get_attr`` nodes the cast pass casts once, and attention internals are
visible to the policy. Every other ``torch.nn`` module stays a leaf (its mode stays switchable)."""

# --------------------------------------------------------------------------- torch.func's own calls
def _predispatch() -> list[Any]:
    """torch.export's Python wrappers of the torch.func calls (torch >= 2.5 writes these into graphs)."""
    try:
        from torch._functorch import predispatch
    except ImportError:  # torch 2.2 (the DGL lane) writes the C functions themselves
        return []
    return [fn for name, fn in vars(predispatch).items() if callable(fn) and getattr(fn, "__module__", "") ==
            predispatch.__name__ and not name.startswith("__")]


TRANSFORM_CALLS: frozenset = frozenset([*(fn for fn in vars(torch._C._functorch).values() if callable(fn)),
                                        *_predispatch()])
"""The calls with which a graph opens and closes a torch.func level and moves values across it
(``_vmap_increment_nesting``, ``_add_batch_dim``, ...: torch.export writes ``torch.vmap`` as these, as in HF's
attention masks). Their results belong to one level: a run that reuses results of calls with equal sizes
(:class:`~ampfx.ops.shape_memo.ShapeMemo`) never reuses theirs."""

TRANSFORM_OPENS: frozenset = frozenset(fn for fn in TRANSFORM_CALLS if getattr(fn, "__name__", "") in (
    "_vmap_increment_nesting", "_jvp_increment_nesting", "_grad_increment_nesting", "_enter_dual_level"))
"""The calls that open a torch.func level (:mod:`ampfx.passes.transforms` runs each level as one eager call)."""
TRANSFORM_CLOSES: frozenset = frozenset(fn for fn in TRANSFORM_CALLS if getattr(fn, "__name__", "") in (
    "_vmap_decrement_nesting", "_jvp_decrement_nesting", "_grad_decrement_nesting", "_exit_dual_level"))
"""The calls that close one."""
TRANSFORM_SETUP: frozenset = frozenset(fn for fn in TRANSFORM_CALLS
                                       if getattr(fn, "__name__", "") == "lazy_load_decompositions")
"""A call torch.export writes just before a vmap level opens (it loads vmap's decompositions): part of the level."""


# --------------------------------------------------------------------------- what the report counts as a GEMM
ATEN_GEMMS: frozenset = frozenset(getattr(torch.ops.aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm",  # what linear, matmul, einsum and bilinear come down to
    "convolution",  # every conv and transposed conv
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",  # fused attention:
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",  # one call, two products
) if hasattr(torch.ops.aten, name))
"""The ATen ops (packets) the report counts as one GEMM each: a node's ``Decision.gemms`` is how many of
them it runs per call (:mod:`ampfx.passes.gemms`). A leaf module or an opaque function counts every one
it runs (``nn.MultiheadAttention`` several); a recurrent module run by oneDNN's fused kernel
(``mkldnn_rnn_layer``, ``nn.LSTM`` on CPU) runs none of them."""

# --------------------------------------------------------------------------- ATen-only spellings
# Graphs captured by torch.export (ampfx.capture.export) call ATen ops. Most share their packet name with the
# torch function (``aten.linear`` is ``F.linear``) and are keyed above; these are the ones whose name
# differs, or that the torch-level API has no function for. Same op, same rule, same env overrides.
_ATEN_ONLY: dict[str, tuple[str, ...]] = {
    "size": ("sym_size", "sym_numel", "sym_stride", "sym_storage_offset"),  # symbolic sizes: ints
    "assert": ("_assert_scalar", "_assert_async", "_functional_assert_async", "sym_constrain_range",
               "sym_constrain_range_for_size"),
    "compare": ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "logical_xor",
                "bitwise_and", "bitwise_or", "bitwise_not", "bitwise_xor", "__and__", "__or__", "__invert__",
                "isnan", "isinf", "isfinite", "isclose"),
    "argmax": ("argmax", "argmin", "argsort", "nonzero", "any", "all", "bucketize", "searchsorted", "one_hot",
               "_local_scalar_dense"),
    "factory": ("arange", "zeros", "ones", "full", "empty", "rand", "randn", "randint", "scalar_tensor",
                "zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like", "linspace", "eye",
                "new_zeros", "new_ones", "new_full", "new_empty", "empty_strided", "new_empty_strided"),
    "to": ("type_as", "_to_dtype"),  # explicit conversions written in the model: kept as written
    "sub": ("rsub",),
    "clamp": ("clamp_min", "clamp_max"),
    "narrow": ("slice",),  # x[:, :3]
    "view": ("alias", "_unsafe_view", "as_strided", "view_as_real", "view_as_complex"),
    "clone": ("lift_fresh_copy", "copy"),  # copy_ writes into its own tensor's dtype
    "split": ("split_with_sizes", "unsafe_split"),
    "getitem": ("index",),  # x[idx]: keeps its input's dtype, consumers cast the selection
    "masked_fill": ("index_put", "fill", "zero", "masked_fill"),  # writes given values: exact
    "dropout": ("feature_dropout", "alpha_dropout", "feature_alpha_dropout"),
    "pad": ("pad", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
            "replication_pad2d", "replication_pad3d"),
    "avg_pool": ("adaptive_avg_pool1d", "adaptive_avg_pool3d", "_adaptive_avg_pool3d"),
    "max_pool": ("max_pool1d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d",
                 "adaptive_max_pool3d"),
    "interpolate": ("upsample_nearest1d", "upsample_nearest3d", "upsample_linear1d", "upsample_bicubic2d",
                    "upsample_trilinear3d", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                    "_upsample_nearest_exact3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"),
    "batch_norm": ("_batch_norm_with_update", "_batch_norm_with_update_functional", "_batch_norm_no_update"),
    "cross_entropy": ("cross_entropy_loss",),
    "nll_loss": ("nll_loss_nd", "nll_loss2d", "nll_loss_forward"),
    "embedding": ("embedding_bag", "_embedding_bag"),
    # the FFT primitives the torch.fft functions decompose to (core ATen): real -> complex, complex -> real, complex
    "rfft": ("_fft_r2c",),
    "irfft": ("_fft_c2r",),
    "fft": ("_fft_c2c",),
}
for _name, _packets in _ATEN_ONLY.items():
    for _p in _packets:
        _key = f"aten::{_p}"
        assert _ALIASES.get(_key, _name) == _name, f"{_key!r} is both {_ALIASES[_key]!r} and {_name!r}"
        _ALIASES[_key] = _name

# Ops of other libraries, matched by qualified name so that ampfx imports none of them.
_BY_QUALNAME: dict[str, str] = {
    "torchvision.ops.stochastic_depth.stochastic_depth": "dropout",
    "timm.layers.drop.drop_path": "dropout",
    "timm.models.layers.drop.drop_path": "dropout",
    "timm.layers.drop.drop_block_2d": "dropout",
    "timm.layers.drop.drop_block_fast_2d": "dropout",
    "ampfx.runtime.assert_is_none": "assert",  # the guard generated code calls (the tables import no runtime)
}


def register_library(entries: Iterable[tuple[str, Category, str, Iterable[str]]]) -> None:
    """Add another library's ops to the tables: ``(canonical name, list, reason, qualified names)``
    each, the qualified names being the library's module types and functions that the op covers.
    Their tables live with their integration (data only: importing it imports no library), which
    registers them when ampfx's first public name is used (:mod:`ampfx.libraries`); this module imports none.

    >>> import ampfx.libraries  # what ampfx.convert, ampfx.Policy, ... import first
    >>> "dgl.GATConv" in ENTRIES and lookup_name("dgl.GATConv")
    'dgl.GATConv'
    """
    for name, category, reason, qualnames in entries:
        _op(name, category, reason)
        for q in qualnames:
            assert _BY_QUALNAME.get(q, name) == name, f"{q!r} is both {_BY_QUALNAME[q]!r} and {name!r}"
            _BY_QUALNAME[q] = name


def register(entry: OpEntry, library: str, qualname: str | None = None) -> None:
    """Put ``entry`` in the tables for ``library`` (replacing its earlier entry), matched by name and, for a
    Python function, by ``qualname``. :func:`ampfx.register_op` checks the call and builds the entry."""
    ENTRIES[entry.name] = entry
    REGISTERED[entry.name] = library
    _ALIASES.setdefault(entry.name, entry.name)
    if qualname is not None:
        _BY_QUALNAME[qualname] = entry.name


# --------------------------------------------------------------------------- lookup
def library_functions() -> list[Callable]:
    """The functions of other libraries named in the tables (``_BY_QUALNAME``)
    whose library is already imported (this imports nothing). The tracer keeps
    them whole, so the table, not their body, decides their dtype."""
    found = []
    for qualname in _BY_QUALNAME:
        module_name, _, attr = qualname.rpartition(".")
        fn = getattr(sys.modules.get(module_name), attr, None)
        if isinstance(fn, types.FunctionType) and qualified_name(fn) == qualname:
            found.append(fn)
    return found


def lookup_name(key: Any) -> str | None:
    """The canonical op name for a torch callable, ``Tensor`` method name,
    module type or ATen op; ``None`` if it is in no table.

    In-place spellings (``add_``, ``F.relu_``) name the same op as their
    out-of-place form. Module types match through their base classes, so a
    subclass of ``nn.Linear`` is ``linear``.
    """
    if isinstance(key, type):
        for base in key.__mro__:
            if base in _ALIASES:
                return _ALIASES[base]
        for base in key.__mro__:  # other libraries' types, and user subclasses of them
            if base is not object and qualified_name(base) in _BY_QUALNAME:
                return _BY_QUALNAME[qualified_name(base)]
        return None
    if isinstance(key, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        packet = key.overloadpacket if isinstance(key, torch._ops.OpOverload) else key
        namespace, _, name = packet._qualified_op_name.partition("::")
        if namespace != "aten":  # mylib::relu is not aten's relu (custom ops: ampfx.ops.custom_ops)
            return None
        return _ALIASES.get(f"aten::{name}") or _ALIASES.get(f"aten::{name.rstrip('_')}")
    try:
        hit = _ALIASES.get(key)
    except TypeError:  # unhashable
        return None
    if hit is None and isinstance(key, str) and key.endswith("_") and not key.endswith("__"):
        hit = _ALIASES.get(key[:-1])
    if hit is None and callable(key) and not isinstance(key, str):
        hit = _BY_QUALNAME.get(qualified_name(key))
    return hit


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a function or class, as users type it in env variables.

    >>> qualified_name(torch.linalg.inv), qualified_name(torch.fft.rfft), qualified_name(torch.special.erfcx)
    ('torch.linalg.inv', 'torch.fft.rfft', 'torch.special.erfcx')
    """
    if isinstance(obj, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(obj)  # aten.add_.Tensor
    module = getattr(obj, "__module__", None) or type(obj).__module__
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    if qual.startswith("_VariableFunctionsClass."):  # torch.add and friends are C builtins
        return f"torch.{qual.split('.', 1)[1]}"
    for short in ("fft", "linalg", "special"):  # torch.linalg.inv is torch._C._linalg.linalg_inv
        if module == f"torch._C._{short}" and qual.startswith(f"{short}_"):
            return f"torch.{short}.{qual[len(short) + 1:]}"
    public = {"torch._C._nn": "torch.nn.functional", "torch._C._special": "torch.special",
              "torch._C._linalg": "torch.linalg", "_operator": "operator"}
    return f"{public.get(module, module)}.{qual}"


def known_names() -> list[str]:
    """Every name accepted where an op is typed: canonical names and method names."""
    return sorted({k for k in _ALIASES if isinstance(k, str) and not k.startswith("aten::")} | set(ENTRIES))


def aliases_of(name: str) -> list[Any]:
    """Every key (callable, method name, module type, ATen name, other libraries'
    qualified names) that maps to ``name``."""
    return [k for k, v in _ALIASES.items() if v == name and k != name] + [
        f"lib::{q}" for q, v in _BY_QUALNAME.items() if v == name]


# --------------------------------------------------------------------------- values handed through Python
MOVES: frozenset[str] = frozenset({*_views, "getitem", "cat", "stack", "max", "min", "amax", "amin", "abs", "neg",
                                    "relu", "max_pool"})
"""Ops (canonical names) that move, copy, reshape or select values without arithmetic (``max`` and ``abs`` too,
exact in any float format): what they make of low-precision values is, upcast, what they make of those values
upcast. Where a module's Python only moves a converted child's outputs into other converted children, those
hand each other the low dtype (:mod:`ampfx.runtime.handing`)."""

MOVE_METHODS: frozenset[str] = frozenset({"to", "cpu", "cuda", "data", "T", "mT", "H", "mH"})
"""``Tensor`` methods and attributes that move a tensor when no dtype is named (a device move, a view)."""

DTYPE_ATTRS: frozenset[str] = frozenset({"dtype"})
"""``Tensor`` attributes that say the dtype a tensor is computed in: for a value ampfx computes low, the model's
own dtype is what its code read there (:mod:`ampfx.passes.dtype_reads`)."""

TO_PYTHON: frozenset[str] = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__"})
"""``Tensor`` methods that read values into Python numbers: the same numbers from a low-precision tensor as from
its float32 upcast."""

SIZE_ATTRS: frozenset[str] = frozenset({
    "shape", "size", "dim", "ndim", "ndimension", "numel", "nelement", "stride", "storage_offset", "is_contiguous",
    "device", "is_cuda", "is_cpu", "is_meta", "layout", "is_sparse", "is_quantized", "is_floating_point",
    "is_complex", "requires_grad", "is_leaf", "__len__", "get_device", "names"})
"""``Tensor`` methods and attributes that read what a tensor is, not its values: the same for a tensor
and its low-precision copy (``dtype`` and ``element_size`` are not)."""


# --------------------------------------------------------------------------- facts the passes ask
INPLACE_OPERATORS: frozenset[Callable] = frozenset(
    {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv})
"""Python operators that write into their first argument (``x[i] = v``, ``x += y`` on a tensor).
Methods and ATen ops say so by their name (:func:`is_inplace_name`); modules by ``inplace=True``."""

INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                             "__imod__", "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                             "__irshift__"})
"""Methods that write their tensor when called by name (``a.__setitem__(0, 1.0)``); ``a[0] = 1.0`` and
``a += b`` reach a graph as the operators of :data:`INPLACE_OPERATORS`."""


def is_inplace_name(name: str) -> bool:
    """Does the method or op called ``name`` write its first argument? ATen's schema says, where ATen has an
    op of that name (:func:`writes_first_argument`); a name ATen does not know (a user's tensor subclass
    method) by torch's naming convention, a trailing underscore.

    >>> is_inplace_name("add_"), is_inplace_name("__iadd__"), is_inplace_name("__add__"), is_inplace_name("add")
    (True, True, False, False)
    >>> is_inplace_name("__eq__"), is_inplace_name("__hash__")
    (False, False)
    """
    if name in INPLACE_DUNDERS:
        return True
    written = _aten_writes_first(name)
    return written if written is not None else name.endswith("_") and not name.endswith("__")


def writes_first_argument(target: Any) -> bool:
    """Does the ATen op ``target`` (an ``OpOverload``) write its first argument (``Tensor(a!) self``)?
    Read from its schema's alias annotation; an op that writes another argument (batch norm's running
    statistics, an ``out=`` overload) does not count.

    >>> writes_first_argument(torch.ops.aten.add_.Tensor), writes_first_argument(torch.ops.aten.add.out)
    (True, False)
    """
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


@functools.lru_cache(maxsize=None)
def _aten_writes_first(name: str) -> bool | None:
    """Whether the ATen op called ``name`` writes its first argument in any overload; ``None``: ATen has none."""
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None
    if not isinstance(packet, torch._ops.OpOverloadPacket):  # a dunder of the namespace object (__eq__, __hash__)
        return None
    overloads = [getattr(packet, o) for o in packet.overloads()]
    return any(writes_first_argument(o) for o in overloads) if overloads else None


def is_view(name: str) -> bool:
    """May op ``name``'s result share storage with its first argument (``OpEntry.view``)?

    >>> is_view("transpose"), is_view("getitem"), is_view("add"), is_view("Tensor.custom")
    (True, True, False, False)
    """
    entry = ENTRIES.get(name)
    return entry is not None and entry.view


def is_inplace_operator(target: Any) -> bool:
    """Is ``target`` one of :data:`INPLACE_OPERATORS`?

    >>> import operator
    >>> is_inplace_operator(operator.setitem), is_inplace_operator(operator.add)
    (True, False)
    """
    return any(target is op for op in INPLACE_OPERATORS)

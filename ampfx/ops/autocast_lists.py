"""torch.autocast's op lists: which ops autocast runs in the low dtype, in float32, or in the widest input dtype.

This module is data, for reporting only (``Decision.autocast``, ``Report.autocast_diff()``); it decides
nothing about ampfx's own dtypes. torch keeps these lists in C++ (``aten/src/ATen/autocast_mode.h`` and
``autocast_mode.cpp``) and exposes no Python view of them; the names below are copied from there as the
dispatcher of torch 2.13 reports them (``"op"`` or ``"op.overload"``, without ``aten::``). Which ops have
an autocast kernel at all *is* visible to Python (``torch._C._dispatch_has_kernel_for_dispatch_key(name,
"AutocastCPU")``): ``tests/test_autocast_diff.py`` checks that this table names exactly those ops, and runs
the ops ampfx knows under real CPU autocast (and CUDA autocast on fake CUDA tensors) to check each kind.

Every op not listed for a device runs, under autocast, in whatever dtype its inputs give it.

>>> from ampfx.ops.autocast_lists import Cast, kind_of_aten, kind_of_op
>>> kind_of_aten("cpu", "linear"), kind_of_aten("cuda", "softmax", "int"), kind_of_aten("cpu", "softmax")
(<Cast.LOWER: 'lower_precision_fp'>, <Cast.FP32_SET_OPT_DTYPE: 'fp32_set_opt_dtype'>, None)
>>> kind_of_op("cuda", "layer_norm"), kind_of_op("cpu", "mse_loss"), kind_of_op("cpu", "gelu")
(<Cast.FP32: 'fp32'>, <Cast.FP32: 'fp32'>, None)
"""
from __future__ import annotations

import enum
import functools

import torch

from .. import ops


class Cast(str, enum.Enum):
    """What autocast does to an op's float32/16/bf16 tensor arguments (torch's ``CastPolicy``)."""

    LOWER = "lower_precision_fp"  #: all cast to the low dtype: the op computes in it
    FP32 = "fp32"  #: all cast to float32
    FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"  #: ``dtype=float32`` added when the first is eligible, unless given
    FP32_APPEND_DTYPE = "fp32_append_dtype"  #: the overload taking a dtype is called with float32
    PROMOTE = "promote"  #: all cast to the widest of them


FLOAT32_KINDS = frozenset({Cast.FP32, Cast.FP32_SET_OPT_DTYPE, Cast.FP32_APPEND_DTYPE})
"""The kinds whose op computes in float32 when its first float argument is eligible."""

ATEN = "aten"
"""The namespace of the ops these lists name (``torch.ops.aten``)."""

AMBIGUOUS = "ambiguous"
""":func:`kind_of_op` for an ampfx op whose ATen ops autocast treats differently (``avg_pool``: avg_pool3d
is float32 on CPU, avg_pool2d is not listed)."""

_CONV_CPU = ("conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding",
             "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "_convolution.deprecated",
             "conv_tbc")
_LOSSES = ("mse_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss",
           "smooth_l1_loss", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
           "triplet_margin_loss", "multi_margin_loss", "kl_div", "multilabel_margin_loss",
           "binary_cross_entropy_with_logits")

LISTS: dict[str, dict[Cast, tuple[str, ...]]] = {
    # autocast_mode.cpp, TORCH_LIBRARY_IMPL(aten, AutocastCPU, m): one list for bfloat16 and float16
    "cpu": {
        Cast.LOWER: (*_CONV_CPU, "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "addbmm", "linear", "matmul",
                     "_addmm_activation", "mkldnn_rnn_layer", "prelu", "scaled_dot_product_attention",
                     "_native_multi_head_attention"),
        Cast.FP32: (*_LOSSES, "cross_entropy_loss", "binary_cross_entropy", "ctc_loss.IntList", "ctc_loss.Tensor",
                    "multilabel_margin_loss_forward",
                    "avg_pool3d", "adaptive_avg_pool3d", "max_pool3d", "adaptive_max_pool3d", "max_unpool2d",
                    "max_unpool3d", "fractional_max_pool2d", "fractional_max_pool3d",
                    "reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d",
                    "replication_pad3d",
                    "grid_sampler", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d",
                    "polar", "view_as_complex", "prod", "prod.dim_int", "quantile", "quantile.scalar", "nanquantile",
                    "nanquantile.scalar", "stft", "stft.center", "cdist", "trace", "fake_quantize_per_tensor_affine",
                    "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr",
                    "pinverse", "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve",
                    "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft",
                    "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft",
                    "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank", "linalg_matrix_rank.atol_rtol_tensor",
                    "linalg_matrix_rank.atol_rtol_float", "linalg_matrix_rank.tol_tensor", "linalg_solve",
                    "linalg_cholesky", "linalg_cholesky_ex", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh",
                    "linalg_inv", "linalg_inv_ex", "linalg_householder_product", "linalg_tensorinv",
                    "linalg_tensorsolve", "linalg_qr", "linalg_svd", "linalg_eig", "linalg_eigh", "linalg_lstsq"),
        Cast.PROMOTE: ("stack", "cat", "index_copy"),
    },
    # autocast_mode.h AT_FORALL_LOWER_PRECISION_FP / _FP32 / _FP32_SET_OPT_DTYPE / _DIFFERENT_REDISPATCH_SIGNATURE /
    # _PROMOTE, registered for AutocastCUDA, plus the cuDNN convolutions registered beside them
    "cuda": {
        Cast.LOWER: ("_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
                     "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
                     "cudnn_convolution", "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul",
                     "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
                     "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
                     "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention",
                     "scaled_dot_product_attention"),
        Cast.FP32: ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
                    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
                    "layer_norm", "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm.dim",
                    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", *_LOSSES, "dist", "pdist", "cdist",
                    "renorm", "logsumexp", "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d",
                    "_upsample_nearest_exact2d", "upsample_nearest3d", "_upsample_nearest_exact3d",
                    "upsample_linear1d", "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
                    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
                    "binary_cross_entropy"),  # banned: autocast raises ("unsafe to autocast"), the op never runs
        Cast.FP32_SET_OPT_DTYPE: ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                                  "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                                  "sum.dim_IntList"),
        Cast.FP32_APPEND_DTYPE: ("norm.Scalar", "norm.ScalarOpt_dim"),
        Cast.PROMOTE: ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
                       "index_put", "tensordot", "scatter_add"),
    },
}
"""device type -> :class:`Cast` -> ATen op names (``"op"`` or ``"op.overload"``) autocast has a kernel for."""

DECOMPOSED: dict[str, dict[str, Cast]] = {
    "cpu": {"einsum": Cast.LOWER},  # its CompositeImplicit kernel calls bmm, lower_precision_fp on CPU
    "cuda": {"cross_entropy_loss": Cast.FP32},  # calls log_softmax (fp32_set_opt_dtype) and nll_loss (fp32)
}
"""Ops autocast does not list that run, inside their kernel, a listed op that sets their dtype (found by
``tests/test_autocast_diff.py``, which runs every op ampfx knows under autocast): they act as that kind."""

BANNED: dict[str, frozenset[str]] = {"cuda": frozenset({"binary_cross_entropy"})}
"""Ops autocast refuses on a device (it raises and says to use the ``_with_logits`` form)."""

FIRST_OUTPUT: dict[str, Cast] = {"multi_head_attention": Cast.LOWER}
"""ampfx ops made of other ops whose first output comes from a listed op on every device (attention's
output projection is a linear): that output takes the op's kind; their other outputs (attention
weights) are not known."""

COMPOSITE = frozenset({"lstm", "gru", "rnn", "normalize"})
"""ampfx ops whose dtype under autocast is set by the ops run inside them (a recurrent module's
GEMMs, attention's projections, ``F.normalize``'s norm), not by a list entry of their own:
``"unknown"`` in the report."""

ROUTERS: dict[str, tuple[str, ...]] = {
    "pad": ("constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
            "replication_pad2d", "replication_pad3d", "_pad_circular"),
}
"""ATen ops that only pick another op by their arguments (``F.pad``'s ``mode``): their kind is the one the
ops they pick share, else not known."""


def devices() -> tuple[str, ...]:
    """The device types this table covers (others: autocast's dtype is not reported)."""
    return tuple(LISTS)


@functools.lru_cache(maxsize=None)
def _overloads(device: str) -> dict[tuple[str, str], Cast]:
    """``(packet, overload)`` -> kind, the overload ``"default"`` for a name without one."""
    return {(*name.split(".", 1), "default")[:2]: kind
            for kind, names in LISTS.get(device, {}).items() for name in names}


def kind_of_aten(device: str, name: str, overload: str | None = None) -> Cast | None:
    """The kind of ATen op ``name`` on ``device`` (``None``: not listed). Without ``overload``, the kind of
    the packet's listed overloads; with it (``"default"`` for the unnamed one), of that overload alone: an
    overload of a listed packet that is not itself listed is ``None`` (``norm.ScalarOpt_dim_dtype``).

    >>> kind_of_aten("cuda", "sum"), kind_of_aten("cuda", "norm", "ScalarOpt_dim_dtype")
    (<Cast.FP32_SET_OPT_DTYPE: 'fp32_set_opt_dtype'>, None)
    """
    table = _overloads(device)
    decomposed = DECOMPOSED.get(device, {}).get(name)
    if overload is not None:
        return table.get((name, overload), decomposed)
    kinds = {kind for (packet, _), kind in table.items() if packet == name}
    return kinds.pop() if len(kinds) == 1 else decomposed


def is_composite(name: str) -> bool:
    """Does ATen op ``name`` run as other ATen ops (a CompositeImplicitAutograd kernel)? Under autocast
    such an op may take the dtype of a listed op inside it (:data:`DECOMPOSED`).

    >>> is_composite("einsum"), is_composite("gelu")
    (True, False)
    """
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "CompositeImplicitAutograd")
    except RuntimeError:  # no default overload
        return False


@functools.lru_cache(maxsize=None)
def kind_of_op(device: str, op: str) -> Cast | str | None:
    """The kind of ampfx op ``op`` (a canonical name of :mod:`ampfx.ops`) on ``device``: that of the ATen op
    of the same name where there is one (``softmax``; a router such as ``pad`` by the ops it picks), else
    the kind the op's ATen ops share; :data:`AMBIGUOUS` where they differ (``max_pool``: max_pool3d is
    float32 on CPU, max_pool2d is not listed), ``None`` where none is listed."""
    if op in FIRST_OUTPUT:
        return FIRST_OUTPUT[op]
    if is_aten(op):
        names: tuple[str, ...] = ROUTERS.get(op, (op,))
    else:
        names = tuple(a for a in (str(k)[len("aten::"):] for k in ops.aliases_of(op) if str(k).startswith("aten::"))
                      if is_aten(a))
    kinds = {kind_of_aten(device, a) for a in names}
    if len(kinds) > 1:
        return AMBIGUOUS
    return kinds.pop() if kinds else None


@functools.lru_cache(maxsize=None)
def is_aten(name: str) -> bool:
    """Is ``name`` an ATen operator packet (``torch.ops.aten.<name>``)?

    >>> is_aten("softmax"), is_aten("cross_entropy"), is_aten("cross_entropy_loss")
    (True, False, True)
    """
    return bool(name) and hasattr(torch.ops.aten, name)
